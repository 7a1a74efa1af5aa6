"""The grouped weight-cast kernel under TRITON_INTERPRET=1: bytes, scale_invs and amaxes equal the twin's."""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (make test runs it)", allow_module_level=True)
pytest.importorskip("triton")

from fp8train import scaling  # noqa: E402
from fp8train.kernels import grouped_cast, reference  # noqa: E402

SHAPES = [(70, 130), (16, 48), (64, 64), (1, 16)]  # tails in both dims, a one-row member


def _members(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(s, generator=g) * 4 ** i).to(dtype) for i, s in enumerate(SHAPES)]
    weights[0][3, 5] = float("inf")
    weights[2][0, 0] = float("nan")
    scales = [torch.tensor(0.5 * (i + 1)) for i in range(len(SHAPES))]
    amaxes = [torch.tensor(v) for v in (-1.0, 0.25, 1e6, 3.0)]  # unrecorded, below, above, between
    return weights, scales, amaxes


def _same_bytes(got, want, what):
    """Bytewise, except that any NaN encoding matches any other (ml_dtypes' e5m2 NaN is not
    the GPU's; the GPU tests pin those)."""
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan), f"{what}: NaN positions differ"
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), f"{what}: bytes differ"


@pytest.mark.parametrize("transpose", [True, False], ids=["transpose", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_kernel_matches_the_twin(exact_conversions, dtype, fp8_dtype, transpose):
    weights, scales, amaxes = _members(dtype, seed=7)
    data, data_t, scale_inv, lay = grouped_cast.flat_outputs(tuple(SHAPES), fp8_dtype, transpose, "cpu")
    data.view(torch.uint8).fill_(0x5A)
    data_t.view(torch.uint8).fill_(0x5A)
    want_amaxes = [a.clone() for a in amaxes]
    table, tiles = grouped_cast._table(weights, scales, amaxes, lay, transpose)
    kernel = grouped_cast._kernel(scaling.fp8_max(fp8_dtype), transpose, 4)
    kernel(3, table, weights[0], data, data_t if transpose else data, scale_inv, len(weights), tiles)
    for i, (w, s) in enumerate(zip(weights, scales)):
        out, out_t = grouped_cast.views(lay, data, data_t, i)
        want = torch.empty_like(out)
        want_t = None if out_t is None else torch.empty_like(out_t)
        want_inv = torch.empty(1)
        reference.grouped_cast([w], [s], [want_amaxes[i]], [want], [want_t], [want_inv])
        _same_bytes(out, want, f"member {i}")
        if transpose:
            _same_bytes(out_t, want_t, f"member {i} transposed")
        assert torch.equal(grouped_cast.scale_inv_of(scale_inv, i), want_inv), i
        assert torch.equal(amaxes[i], want_amaxes[i]), i
