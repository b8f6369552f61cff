"""CPU row padding in the linear layers: same rows out, for every batch size a decode step can have."""

import pytest
import torch
import torch.nn.functional as F

from pat_engine.model.layers.linear import linear


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 13, 255, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_padded_linear_matches_plain(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, dtype=torch.float64, generator=g)
    w = torch.randn(40, 24, dtype=torch.float64, generator=g)
    b = torch.randn(40, dtype=torch.float64, generator=g) if bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, 40)
    assert out.is_contiguous()  # row-parallel layers all-reduce it in place
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_three_dimensional_input_is_left_alone() -> None:
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    w = torch.randn(6, 8, dtype=torch.float64)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
