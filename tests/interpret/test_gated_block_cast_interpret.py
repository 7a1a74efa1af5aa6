"""The computed forms of the two-way block cast (block_kernel.gated_block_cast_into and
gated_grad_block_cast_into: a gated MLP's product, or its gradients dg | du; norm_block_cast_into:
an RMS norm's output; each computed inside the cast's read) under the Triton interpreter, against their twin (kernels.gated_block_cast
and gated_grad_block_cast on CPU tensors: gated_reference's arithmetic, rounded to the
inputs' dtype, then the two-way cast's twin), bit for bit: both payloads, both scale grids,
the transposed copy's zero padding. One exp2 on both sides (conftest `same_exp2`: the kernels
and twins otherwise differ by exp2's last bit, test_gated_interpret.py) and exact conversions."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from fp8train import kernels  # noqa: E402
from fp8train.kernels import block_kernel  # noqa: E402
from fp8train.kernels import block_reference as br  # noqa: E402
from fp8train.kernels.block_kernel import (gated_block_cast_into, gated_grad_block_cast_into,  # noqa: E402
                                           norm_block_cast_into)
from fp8train.kernels import gated_reference  # noqa: E402
from fp8train.kernels.gated_reference import GATED_ACTIVATIONS  # noqa: E402

ACTS = [pytest.param(a, id=a) for a in GATED_ACTIVATIONS]
TRACED = pytest.mark.parametrize("traced", [False, True], ids=["direct", "wrap_triton"])
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")
E4M3 = torch.float8_e4m3fn


def _halves(m: int, k: int, dtype, seed: int):
    """g and u as the stacked gate/up GEMM leaves them: the two halves of one (m, 2k) tensor
    (row stride 2k), with blocks of very different sizes, a NaN, infs and a zero block."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(m, 2 * k, generator=gen) * torch.logspace(-6, 6, 2 * k)[torch.randperm(2 * k, generator=gen)]
    y[0, 3] = float("nan")
    y[min(m - 1, 130), 1] = float("inf")
    y[2, k + 5] = -float("inf")
    y[:, k - 3:k] = 0.0
    y = y.to(dtype)
    return y[:, :k], y[:, k:]


def _buffers(m: int, k: int, fp8=E4M3):
    mp = -(-m // 128) * 128
    out = torch.empty((m, k), dtype=fp8)
    out_t = torch.full((k, mp), 0x55, dtype=torch.uint8).view(fp8)  # padding bytes must become zero
    si = torch.full(br.blocks_of((m, k), (1, 128))[::-1], -1.0).t()  # column-major, as the layers' are
    si_t = torch.full(br.blocks_of((m, k), (128, 1)), -1.0)
    return out, out_t, si, si_t


def _assert_same(got, want):
    for a, b in zip(got, want):
        if a.dtype == torch.float32:
            assert torch.equal(a, b)
        else:  # any NaN encoding matches any other
            nan = b.float().isnan()
            assert torch.equal(a.float().isnan(), nan)
            assert torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])


@TRACED
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape, dtype", [((200, 300), torch.bfloat16), ((128, 256), torch.float32),
                                          ((37, 144), torch.float16)], ids=["tails-bf16", "whole-fp32", "short-fp16"])
def test_gated_block_cast_kernel_matches_the_twin(shape, dtype, act, traced, same_exp2):
    g, u = _halves(*shape, dtype, seed=3)
    got = _buffers(*shape)
    gated_block_cast_into(g, u, act, *got, traced=traced)
    want = _buffers(*shape)
    kernels.gated_block_cast(g, u, act, *want)
    _assert_same(got, want)
    # the twin is the two-way cast of the product the gated kernel's twin stores
    prod = torch.empty_like(g)
    gated_reference.gated_fwd(g.contiguous(), u.contiguous(), act, prod)
    plain = _buffers(*shape)
    kernels.block_cast_both(prod, *plain)
    _assert_same(want, plain)


@TRACED
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape, dtype", [((200, 256), torch.bfloat16), ((128, 128), torch.float32),
                                          ((37, 384), torch.bfloat16)], ids=["tails-bf16", "whole-fp32", "short-bf16"])
def test_gated_grad_block_cast_kernel_matches_the_twin(shape, dtype, act, traced, same_exp2):
    m, k = shape
    g, u = _halves(m, k, dtype, seed=5)
    da = (torch.randn(m, k, generator=torch.Generator().manual_seed(6)) * 1e-3).to(dtype)
    da[1, 7] = float("inf")
    got = _buffers(m, 2 * k)
    gated_grad_block_cast_into(da, g, u, act, *got, traced=traced)
    want = _buffers(m, 2 * k)
    kernels.gated_grad_block_cast(da, g, u, act, *want)
    _assert_same(got, want)
    # the twin is the two-way cast of dg | du as the gated backward kernel's twin stores them
    dg, du = torch.empty_like(g.contiguous()), torch.empty_like(u.contiguous())
    gated_reference.gated_bwd(da, g.contiguous(), u.contiguous(), act, dg, du)
    plain = _buffers(m, 2 * k)
    kernels.block_cast_both(torch.cat([dg, du], dim=1), *plain)
    _assert_same(want, plain)


@pytest.mark.parametrize("act", ACTS)
def test_gated_block_casts_unmasked_match_the_twin(act, unmasked, same_exp2):
    """Whole tiles under BlockShapes.even (the kernel without masks): the product's and the
    gradients' checks above."""
    test_gated_block_cast_kernel_matches_the_twin((256, 384), torch.bfloat16, act, False, same_exp2)
    test_gated_grad_block_cast_kernel_matches_the_twin((128, 256), torch.float32, act, True, same_exp2)


@TRACED
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape, dtype", [((200, 256), torch.bfloat16), ((128, 128), torch.float32)],
                         ids=["tails-bf16", "whole-fp32"])
def test_gated_grad_block_cast_by_side_matches_the_twin(shape, dtype, act, traced, same_exp2):
    """BlockShapes.gated_sides: dg's tiles and du's in a launch each (the kernel's SIDE), the
    check above."""
    shapes = dataclasses.replace(block_kernel.launch_shapes(), gated_sides=True)
    assert [block_kernel._both_kernel(448.0, False, shapes, shape, 1, 2, 0, side).constexprs["SIDE"]
            for side in (1, 2)] == [1, 2]
    with block_kernel.override_shapes(shapes):
        test_gated_grad_block_cast_kernel_matches_the_twin(shape, dtype, act, traced, same_exp2)


@pytest.mark.parametrize("act", ACTS)
def test_gated_block_casts_packed_match_the_twin(act, packed, same_exp2):
    """BlockShapes.packed_t (the transposed copy a word of four rows at a time): the product's
    and the gradients' checks above, the gradients in one launch and a launch per side."""
    test_gated_block_cast_kernel_matches_the_twin((200, 384), torch.bfloat16, act, True, same_exp2)
    test_gated_grad_block_cast_kernel_matches_the_twin((256, 128), torch.float32, act, False, same_exp2)
    with block_kernel.override_shapes(dataclasses.replace(block_kernel.launch_shapes(), gated_sides=True)):
        test_gated_grad_block_cast_kernel_matches_the_twin((37, 256), torch.bfloat16, act, False, same_exp2)


def _one_way(m: int, k: int, keep_dtype):
    """(out, None, scale_inv, None, keep): a computed form's one-way buffers, keep -1-filled."""
    out, _, si, _ = _buffers(m, k)
    return out, None, si, None, torch.full((m, k), -1.0, dtype=keep_dtype)


def _assert_one_way(got, want_cast, want_keep):
    """got (out, None, si, None, keep) against a two-way cast's 1 x 128 half and the computed
    tensor in keep's dtype, bit for bit (NaN where NaN)."""
    _assert_same((got[0], got[2]), (want_cast[0], want_cast[2]))
    want_keep = want_keep.to(got[4].dtype)
    assert torch.equal(got[4].isnan(), want_keep.isnan())
    assert torch.equal(got[4][~want_keep.isnan()], want_keep[~want_keep.isnan()])


@TRACED
@pytest.mark.parametrize("even", [False, True], ids=["masked", "unmasked"])
@pytest.mark.parametrize("act", ACTS)
def test_computed_casts_keep_their_tile_without_the_transposed_copy(act, even, traced, same_exp2):
    """BlockScaling(fp8_wgrad=False)'s forms (the kernel's COLS 0 and KEEP): the product, dg | du
    and the norm's output cast one way, and stored in bf16 for the wgrad: the two-way forms'
    1 x 128 half and the twin's values, bit for bit, kernel and twin; tails, and whole tiles
    under BlockShapes.even."""
    from fp8train.modules.rms_norm import rms_norm_formula
    m, k = (256, 256) if even else (200, 256)
    shapes = dataclasses.replace(block_kernel.launch_shapes(), even=even)
    g, u = _halves(m, k, torch.bfloat16, seed=7)
    da = (torch.randn(m, k, generator=torch.Generator().manual_seed(8)) * 1e-3).to(torch.bfloat16)
    prod = torch.empty_like(g.contiguous())
    gated_reference.gated_fwd(g.contiguous(), u.contiguous(), act, prod)
    dg, du = torch.empty_like(prod), torch.empty_like(prod)
    gated_reference.gated_bwd(da, g.contiguous(), u.contiguous(), act, dg, du)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(9)) * 10).float()
    weight = torch.randn(k, generator=torch.Generator().manual_seed(10))
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)[:, 0]
    y = rms_norm_formula(x, weight, 1e-6)  # float32: kept in bf16, as autocast's Linear reads it
    cases = [(lambda *b, **kw: gated_block_cast_into(g, u, act, *b, **kw), kernels.gated_block_cast,
              (g, u, act), prod, k),
             (lambda *b, **kw: gated_grad_block_cast_into(da, g, u, act, *b, **kw), kernels.gated_grad_block_cast,
              (da, g, u, act), torch.cat([dg, du], dim=1), 2 * k),
             (lambda *b, **kw: norm_block_cast_into(x, weight, rstd, y.dtype, *b, **kw), kernels.norm_block_cast,
              (x, weight, rstd, y.dtype), y, k)]
    for launch, twin, args, value, width in cases:
        two_way = _buffers(m, width)
        kernels.block_cast_both(value, *two_way)
        got = _one_way(m, width, torch.bfloat16)
        with block_kernel.override_shapes(shapes):
            launch(*got[:4], keep=got[4], traced=traced)
        _assert_one_way(got, two_way, value)
        by_twin = _one_way(m, width, torch.bfloat16)
        twin(*args, *by_twin[:4], keep=by_twin[4])
        _assert_one_way(by_twin, two_way, value)


def test_computed_casts_check_their_keep():
    g = torch.zeros(64, 128)
    out, _, si, _ = _buffers(64, 128)
    with pytest.raises(ValueError, match="keep must be"):  # with the transposed copy
        gated_block_cast_into(g, g, "silu", *_buffers(64, 128), keep=torch.empty(64, 128))
    with pytest.raises(ValueError, match="keep must be"):
        gated_block_cast_into(g, g, "silu", out, None, si, None, keep=torch.empty(64, 256))
    with pytest.raises(ValueError, match="keep must be"):
        block_kernel.block_cast_both_into(g, out, None, si, None)  # fine: no keep
        block_kernel._launch_both((g,), (64, 128), 128, 128, out, None, si, None, False, False, "plain", 1,
                                  keep=torch.empty(64, 128))  # a plain cast has nothing to keep


def test_gated_block_casts_check_their_inputs():
    g = torch.zeros(64, 200)
    with pytest.raises(ValueError, match="act must be one of"):
        gated_block_cast_into(g, g, "relu", *_buffers(64, 200))
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        gated_block_cast_into(g, g.bfloat16(), "silu", *_buffers(64, 200))
    with pytest.raises(ValueError, match="multiple of 128"):
        gated_grad_block_cast_into(g, g, g, "silu", *_buffers(64, 400))
    with pytest.raises(ValueError, match="out must be"):
        gated_grad_block_cast_into(*(torch.zeros(64, 128),) * 3, "silu", *_buffers(64, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        kernels.gated_grad_block_cast(g, g, g, "silu", *_buffers(64, 400))


@TRACED
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
                         ids=["fp32", "bf16", "bf16-x-fp32-weight", "fp16"])
@pytest.mark.parametrize("shape", [(200, 300), (128, 256)], ids=["tails", "whole"])
def test_norm_block_cast_kernel_is_the_formulas_cast(shape, dtypes, traced, exact_conversions):
    """An RMS norm's output computed in the cast's read (GATED 3), against the two-way cast of
    rms_norm_formula's output (the HF norm's ops; the rstd taken from the same ops), bit for
    bit: x's dtype, the weight's and their product's (torch's promotion) as HF's norm has them."""
    from fp8train.modules.rms_norm import rms_norm_formula
    x_dtype, w_dtype = dtypes
    m, k = shape
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(m, k + 16, generator=gen) * torch.logspace(-3, 3, k + 16)
    base[3, 5] = float("inf")  # a row of NaN after the norm
    x = base.to(x_dtype)[:, 16:]  # row stride k + 16
    weight = (torch.randn(k, generator=gen) * 2).to(w_dtype)
    eps = 1e-6
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)[:, 0]
    y = rms_norm_formula(x, weight, eps)
    got = _buffers(m, k)
    norm_block_cast_into(x, weight, rstd, y.dtype, *got, traced=traced)
    want = _buffers(m, k)
    kernels.block_cast_both(y, *want)
    _assert_same(got, want)
    twin = _buffers(m, k)
    kernels.norm_block_cast(x, weight, rstd, y.dtype, *twin)
    _assert_same(twin, want)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16-x-fp32-weight"])
def test_norm_block_cast_unmasked_is_the_formulas_cast(dtypes, unmasked, exact_conversions):
    """Whole tiles under BlockShapes.even (the kernel without masks): the check above."""
    test_norm_block_cast_kernel_is_the_formulas_cast((256, 384), dtypes, False, exact_conversions)


def test_norm_block_cast_packed_is_the_formulas_cast(packed, exact_conversions):
    """BlockShapes.packed_t: the check above, tails and a whole tile."""
    test_norm_block_cast_kernel_is_the_formulas_cast((200, 300), (torch.bfloat16, torch.float32), True,
                                                     exact_conversions)
    test_norm_block_cast_kernel_is_the_formulas_cast((256, 384), (torch.float32, torch.float32), False,
                                                     exact_conversions)


def test_norm_block_cast_checks_its_inputs():
    x = torch.zeros(64, 256)
    with pytest.raises(ValueError, match="rstd"):
        norm_block_cast_into(x, torch.ones(256), torch.ones(64, dtype=torch.float64), torch.float32, *_buffers(64, 256))
    with pytest.raises(ValueError, match="weight"):
        kernels.norm_block_cast(x, torch.ones(255), torch.ones(64), torch.float32, *_buffers(64, 256))
