"""Kernels of pat-engine: Triton for the GPU (imported only where CUDA and Triton are present, or
for testing under ``TRITON_INTERPRET=1``), and C++ for the CPU (``cpu_extension`` compiles
``cpu/*.cpp`` on first use; ``cpu_attention``, ``cpu_norm`` and ``cpu_rotary`` hand out its kernels)."""
