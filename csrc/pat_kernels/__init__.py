"""GPU kernels of pat-engine (Triton). Imported only when a CUDA device and Triton are present,
or for testing under ``TRITON_INTERPRET=1`` on the CPU."""
