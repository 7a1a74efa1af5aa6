"""The SwiGLU kernels (kernels/swiglu.py) under the Triton interpreter on CPU, against their twins
(kernels/swiglu_reference.py).

Run with `TRITON_INTERPRET=1 python -m pytest tests/interpret` (skipped otherwise).

The kernels evaluate the twin's float32 expressions op for op (the interpreter's fma rounds
once, as the twin's `fma`; its division is numpy's IEEE one, as torch.reciprocal), so what
is left between the two is exp2: numpy's in the kernel, torch's in the twin, each within an
ulp of the exact value. With one exp2 on both sides (fixture `same_exp2`) every output is
the twin's bit for bit. With their own, float32 outputs agree within a few float32 ulps
(test_float32_within_ulps_of_the_twin derives the bounds), and bf16 / fp16 outputs, rounded
after, are equal but in the rare element whose float32 value lies that close to a rounding
boundary (one ulp then). The interpreter's bf16 conversions are not the GPU's (conftest's
`exact_conversions` swaps in exact ones).
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

from triton.runtime import interpreter as _interpreter  # noqa: E402

from fp8train.kernels import swiglu  # noqa: E402
from fp8train.kernels import swiglu_reference as ref  # noqa: E402

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.float32, id="fp32")]
CPU_CONFIG = swiglu.launch_config(torch.device("cpu"))  # 64 elements a program
# Launch shapes: the interpreter's (several programs and a partial last one) and the GPU's
# (2048 elements: the test tensors in one or two programs, the last partial).
CONFIGS = [pytest.param(CPU_CONFIG, id="cpu-config"),
           pytest.param(swiglu.launch_config(torch.device("cuda")), id="gpu-config")]
# element counts: one; a partial first program; 4 full + 17; 3-D, 2 x 2048 + 1271 under the GPU's
SHAPES = [pytest.param((1,), id="1"), pytest.param((5, 7), id="5x7"), pytest.param((7, 13, 3), id="7x13x3"),
          pytest.param((3, 11, 163), id="3x11x163")]
SPECIALS = [math.inf, -math.inf, math.nan, 0.0, -0.0, 100.0, -100.0, 1e30, -1e30]
EPS32 = 2.0**-24
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


# --------------------------------------------------------------------------- helpers


# exact_conversions: tests/interpret/conftest.py


@pytest.fixture(params=CONFIGS)
def config(request, exact_conversions):
    """Both launch shapes, with exact bf16 conversions."""
    with swiglu.override_config(request.param):
        yield request.param


def _exact_exp2(data: np.ndarray) -> np.ndarray:
    """exp2 of float32 values in float64, rounded to float32: correctly rounded but where the
    float64 value lies within its own few ulps of a float32 rounding boundary (~2^-28 of
    inputs), and the same for an element wherever it sits in a tensor."""
    return np.exp2(np.asarray(data, dtype=np.float64)).astype(np.float32)


@pytest.fixture
def same_exp2(monkeypatch, exact_conversions):
    """One exp2 for kernel and twin (_exact_exp2): the interpreter's tl.exp2 and the twin's
    torch.exp2 (float32 tensors), so that what is left between them is their formulas alone.
    (torch's own float32 exp2 is no fixed function of the element either: on the CPU its
    vectorized body and scalar tail may differ in the last bit.)"""
    original = torch.exp2

    def exp2(t, *args, **kwargs):
        if args or kwargs or t.dtype != torch.float32:
            return original(t, *args, **kwargs)
        return torch.from_numpy(_exact_exp2(t.detach().cpu().numpy())).reshape(t.shape)

    monkeypatch.setattr(torch, "exp2", exp2)
    monkeypatch.setattr(_interpreter.InterpreterBuilder, "create_exp2",
                        lambda self, arg: self.unary_op(arg, _exact_exp2))


def make(shape, dtype, spread, specials=True) -> torch.Tensor:
    """Random values of `spread`, with NaN, +-inf, +-0, large and huge values sprinkled in."""
    t = torch.randn(shape) * spread
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
    assert (err <= b).all(), f"{what}: worst {(err / b).max().item():.2f} x the bound"


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


def run_both(g, u, da):
    """Kernel and twin, forward and backward, into poisoned outputs: ((out, dg, du) kernel, ... twin)."""
    results = []
    for fwd, bwd in ((swiglu.swiglu_fwd, swiglu.swiglu_bwd), (ref.swiglu_fwd, ref.swiglu_bwd)):
        out, dg, du = poisoned(g.shape, g.dtype), poisoned(g.shape, g.dtype), poisoned(u.shape, u.dtype)
        fwd(g, u, out)
        bwd(da, g, u, dg, du)
        results.append((out, dg, du))
    return results


# --------------------------------------------------------------------------- the formulas, bit for bit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_same_formulas_as_the_twin(shape, dtype, same_exp2):
    """With one exp2 on both sides: out, dg and du are the twin's bits (specials included),
    under the interpreter's launch shape (several programs, a partial last one)."""
    g, u, da = make(shape, dtype, 4.0), make(shape, dtype, 2.0), make(shape, dtype, 1.0)
    with swiglu.override_config(CPU_CONFIG):
        (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da)
    assert_bits_equal(out, w_out, "out")
    assert_bits_equal(dg, w_dg, "dg")
    assert_bits_equal(du, w_du, "du")


def test_same_formulas_mixed_dtypes(config, same_exp2):
    """u of another dtype than g (the contract allows it): out and dg in g's dtype, du in u's."""
    shape = (3, 11, 29)
    for g_dtype, u_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                             (torch.float16, torch.bfloat16)):
        g, u, da = make(shape, g_dtype, 4.0), make(shape, u_dtype, 2.0), make(shape, g_dtype, 1.0)
        (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da)
        assert out.dtype == dg.dtype == g_dtype and du.dtype == u_dtype
        for name, a, b in (("out", out, w_out), ("dg", dg, w_dg), ("du", du, w_du)):
            assert_bits_equal(a, b, f"{name} {g_dtype} {u_dtype}")


# --------------------------------------------------------------------------- with the interpreter's own exp2


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_within_ulps_of_the_twin(shape, config):
    """numpy's exp2 against torch's, both within an ulp of the exact value: exp(-g) may
    differ by 2 ulps, which moves s = 1 / (1 + e) by at most 2 ulps (less by the factor
    e / (1 + e) <= 1) and the rest of the forward, the same operations on both sides, by
    an ulp or two of rounding on top: silu(g) * u and da * silu(g) within 2^-21 relative (4
    ulps at the bottom of the binade). dg's 1 + g (1 - s) cancels near g = -1.28: there the
    difference of 1 - s (a few ulps of s), times |g|, is absolute: dg within
    2^-21 (1 + |g|) |da u s|, s = sigmoid(g)."""
    g, u, da = make(shape, torch.float32, 4.0), make(shape, torch.float32, 2.0), make(shape, torch.float32, 1.0)
    (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da)
    rel = 2.0**-21
    assert_float32_close(out, w_out, rel * w_out.double().abs(), "out")
    assert_float32_close(du, w_du, rel * w_du.double().abs(), "du")
    scale = (da.double() * u.double() * torch.sigmoid(g.double())).abs()
    assert_float32_close(dg, w_dg, rel * (1 + g.double().abs()) * scale + rel * w_dg.double().abs(), "dg")


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_rounded_outputs_match_the_twin(dtype, config):
    """bf16 / fp16 in and out, numpy's exp2: equal to the twin's but in the rare element one
    ulp apart (its float32 value within a few float32 ulps of a rounding boundary)."""
    shape = (9, 7, 61)
    g, u, da = make(shape, dtype, 4.0), make(shape, dtype, 2.0), make(shape, dtype, 1.0)
    (out, dg, du), (w_out, w_dg, w_du) = run_both(g, u, da)
    assert_rounded_close(out, w_out, "out")
    assert_rounded_close(dg, w_dg, "dg")
    assert_rounded_close(du, w_du, "du")


# --------------------------------------------------------------------------- edges and arguments


def test_masked_lanes_write_nothing_past_the_end(config):
    """Tensors that are the front of a larger buffer: the partial last program writes the
    n elements and nothing after them."""
    n = 3 * 64 + 21
    for dtype in (torch.bfloat16, torch.float32):
        g, u, da = make((n,), dtype, 4.0, specials=False), make((n,), dtype, 2.0), make((n,), dtype, 1.0)
        outs = [poisoned((n + 300,), dtype) for _ in range(3)]
        swiglu.swiglu_fwd(g, u, outs[0][:n])
        swiglu.swiglu_bwd(da, g, u, outs[1][:n], outs[2][:n])
        for buf in outs:
            assert torch.equal(int_view(buf[n:]), int_view(poisoned((300,), dtype))), dtype
            assert not torch.equal(int_view(buf[n - 1:n]), int_view(poisoned((1,), dtype))), dtype


def test_zero_size_launches_nothing(exact_conversions):
    for shape in ((0,), (0, 16), (4, 0, 3)):
        g = torch.empty(shape, dtype=torch.bfloat16)
        out = torch.empty(shape, dtype=torch.bfloat16)
        swiglu.swiglu_fwd(g, g, out)
        swiglu.swiglu_bwd(g, g, g, torch.empty_like(g), torch.empty_like(g))
        assert out.shape == shape


def test_rejects_bad_arguments():
    """The wrappers run the twin's checks: the same errors, before any launch."""
    ok = torch.randn(4, 8)
    cases = [
        (swiglu.swiglu_fwd, ref.swiglu_fwd, (ok, torch.randn(4, 9), torch.empty(4, 8))),
        (swiglu.swiglu_fwd, ref.swiglu_fwd, (ok, ok, torch.empty(4, 8, dtype=torch.bfloat16))),
        (swiglu.swiglu_fwd, ref.swiglu_fwd, (torch.randn(8, 4).t(), ok, torch.empty(4, 8))),
        (swiglu.swiglu_fwd, ref.swiglu_fwd, (ok.double(), ok, torch.empty(4, 8, dtype=torch.float64))),
        (swiglu.swiglu_bwd, ref.swiglu_bwd, (ok, ok, ok.bfloat16(), torch.empty(4, 8), torch.empty(4, 8))),
        (swiglu.swiglu_bwd, ref.swiglu_bwd, (ok, ok, ok, torch.empty(4, 8, dtype=torch.float16), torch.empty(4, 8))),
        (swiglu.swiglu_bwd, ref.swiglu_bwd, (torch.ones(4, 8, dtype=torch.int32), ok, ok, torch.empty(4, 8),
                                             torch.empty(4, 8))),
    ]
    for kernel, twin, args in cases:
        with pytest.raises(ValueError) as want:
            twin(*args)
        with pytest.raises(ValueError) as got:
            kernel(*args)
        assert str(got.value) == str(want.value)
        assert str(got.value).startswith(f"{twin.__name__}: ")
