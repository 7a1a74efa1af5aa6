"""kernels.transpose on the GPU: bytes equal the torch twin's, padding zero, every shape."""
import pytest
import torch

from fp8train.kernels.transpose import transpose_into, transpose_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("m, n, mp", [(1, 16, 16), (37, 48, 48), (200, 4096, 208), (1000, 1003, 1008),
                                      (8192, 16384, 8192), (4096, 64, 4112)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_transpose_matches_the_twin(m, n, mp, dtype):
    src = torch.randint(0, 256, (m, n), dtype=torch.uint8, device=DEV).view(dtype)  # every byte, NaNs too
    for poison in (0x5A, 0xA5):
        got = torch.full((n, mp), poison, dtype=torch.uint8, device=DEV).view(dtype)
        want = torch.empty_like(got)
        transpose_into(src, got)
        transpose_reference(src, want)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"poison {poison:#x}"
