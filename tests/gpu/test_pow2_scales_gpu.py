"""power_of_two_scales in the Triton kernels (the POW2 constexpr) against their twins on the GPU.

Every kernel that computes a scale from an amax rounds it down to a power of two when asked
(scale_update.compute_scale): the casts (flat and tile kernels) and the delayed update must
match their twins bit for bit, as without the flag (tests/gpu/test_kernels_gpu.py); the norm
and activation kernels must give the twin's scale, scale_inv and count bit for bit and its
bytes within the 1-ulp allowance of their own GPU tests (their float32 values differ from the
twins' by a few ulps: test_norm_gpu.py, test_activation_gpu.py say why). Every scale the
flag touches is checked to be a power of two. Outputs are poisoned with two byte patterns.
The layers (Linear, LayerNormMLP, C++ node included) train with the flag in
tests/test_power_of_two_scales.py, whose `device` fixture repeats it on the GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from fp8train import scaling  # noqa: E402
from fp8train.kernels import activation, cast, norm, reference  # noqa: E402
from fp8train.kernels import activation_reference as act_ref  # noqa: E402
from fp8train.kernels import norm_reference as norm_ref  # noqa: E402
from fp8train.kernels.scale_update import ScaleUpdateLaunch  # noqa: E402
from helpers import assert_bitwise, FP8_FORMATS, fp8_order, make_input, poisoned  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = FP8_FORMATS
POISONS = (0x5A, 0xA5)
# The amax the scale comes from ("x": the input's finite values'); 0, inf and NaN keep the
# old scale (inf, NaN count), a subnormal one clamps to 2**126, a huge one gives a tiny scale.
AMAXES = [pytest.param(a, id=n) for a, n in (("x", "own"), (1000.0, "1000"), (448.0, "448"), (0.0, "zero"),
                                              (1e-40, "subnormal"), (3e38, "huge"), (math.inf, "inf"),
                                              (math.nan, "nan"))]
PREV_SCALE = 0.5  # a power of two, as every scale of a pow2 quantizer is


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=DEV)


def from_amax_of(x: torch.Tensor, amax) -> torch.Tensor:
    return reference.abs_max(torch.where(x.isfinite(), x, 0.0)) if amax == "x" else f32(amax)


def assert_power_of_two_scale(scale: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor) -> None:
    a = amax.item()
    if a > 0 and math.isfinite(a):
        assert math.frexp(scale.item())[0] == 0.5, f"scale {scale.item()} is not a power of two"
    else:
        assert scale.item() == PREV_SCALE, "an unusable amax keeps the scale"
    assert scale_inv.item() == 1.0 / scale.item()


def assert_fp8_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN at the same places; elsewhere at most 1 ulp apart, on fewer than 1e-3 of the
    elements (the allowance of test_activation_gpu.py and test_norm_gpu.py)."""
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ"
    dist = (fp8_order(got) - fp8_order(want)).abs()
    dist[nan_w] = 0
    assert not (dist > 1).any(), f"{what}: {int((dist > 1).sum())} values more than 1 ulp off"
    assert int((dist != 0).sum()) <= max(1, (dist.numel() - 1) // 1000), f"{what}: too many values 1 ulp off"


# --------------------------------------------------------------------------- casts: bit for bit


@pytest.mark.parametrize("amax", AMAXES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("x_dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("layout", ["flat", "tile", "transpose"])
def test_cast_with_power_of_two_matches_twin(layout, x_dtype, fp8, amax):
    m, n = 1000, 1024
    # flat: a contiguous x; tile: row slices of a wider tensor (a row stride: the tile kernel)
    x = make_input((m, n + 8), x_dtype)[:, :n] if layout == "tile" else make_input((m, n), x_dtype)
    from_amax = from_amax_of(x, amax)
    mp = 1008
    want_s, want_inv, want_c = f32(PREV_SCALE), f32(-3.0), torch.tensor(4, dtype=torch.int32, device=DEV)
    want = poisoned((m, n), fp8, 0)
    want_t = poisoned((n, mp), fp8, 0)
    if layout == "transpose":
        reference.cast_transpose_amax(x, want, want_t, want_s, want_inv, None, from_amax, want_c, power_of_two=True)
    else:
        reference.cast_amax(x, want, want_s, want_inv, None, from_amax, want_c, power_of_two=True)
    assert_power_of_two_scale(want_s, want_inv, from_amax)
    for byte in POISONS:
        s, inv, c = f32(PREV_SCALE), f32(-3.0), torch.tensor(4, dtype=torch.int32, device=DEV)
        out = poisoned((m, n), fp8, byte)
        if layout == "transpose":
            out_t = poisoned((n, mp), fp8, byte)
            cast.cast_transpose_amax(x, out, out_t, s, inv, None, from_amax, c, power_of_two=True)
            assert_bitwise(out_t, want_t, f"out_t (poison {byte:#x})")
        else:
            cast.cast_amax(x, out, s, inv, None, from_amax, c, power_of_two=True)
        assert_bitwise(out, want, f"out (poison {byte:#x})")
        for name, g, w in (("scale", s, want_s), ("scale_inv", inv, want_inv), ("count", c, want_c)):
            assert_bitwise(g, w, name)


def test_prepared_cast_keeps_the_rule():
    """A quantizer's prepared launch (and so the C++ plan made from it) carries POW2."""
    x = make_input((256, 512), torch.bfloat16)
    amax = from_amax_of(x, "x")
    s, inv, c = f32(PREV_SCALE), f32(-3.0), torch.tensor(0, dtype=torch.int32, device=DEV)
    out = torch.empty(256, 512, dtype=E4M3, device=DEV)
    launch = cast.PreparedCast(x, out, None, s, inv, None, amax, c, power_of_two=True)
    for _ in range(2):
        launch(x, out, None, inv)
    want_s, want_inv = f32(PREV_SCALE), torch.empty((), device=DEV)
    want = torch.empty_like(out)
    reference.cast_amax(x, want, want_s, want_inv, None, amax.clone(), None, power_of_two=True)
    assert_bitwise(s, want_s, "scale")
    assert_bitwise(out, want, "out")
    assert_power_of_two_scale(s, inv, amax)


# --------------------------------------------------------------------------- delayed update


@pytest.mark.parametrize("length", [1, 16, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
def test_scale_update_with_power_of_two_matches_twin(length, algo, margin):
    histories, scales, counts, maxes = [], [], [], []
    pending = [2.5, scaling.UNRECORDED, math.inf, math.nan, -0.0, 0.0, 1e-42, 3e38, 448.0, 7.0 * 2.0**-20]
    for i in range(23):
        h = torch.exp(torch.randn(length, device=DEV) * 5)
        h[torch.rand(length, device=DEV) < 0.25] = scaling.UNRECORDED
        if i < len(pending):
            h[0] = pending[i]
        histories.append(h)
        scales.append(f32(2.0 ** (i % 7 - 3)))
        counts.append(torch.randint(0, 100, (), dtype=torch.int32, device=DEV))
        maxes.append((448.0, 57344.0)[i % 2])
    ref = [[t.clone() for t in ts] for ts in (histories, scales, counts)]
    launch = ScaleUpdateLaunch(histories, scales, counts, maxes, algo, margin, power_of_two=True)
    for step in range(4):
        launch()
        reference.scale_update(*ref, maxes, algo, margin, power_of_two=True)
        for name, got, want in zip(("history", "scale", "count"), (histories, scales, counts), ref):
            for i, (g, w) in enumerate(zip(got, want)):
                assert_bitwise(g, w, f"step {step}, quantizer {i}: {name}")
        assert all(math.frexp(s.item())[0] == 0.5 for s in scales)
        new = torch.exp(torch.randn(len(histories), device=DEV) * 5)
        new[::5] = (math.inf, math.nan, scaling.UNRECORDED, 0.0)[step]
        for i, (h, h_ref) in enumerate(zip(histories, ref[0])):
            h[0] = new[i]
            h_ref[0] = new[i]


# --------------------------------------------------------------------------- producers


@pytest.mark.parametrize("amax", [pytest.param(41.5, id="41.5"), pytest.param(1e-40, id="subnormal"),
                                  pytest.param(math.inf, id="inf")])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layer", [pytest.param(True, id="layernorm"), pytest.param(False, id="rmsnorm")])
def test_norm_fwd_with_power_of_two(layer, fp8, amax):
    m, k = 1000, 1024
    x = (torch.randn(m, k, device=DEV) * 3).to(torch.bfloat16)
    weight = torch.rand(k, device=DEV) + 0.5
    bias = torch.randn(k, device=DEV) * 0.1 if layer else None
    mean = torch.empty(m, device=DEV) if layer else None
    rstd = torch.empty(m, device=DEV)
    norm.norm_stats(x, weight, bias, 1e-5, mean, rstd)
    results = []
    for impl in (norm, norm_ref):
        s, inv, c = f32(PREV_SCALE), f32(-3.0), torch.tensor(4, dtype=torch.int32, device=DEV)
        out, out_t = poisoned((m, k), fp8, 0x5A), poisoned((k, 1008), fp8, 0x5A)
        impl.norm_fwd_fp8(x, weight, bias, 1e-5, mean, rstd, out, out_t, s, inv, None, f32(amax), c, None,
                          stats_ready=True, power_of_two=True)
        results.append((out, out_t, s, inv, c))
    (out, out_t, s, inv, c), (w_out, w_out_t, w_s, w_inv, w_c) = results
    for name, g, w in (("scale", s, w_s), ("scale_inv", inv, w_inv), ("count", c, w_c)):
        assert_bitwise(g, w, name)
    assert_power_of_two_scale(s, inv, f32(amax))
    assert_fp8_near(out, w_out, "out")
    assert_bitwise(out_t[:, :m], out.t(), "out_t[:, :M] vs out.T")
    assert not out_t[:, m:].view(torch.uint8).any()


@pytest.mark.parametrize("amax", [pytest.param(41.5, id="41.5"), pytest.param(1e-40, id="subnormal"),
                                  pytest.param(math.nan, id="nan")])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_activation_with_power_of_two(act, fp8, amax):
    m, f = 1000, 1536
    h = (torch.randn(m, 2 * f if act == "swiglu" else f, device=DEV) * 4).to(torch.bfloat16)
    da = (torch.randn(m, f, device=DEV) * 4).to(torch.bfloat16)
    fh = h.shape[1]
    results = []
    for impl in (activation, act_ref):
        s, inv, c = f32(PREV_SCALE), f32(-3.0), torch.tensor(2, dtype=torch.int32, device=DEV)
        out, out_t = poisoned((m, f), fp8, 0x5A), poisoned((f, 1008), fp8, 0x5A)
        impl.act_fwd_fp8(h, act, out, out_t, s, inv, None, f32(amax), c, power_of_two=True)
        ds, dinv = f32(PREV_SCALE), f32(-3.0)
        dout, dout_t = poisoned((m, fh), fp8, 0xA5), poisoned((fh, 1008), fp8, 0xA5)
        db = torch.empty(fh, device=DEV)
        impl.act_bwd_fp8(da, h, act, dout, dout_t, ds, dinv, None, f32(amax), c, db, power_of_two=True)
        results.append(dict(out=out, out_t=out_t, s=s, inv=inv, dout=dout, dout_t=dout_t, ds=ds, dinv=dinv, c=c))
    got, want = results
    for name in ("s", "inv", "ds", "dinv", "c"):
        assert_bitwise(got[name], want[name], name)
    assert_power_of_two_scale(got["s"], got["inv"], f32(amax))
    assert_power_of_two_scale(got["ds"], got["dinv"], f32(amax))
    for key in ("out", "dout"):
        assert_fp8_near(got[key], want[key], key)
        assert_bitwise(got[f"{key}_t"][:, :m], got[key].t(), f"{key}_t[:, :M] vs {key}.T")
        assert not got[f"{key}_t"][:, m:].view(torch.uint8).any()
