"""kernels/colsum.py's Triton kernel under the interpreter against its twin and float64:
odd shapes (P and N not multiples of the blocks, P = 1, N below one block), one and two
sums, every output dtype; sums agree within float32 rounding of the sum (the kernel's
order is blocks of rows, not torch.sum's), and the twin rounds once into the output."""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (make test runs it)", allow_module_level=True)
pytest.importorskip("triton")

from fp8train.kernels import colsum  # noqa: E402


@pytest.mark.parametrize("s,p,n", [(1, 1, 1), (1, 37, 100), (2, 70, 65), (2, 264, 130), (1, 5, 3)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_colsum_matches_float64(s, p, n, out_dtype):
    src = torch.randn(s, p, n) * torch.rand(s, p, 1) * 100
    outs = [torch.full((n,), float("nan"), dtype=out_dtype) for _ in range(s)]
    colsum.colsum_into(src, outs)
    twin = [torch.empty(n, dtype=out_dtype) for _ in range(s)]
    colsum.colsum_reference(src, twin)
    for k in range(s):
        exact = src[k].double().sum(dim=0)
        bound = 4 * p * torch.finfo(torch.float32).eps * src[k].double().abs().sum(dim=0)
        got = outs[k].double()
        if out_dtype == torch.float32:
            assert ((got - exact).abs() <= bound).all()
        else:  # rounded once into out_dtype: within half an ulp of it, plus the float32 error
            ulp = torch.finfo(out_dtype).eps * exact.abs()
            assert ((got - exact).abs() <= bound + ulp).all()
            assert ((twin[k].double() - exact).abs() <= bound + ulp).all()


def test_colsum_writes_every_column_and_only_its_outputs():
    src = torch.ones(2, 3, 130)
    a, b = torch.full((130,), -1.0), torch.full((130,), -1.0)
    colsum.colsum_into(src, (a, b))
    assert torch.equal(a, torch.full((130,), 3.0)) and torch.equal(b, torch.full((130,), 3.0))


def test_colsum_rejects_bad_arguments():
    with pytest.raises(ValueError, match="float32"):
        colsum.colsum_into(torch.ones(1, 2, 3, dtype=torch.float16), (torch.empty(3),))
    with pytest.raises(ValueError, match="outputs"):
        colsum.colsum_into(torch.ones(2, 2, 3), (torch.empty(3),))
    with pytest.raises(ValueError, match="contiguous"):
        colsum.colsum_into(torch.ones(1, 2, 3), (torch.empty(6)[::2],))
