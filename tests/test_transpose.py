"""kernels.transpose: the twin's contract on CPU, argument checks, and the Triton kernel under
the interpreter when TRITON_INTERPRET=1 (tests/interpret runs it)."""
import pytest
import torch

from fp8train.kernels.transpose import transpose_into


def test_twin_contract():
    src = torch.randint(0, 256, (5, 32), dtype=torch.uint8).view(torch.float8_e4m3fn)
    dst = torch.full((32, 16), 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
    transpose_into(src, dst)  # CPU: the twin
    assert torch.equal(dst[:, :5].view(torch.uint8), src.view(torch.uint8).t())
    assert int(dst[:, 5:].view(torch.uint8).abs().sum()) == 0


def test_bad_arguments():
    src = torch.zeros(5, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="Mp >= M"):
        transpose_into(src, torch.zeros(32, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="1-byte"):
        transpose_into(src, torch.zeros(32, 16, dtype=torch.float8_e5m2))
    with pytest.raises(ValueError, match="1-byte"):
        transpose_into(torch.zeros(5, 32), torch.zeros(32, 16))
