"""What the Triton kernel tests share: Triton's CPU interpreter where there is no GPU (set before anything
imports triton, so import this first), the skip markers, and the device the tensors live on."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the import of triton
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (optional GPU extra)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
