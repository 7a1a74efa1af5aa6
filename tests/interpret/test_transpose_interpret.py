"""The Triton byte-transpose kernel under TRITON_INTERPRET=1: bytes equal the twin's."""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (make test runs it)", allow_module_level=True)
pytest.importorskip("triton")

from fp8train.kernels import transpose  # noqa: E402


@pytest.mark.parametrize("m, n, mp", [(1, 16, 16), (37, 48, 48), (70, 130, 80), (64, 64, 64)], ids=str)
def test_kernel_matches_the_twin(m, n, mp):
    src = torch.randint(0, 256, (m, n), dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = torch.full((n, mp), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = torch.empty_like(got)
    tiles = -(-mp // transpose._BLOCK_M) * -(-n // transpose._BLOCK_N)
    transpose._kernel(False)(min(tiles, 3), src.view(torch.uint8), got.view(torch.uint8), got, m, n, mp)
    transpose.transpose_reference(src, want)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("flag", [0, 1, -3], ids=lambda f: f"flag{f}")
def test_skip_flag(flag):
    """SKIP: a nonzero device flag leaves dst untouched; zero transposes as usual."""
    src = torch.randint(0, 256, (37, 48), dtype=torch.uint8).view(torch.float8_e5m2)
    got = torch.full((48, 48), 0x5A, dtype=torch.uint8).view(torch.float8_e5m2)
    want = got.clone()
    skip = torch.tensor(flag, dtype=torch.int32)
    transpose._kernel(True)(3, src.view(torch.uint8), got.view(torch.uint8), skip, 37, 48, 48)
    transpose.transpose_reference(src, want, skip=skip)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got.view(torch.uint8) == 0x5A, torch.ones_like(got.view(torch.uint8), dtype=torch.bool)) \
        == bool(flag)
