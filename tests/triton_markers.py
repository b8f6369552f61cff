"""What the Triton kernel tests share: the skip markers and the device their tensors live on (conftest.py
puts Triton's CPU interpreter in place where there is no GPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (optional GPU extra)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
