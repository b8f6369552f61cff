"""The parts of ``bench/gpu_check.py``, one file each (issue 30, item 6).

- ``registry.py``: the parts in run and report order, their expected seconds and timeouts (a new part: one
  module with ``run(ctx) -> PartResult`` and one entry there);
- ``shared.py``: sizes and rooflines, the interleaved timer, the run's context, the engine the parts start;
- ``checkpoint.py``: the random Llama checkpoint; ``executor.py``: one ``InferExecutor`` driven in process;
- ``report.py``: sections, the sidecar JSON, the results file; ``environment.py``: the machine line;
- the parts: ``attention``, ``kernels``, ``prefill``, ``decode``, ``emulated_profile`` (part ``profile``),
  ``graphs``, ``weightsync``, ``gpu_tests`` (part ``tests``).
"""
