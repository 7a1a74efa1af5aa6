"""The gated activation kernels (kernels/gated.py: act(g) * u and its backward, act silu or
gelu_tanh) under the Triton interpreter on CPU, against their twins (kernels/gated_reference.py).

Run with `TRITON_INTERPRET=1 python -m pytest tests/interpret` (skipped otherwise).

The kernels evaluate the twin's float32 expressions op for op (the interpreter's fma rounds
once, as the twin's `fma`; its division is numpy's IEEE one, as torch.reciprocal), so what
is left between the two is exp2: numpy's in the kernel, torch's in the twin, each within an
ulp of the exact value. With one exp2 on both sides (fixture `same_exp2`) every output is
the twin's bit for bit. With their own, float32 outputs agree within a few float32 ulps
(test_float32_within_ulps_of_the_twin derives silu's bounds,
test_gelu_tanh_float32_within_ulps_of_the_twin gelu_tanh's), and bf16 / fp16 outputs,
rounded after, are equal but in the rare element whose float32 value lies that close to a
rounding boundary (one ulp then). The interpreter's bf16 conversions are not the GPU's
(conftest's `exact_conversions` swaps in exact ones). Every comparison runs for both
activations.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from fp8train.kernels import gated  # noqa: E402
from fp8train.kernels import gated_reference as ref  # noqa: E402
from fp8train.kernels.activation_reference import TANH_2K, TANH_C  # noqa: E402

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.float32, id="fp32")]
ACTS = [pytest.param(act, id=act) for act in ref.GATED_ACTIVATIONS]
CPU_CONFIG = gated.launch_config(torch.device("cpu"))  # 64 elements a program
# Launch shapes: the interpreter's (several programs and a partial last one) and the GPU's
# (2048 elements: the test tensors in one or two programs, the last partial).
CONFIGS = [pytest.param(CPU_CONFIG, id="cpu-config"),
           pytest.param(gated.launch_config(torch.device("cuda")), id="gpu-config")]
# element counts: one; a partial first program; 4 full + 17; 3-D, 2 x 2048 + 1271 under the GPU's
SHAPES = [pytest.param((1,), id="1"), pytest.param((5, 7), id="5x7"), pytest.param((7, 13, 3), id="7x13x3"),
          pytest.param((3, 11, 163), id="3x11x163")]
SPECIALS = [math.inf, -math.inf, math.nan, 0.0, -0.0, 100.0, -100.0, 1e30, -1e30]
EPS32 = 2.0**-24
# g around the range where s = sigmoid(z) (z = g for silu, 2 k (g + c g^3) for gelu_tanh) is a
# float32 subnormal, rounded on an absolute grid of TINY: z in (-88.72, -87.34), that is g in
# (-88.72, -87.34) for silu and (-10.061, -10.001) for gelu_tanh (below: exp(-z) = inf, s = 0)
SUBNORMAL_S = {"silu": (-88.9, -87.2), "gelu_tanh": (-10.08, -9.98)}
TINY = 2.0**-149  # float32's smallest subnormal, the spacing of the subnormals
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


# --------------------------------------------------------------------------- helpers


# exact_conversions: tests/interpret/conftest.py


@pytest.fixture(params=CONFIGS)
def config(request, exact_conversions):
    """Both launch shapes, with exact bf16 conversions."""
    with gated.override_config(request.param):
        yield request.param


def make(shape, dtype, spread, specials=True, window=None) -> torch.Tensor:
    """Random values of `spread`, with NaN, +-inf, +-0, large and huge values sprinkled in;
    with `window` (lo, hi), every 8th value uniform in it instead of random."""
    t = torch.randn(shape) * spread
    if window is not None:
        every8 = t.view(-1)[::8]
        every8.copy_(torch.empty(every8.shape).uniform_(*window))
    if specials and t.numel() >= 2 * len(SPECIALS):
        t.view(-1)[torch.randperm(t.numel())[:len(SPECIALS)]] = torch.tensor(SPECIALS)
    return t.to(dtype)


def poisoned(shape, dtype) -> torch.Tensor:
    """An output the kernel must overwrite: every byte 0x5A (a finite, non-zero value)."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * size) if shape else (size,), 0x5A, dtype=torch.uint8).view(dtype)


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(got, want, what) -> None:
    """Same dtype and shape; NaN at the same places (a NaN's sign and payload mean nothing);
    every other element the same bits."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    diff = int_view(got)[~nan] != int_view(want)[~nan]
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} differ: " \
        f"{got[~nan][diff][:5].tolist()} vs {want[~nan][diff][:5].tolist()}"


def assert_float32_close(got, want, bound, what) -> None:
    """float32: the non-finite values equal, the finite ones within `bound` (elementwise)."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    inf = want.isinf()
    assert torch.equal(got[inf], want[inf]) and not got[~inf & ~want.isnan()].isinf().any(), f"{what}: infs differ"
    fin = want.isfinite()
    err = (got.double() - want.double()).abs()[fin]
    b = bound[fin]
    worst = (err / b).nan_to_num(nan=0.0, posinf=math.inf).max().item() if b.numel() else 0.0  # 0 / 0: exact
    assert (err <= b).all(), f"{what}: worst {worst:.2f} x the bound"


def assert_rounded_close(got, want, what) -> None:
    """bf16 / fp16 outputs of float32 values that differ by a few float32 ulps: equal, but at
    most 1 + 1% of the elements one ulp of their dtype apart; NaN / inf at the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    bits_g, bits_w = int_view(got)[~nan].int(), int_view(want)[~nan].int()
    # the ordered distance: neighbouring values of one sign differ by 1 in their bits
    order = lambda b: torch.where(b < 0, -(b & 0x7FFF), b)  # noqa: E731
    dist = (order(bits_g) - order(bits_w)).abs()
    assert dist.numel() == 0 or dist.max() <= 1, f"{what}: {int((dist > 1).sum())} values more than 1 ulp off"
    assert int((dist != 0).sum()) <= 1 + dist.numel() // 100, f"{what}: {int((dist != 0).sum())} values 1 ulp off"


def run_both(g, u, da, act):
    """Kernel and twin, forward and backward, into poisoned outputs: ((out, dg, du) kernel, ... twin)."""
    results = []
    for fwd, bwd in ((gated.gated_fwd, gated.gated_bwd), (ref.gated_fwd, ref.gated_bwd)):
        out, dg, du = poisoned(g.shape, g.dtype), poisoned(g.shape, g.dtype), poisoned(u.shape, u.dtype)
        fwd(g, u, act, out)
        bwd(da, g, u, act, dg, du)
        results.append((out, dg, du))
    return results


# --------------------------------------------------------------------------- the formulas, bit for bit


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_same_formulas_as_the_twin(shape, dtype, act, same_exp2):
    """With one exp2 on both sides: out, dg and du are the twin's bits (specials included, and
    every 8th g where sigmoid's s is subnormal), under the interpreter's launch shape (several
    programs, a partial last one)."""
    g = make(shape, dtype, 4.0, window=SUBNORMAL_S[act])
    u, da = make(shape, dtype, 2.0), make(shape, dtype, 1.0)
    with gated.override_config(CPU_CONFIG):
        (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da, act)
    assert_bits_equal(out, w_out, "out")
    assert_bits_equal(dg, w_dg, "dg")
    assert_bits_equal(du, w_du, "du")


@pytest.mark.parametrize("act", ACTS)
def test_same_formulas_mixed_dtypes(act, config, same_exp2):
    """u of another dtype than g (the contract allows it): out and dg in g's dtype, du in u's."""
    shape = (3, 11, 29)
    for g_dtype, u_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                             (torch.float16, torch.bfloat16)):
        g, u, da = make(shape, g_dtype, 4.0), make(shape, u_dtype, 2.0), make(shape, g_dtype, 1.0)
        (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da, act)
        assert out.dtype == dg.dtype == g_dtype and du.dtype == u_dtype
        for name, a, b in (("out", out, w_out), ("dg", dg, w_dg), ("du", du, w_du)):
            assert_bits_equal(a, b, f"{name} {g_dtype} {u_dtype}")


# --------------------------------------------------------------------------- with the interpreter's own exp2


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_within_ulps_of_the_twin(shape, config):
    """silu. numpy's exp2 against torch's, both within an ulp of the exact value: exp(-g) may
    differ by 2 ulps, which moves s = 1 / (1 + e) by at most 2 ulps (less by the factor
    e / (1 + e) <= 1) and the rest of the forward, the same operations on both sides, by
    an ulp or two of rounding on top: silu(g) * u and da * silu(g) within 2^-21 relative (4
    ulps at the bottom of the binade). dg's 1 + g (1 - s) cancels near g = -1.28: there the
    difference of 1 - s (a few ulps of s), times |g|, is absolute: dg within
    2^-21 (1 + |g|) |da u s|, s = sigmoid(g). (Not drawn: g in (-88.7, -87.3), where s is
    subnormal and rounds on an absolute grid; gelu_tanh's test below draws its own such g.)"""
    g, u, da = make(shape, torch.float32, 4.0), make(shape, torch.float32, 2.0), make(shape, torch.float32, 1.0)
    (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da, "silu")
    rel = 2.0**-21
    assert_float32_close(out, w_out, rel * w_out.double().abs(), "out")
    assert_float32_close(du, w_du, rel * w_du.double().abs(), "du")
    scale = (da.double() * u.double() * torch.sigmoid(g.double())).abs()
    assert_float32_close(dg, w_dg, rel * (1 + g.double().abs()) * scale + rel * w_dg.double().abs(), "dg")


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_tanh_float32_within_ulps_of_the_twin(shape, config):
    """gelu_tanh, as silu's test with z = 2 k (g + c g^3) for g: z is computed alike on both
    sides (no exp2 in it), so s = sigmoid(z) is within 2 ulps and out = g s u and
    du = da g s within 2^-21 relative. dg = da u (s + g s (1 - s) z'), z' = 2 k (1 + 3 c g^2),
    one fma: s and 1 - s (e s or 1 - s) within a few ulps each, and the sum cancels near
    g = -0.75 (gelu_tanh's minimum), so its error is absolute there, the few ulps of each
    term: dg within 2^-21 (|da u s| (1 + |g| z' (1 - s)) + |dg|).
    Unlike silu's g in (-88.7, -87.3), gelu_tanh's g where s is subnormal, (-10.061, -10.001),
    is in reach of real inputs, so every 8th g is drawn around it: there s rounds on TINY's
    absolute grid (the two within 2^-21 s + TINY), and so do outputs that are subnormal
    themselves (within TINY / 2 each side), which adds TINY (1 + |g u|) to out's bound,
    TINY (1 + |g da|) to du's and TINY (1 + |da u| (1 + |g| z')) to dg's."""
    g = make(shape, torch.float32, 4.0, window=SUBNORMAL_S["gelu_tanh"])
    u, da = make(shape, torch.float32, 2.0), make(shape, torch.float32, 1.0)
    (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da, "gelu_tanh")
    rel = 2.0**-21
    x, up, d = g.double(), u.double(), da.double()
    s = torch.sigmoid(TANH_2K * x * (1 + TANH_C * x * x))
    dz = TANH_2K * (1 + 3 * TANH_C * x * x)
    assert_float32_close(out, w_out, rel * w_out.double().abs() + TINY * (1 + (x * up).abs()), "out")
    assert_float32_close(du, w_du, rel * w_du.double().abs() + TINY * (1 + (x * d).abs()), "du")
    scale = (d * up * s).abs()
    bound = rel * (scale * (1 + x.abs() * dz * (1 - s)) + w_dg.double().abs())
    assert_float32_close(dg, w_dg, bound + TINY * (1 + (d * up).abs() * (1 + x.abs() * dz)), "dg")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_rounded_outputs_match_the_twin(dtype, act, config):
    """bf16 / fp16 in and out, numpy's exp2: equal to the twin's but in the rare element one
    ulp apart (its float32 value within a few float32 ulps of a rounding boundary)."""
    shape = (9, 7, 61)
    g, u, da = make(shape, dtype, 4.0), make(shape, dtype, 2.0), make(shape, dtype, 1.0)
    (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da, act)
    assert_rounded_close(out, w_out, "out")
    assert_rounded_close(dg, w_dg, "dg")
    assert_rounded_close(du, w_du, "du")


# --------------------------------------------------------------------------- edges and arguments


@pytest.mark.parametrize("act", ACTS)
def test_masked_lanes_write_nothing_past_the_end(act, config):
    """Tensors that are the front of a larger buffer: the partial last program writes the
    n elements and nothing after them."""
    n = 3 * 64 + 21
    for dtype in (torch.bfloat16, torch.float32):
        g, u, da = make((n,), dtype, 4.0, specials=False), make((n,), dtype, 2.0), make((n,), dtype, 1.0)
        outs = [poisoned((n + 300,), dtype) for _ in range(3)]
        gated.gated_fwd(g, u, act, outs[0][:n])
        gated.gated_bwd(da, g, u, act, outs[1][:n], outs[2][:n])
        for buf in outs:
            assert torch.equal(int_view(buf[n:]), int_view(poisoned((300,), dtype))), dtype
            assert not torch.equal(int_view(buf[n - 1:n]), int_view(poisoned((1,), dtype))), dtype


def test_zero_size_launches_nothing(exact_conversions):
    for shape in ((0,), (0, 16), (4, 0, 3)):
        for act in ref.GATED_ACTIVATIONS:
            g = torch.empty(shape, dtype=torch.bfloat16)
            out = torch.empty(shape, dtype=torch.bfloat16)
            gated.gated_fwd(g, g, act, out)
            gated.gated_bwd(g, g, g, act, torch.empty_like(g), torch.empty_like(g))
            assert out.shape == shape


def test_rejects_bad_arguments():
    """The wrappers run the twin's checks: the same errors, before any launch; an activation
    outside GATED_ACTIVATIONS (activation.py's "swiglu", "gelu" among them) is one."""
    ok = torch.randn(4, 8)
    fwd, bwd = (gated.gated_fwd, ref.gated_fwd), (gated.gated_bwd, ref.gated_bwd)
    cases = [
        (*fwd, (ok, torch.randn(4, 9), "silu", torch.empty(4, 8))),
        (*fwd, (ok, ok, "gelu_tanh", torch.empty(4, 8, dtype=torch.bfloat16))),
        (*fwd, (torch.randn(8, 4).t(), ok, "silu", torch.empty(4, 8))),
        (*fwd, (ok.double(), ok, "gelu_tanh", torch.empty(4, 8, dtype=torch.float64))),
        (*fwd, (ok, ok, "swiglu", torch.empty(4, 8))),
        (*bwd, (ok, ok, ok.bfloat16(), "silu", torch.empty(4, 8), torch.empty(4, 8))),
        (*bwd, (ok, ok, ok, "gelu_tanh", torch.empty(4, 8, dtype=torch.float16), torch.empty(4, 8))),
        (*bwd, (torch.ones(4, 8, dtype=torch.int32), ok, ok, "silu", torch.empty(4, 8), torch.empty(4, 8))),
        (*bwd, (ok, ok, ok, "gelu", torch.empty(4, 8), torch.empty(4, 8))),
    ]
    for kernel, twin, args in cases:
        with pytest.raises(ValueError) as want:
            twin(*args)
        with pytest.raises(ValueError) as got:
            kernel(*args)
        assert str(got.value) == str(want.value)
        assert str(got.value).startswith(f"{twin.__name__}: ")
        if next(a for a in args if isinstance(a, str)) not in ref.GATED_ACTIVATIONS:
            assert "act must be one of ('silu', 'gelu_tanh')" in str(got.value)
