"""kernels/colsum.py on the GPU: the Triton column sums against float64, in the shapes the
backward kernels hand it (activation dbias splits, norm partial rows) and odd ones; within
float32 rounding of the sum (its order is blocks of rows, not torch.sum's), then one
rounding into the output dtype."""
import pytest
import torch

pytest.importorskip("triton")

from fp8train.kernels import colsum  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("s,p,n", [(1, 16, 16384), (2, 264, 1024), (2, 132, 8192), (1, 1, 7), (2, 333, 4099)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_colsum_matches_float64(s, p, n, out_dtype):
    src = torch.randn(s, p, n, device="cuda") * torch.rand(s, p, 1, device="cuda") * 100
    outs = [torch.full((n,), float("nan"), dtype=out_dtype, device="cuda") for _ in range(s)]
    colsum.colsum_into(src, outs)
    for k in range(s):
        exact = src[k].double().sum(dim=0)
        bound = 4 * p * torch.finfo(torch.float32).eps * src[k].double().abs().sum(dim=0)
        if out_dtype != torch.float32:
            bound = bound + torch.finfo(out_dtype).eps * exact.abs()
        err = (outs[k].double() - exact).abs()
        assert (err <= bound).all(), f"sum {k}: max error {err.max().item():.3g}"


def test_colsum_is_deterministic():
    src = torch.randn(2, 264, 1024, device="cuda")
    a = [torch.empty(1024, device="cuda") for _ in range(2)]
    b = [torch.empty(1024, device="cuda") for _ in range(2)]
    colsum.colsum_into(src, a)
    colsum.colsum_into(src, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
