"""Triton kernels against their reference twins on the GPU, bit for bit.

Both sides run on CUDA tensors: `fp8train.kernels.cast.*` / `scale_update` (Triton) and
`fp8train.kernels.reference.*` (torch). Compared exactly: fp8 bytes (NaN encodings
included), the transposed copy and its zero padding, amax, scale, scale_inv, counters and
amax histories. Every kernel writes into outputs poisoned with two different byte patterns
in turn, so an element the kernel forgets to write fails one of the two runs.
"""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

pytest.importorskip("triton")

from fp8train import kernels, scaling  # noqa: E402
from fp8train.kernels import cast, reference  # noqa: E402
from fp8train.kernels.scale_update import ScaleUpdateLaunch  # noqa: E402
from helpers import all_bf16_values, assert_bitwise, FP8_FORMATS, INPUT_DTYPES, make_input, poisoned  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = FP8_FORMATS
INPUTS = INPUT_DTYPES
POISONS = (0x5A, 0xA5)
# Scaling modes: ("delayed", scale) reads `scale`; ("current", amax) computes the scale from
# `amax` ("x": the amax of the input's finite values) and counts a non-finite one.
SCALES = [pytest.param(("delayed", s), id=f"delayed-{n}") for s, n in
          ((1.0, "1"), (2.0**-10, "2^-10"), (3.7, "3.7"), (2.0**20, "2^20"))]
CURRENT = [pytest.param(("current", "x"), id="current-own-amax"), pytest.param(("current", 1000.0), id="current-1000")]


# --------------------------------------------------------------------------- helpers


class Scalars:
    """The scalar tensors one cast reads and writes; clone() gives the reference its own."""

    def __init__(self, scale, scale_inv, amax, from_amax, count):
        self.scale, self.scale_inv, self.amax, self.from_amax, self.count = scale, scale_inv, amax, from_amax, count

    @classmethod
    def make(cls, x, mode, amax_start: Optional[float] = scaling.UNRECORDED) -> "Scalars":
        f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=DEV)
        amax = None if amax_start is None else f32(amax_start)
        kind, value = mode
        if kind == "delayed":
            return cls(f32(value), f32(-3.0), amax, None, None)
        if value == "x":  # the amax of the finite entries, so that the scale does change
            from_amax = reference.abs_max(torch.where(x.isfinite(), x, 0.0))
        else:
            from_amax = f32(value)
        return cls(f32(0.8125), f32(-3.0), amax, from_amax, torch.tensor(4, dtype=torch.int32, device=DEV))

    def clone(self) -> "Scalars":
        c = lambda t: None if t is None else t.clone()
        return Scalars(c(self.scale), c(self.scale_inv), c(self.amax), c(self.from_amax), c(self.count))

    def args(self):
        return self.scale, self.scale_inv, self.amax, self.from_amax, self.count

    def assert_equal(self, want: "Scalars") -> None:
        for name in ("scale", "scale_inv", "amax", "from_amax", "count"):
            g, w = getattr(self, name), getattr(want, name)
            if g is not None:
                assert_bitwise(g, w, name)


def check_cast_amax(x, fp8, mode, amax_start=scaling.UNRECORDED) -> None:
    start = Scalars.make(x, mode, amax_start)
    want_s = start.clone()
    want = poisoned(x.shape, fp8, 0)
    reference.cast_amax(x, want, *want_s.args())
    for byte in POISONS:
        got_s = start.clone()
        out = poisoned(x.shape, fp8, byte)
        cast.cast_amax(x, out, *got_s.args())
        assert_bitwise(out, want, f"cast_amax out (poison {byte:#x})")
        got_s.assert_equal(want_s)


def check_cast_transpose_amax(x, fp8, mode, mp: int, amax_start=scaling.UNRECORDED) -> None:
    m, n = x.shape
    start = Scalars.make(x, mode, amax_start)
    want_s = start.clone()
    want, want_t = poisoned((m, n), fp8, 0), poisoned((n, mp), fp8, 0)
    reference.cast_transpose_amax(x, want, want_t, *want_s.args())
    for byte in POISONS:
        got_s = start.clone()
        out, out_t = poisoned((m, n), fp8, byte), poisoned((n, mp), fp8, byte)
        cast.cast_transpose_amax(x, out, out_t, *got_s.args())
        assert_bitwise(out, want, f"cast_transpose_amax out (poison {byte:#x})")
        assert_bitwise(out_t, want_t, f"cast_transpose_amax out_t (poison {byte:#x})")
        got_s.assert_equal(want_s)


# --------------------------------------------------------------------------- every bit pattern


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", SCALES + CURRENT)
def test_every_bf16_bit_pattern(fp8, mode):
    x = all_bf16_values(DEV)                                  # (65536,) NaNs, infs, subnormals
    check_cast_amax(x, fp8, mode)
    check_cast_transpose_amax(x.view(256, 256), fp8, mode, mp=256)
    check_cast_transpose_amax(x.view(512, 128)[:500], fp8, mode, mp=512)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", [SCALES[2], CURRENT[1]])
def test_every_fp16_bit_pattern(fp8, mode):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=DEV).to(torch.int16).view(torch.float16)
    check_cast_amax(x, fp8, mode)
    check_cast_transpose_amax(x.view(128, 512), fp8, mode, mp=144)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", [SCALES[0], SCALES[2], CURRENT[1]])
def test_random_fp32_bit_patterns(fp8, mode):
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), dtype=torch.int64, device=DEV).to(torch.int32)
    x = bits.view(torch.float32)                              # every exponent, NaN payloads, subnormals
    check_cast_amax(x, fp8, mode)
    check_cast_transpose_amax(x.view(1024, 1024)[:1000, :1000], fp8, mode, mp=1008)


# --------------------------------------------------------------------------- shapes and layouts


@pytest.mark.parametrize("shape", [(1,), (1, 1), (3, 17), (1000, 1003), (7, 33, 129), (4097, 8191)], ids=str)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", [SCALES[2], CURRENT[0]])
def test_cast_amax_shapes(shape, fp8, mode):
    check_cast_amax(make_input(shape, torch.bfloat16), fp8, mode)


@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("fp8", FP8)
def test_cast_amax_input_dtypes(x_dtype, fp8):
    x = make_input((513, 1024), x_dtype)
    check_cast_amax(x, fp8, SCALES[1].values[0])
    check_cast_amax(x, fp8, CURRENT[0].values[0])


@pytest.mark.parametrize("fp8", FP8)
def test_cast_amax_row_slices(fp8):
    """Rows with a stride (the tiled path without the transpose)."""
    big = make_input((6, 130, 300), torch.bfloat16)
    check_cast_amax(big[:, :, 7:263], fp8, SCALES[2].values[0])   # 3-D, unaligned start
    check_cast_amax(big[2, :, :256], fp8, CURRENT[0].values[0])   # 2-D, aligned row stride


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (16, 16), (33, 64), (200, 1000), (1000, 1003), (4097, 8191)],
                         ids=str)
@pytest.mark.parametrize("pad", ["none", "to16", "plus100"])
@pytest.mark.parametrize("fp8", FP8)
def test_cast_transpose_amax_shapes(shape, pad, fp8):
    m = shape[0]
    mp = {"none": m, "to16": (m + 15) // 16 * 16, "plus100": m + 100}[pad]
    x = make_input(shape, torch.bfloat16)
    check_cast_transpose_amax(x, fp8, SCALES[2].values[0], mp)
    check_cast_transpose_amax(x, fp8, CURRENT[0].values[0], mp)


@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("fp8", FP8)
def test_cast_transpose_amax_input_dtypes_and_strided_rows(x_dtype, fp8):
    big = make_input((1030, 1600), x_dtype)
    check_cast_transpose_amax(big[:1000, :1024], fp8, SCALES[2].values[0], mp=1008)      # row stride 1600
    check_cast_transpose_amax(big[3:1030, 5:1004], fp8, CURRENT[0].values[0], mp=1040)   # unaligned everything
    check_cast_transpose_amax(big[::2, 64:576], fp8, SCALES[3].values[0], mp=528)        # row stride 3200


# --------------------------------------------------------------------------- amax and scales


@pytest.mark.parametrize("start", ["unrecorded", "zero", "below", "above", "inf"])
def test_amax_accumulates_into_existing_value(start):
    x = make_input((777, 1111), torch.bfloat16)
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    true_amax = reference.abs_max(x).item()
    value = {"unrecorded": scaling.UNRECORDED, "zero": 0.0, "below": true_amax / 2, "above": true_amax * 2,
             "inf": math.inf}[start]
    check_cast_amax(x, E4M3, SCALES[2].values[0], amax_start=value)
    check_cast_transpose_amax(x, E5M2, SCALES[0].values[0], mp=784, amax_start=value)
    for t in (x, x[:, 3:1000], x.view(7, 111, 1111)):
        got, want = torch.tensor(value, device=DEV), torch.tensor(value, device=DEV)
        cast.amax(t, got)
        reference.amax(t, want)
        assert_bitwise(got, want, "amax")


@pytest.mark.parametrize("special", [math.nan, -math.nan, math.inf, -math.inf], ids=["nan", "-nan", "inf", "-inf"])
def test_amax_counts_nan_as_inf(special):
    x = make_input((300, 400), torch.float16)
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    x[123, 321] = special
    got = torch.tensor(scaling.UNRECORDED, device=DEV)
    cast.amax(x, got)
    assert got.item() == math.inf


@pytest.mark.parametrize("from_amax", [0.0, -1.0, 1e-40, 1e-30, 3e38, math.inf, math.nan, 2.5],
                         ids=["zero", "unrecorded", "subnormal", "tiny", "huge", "inf", "nan", "normal"])
@pytest.mark.parametrize("fp8", FP8)
def test_current_scaling_edge_amaxes(from_amax, fp8):
    """amax 0 / negative / inf / NaN keep the old scale (inf, NaN count); subnormal clamps to 2**126."""
    x = make_input((96, 160), torch.bfloat16)
    check_cast_amax(x, fp8, ("current", from_amax))
    check_cast_transpose_amax(x, fp8, ("current", from_amax), mp=96)


@pytest.mark.parametrize("rows_case", ["x", "inf", "nan", "long"])
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "tile"])
@pytest.mark.parametrize("x_dtype", INPUTS)
def test_cast_from_rows_amax(rows_case, transpose, x_dtype):
    """launch_cast with rows_amax (the per-row amaxes traced code hands the cast operator): the
    kernel's max of them into from_amax, then the cast, bit for bit against the twin
    (from_amax <- reference.abs_max(rows_amax), then the reference cast); "long": a vector
    of several of the reduction's load steps."""
    m, n = (8192, 64) if rows_case == "long" else (300, 160)
    x = make_input((m, n), x_dtype).nan_to_num(0.0, 1.0, -1.0)  # finite: the specials come from rows_case
    a = x.float().abs()
    rows = torch.where(a.isnan(), math.inf, a).amax(dim=1)
    if rows_case in ("inf", "nan"):
        rows[m // 3] = math.inf if rows_case == "inf" else math.nan
    start = Scalars.make(x, ("current", 0.0))
    want_s, got_s = start.clone(), start.clone()
    want_s.from_amax.copy_(reference.abs_max(rows))
    mp = m + 16 if transpose else None
    want, got = poisoned((m, n), E4M3, 0), poisoned((m, n), E4M3, 0x5A)
    want_t, got_t = (poisoned((n, mp), E4M3, 0), poisoned((n, mp), E4M3, 0x5A)) if transpose else (None, None)
    if transpose:
        reference.cast_transpose_amax(x, want, want_t, *want_s.args())
    else:
        reference.cast_amax(x, want, *want_s.args())
    cast.launch_cast(x, got, got_t, got_s.scale, got_s.scale_inv, got_s.amax, got_s.from_amax, got_s.count,
                     rows_amax=rows)
    assert_bitwise(got, want, "out")
    if transpose:
        assert_bitwise(got_t, want_t, "out_t")
    got_s.assert_equal(want_s)


def test_empty_inputs():
    x = torch.empty((0, 48), dtype=torch.bfloat16, device=DEV)
    check_cast_amax(x, E4M3, CURRENT[0].values[0])
    check_cast_transpose_amax(x, E5M2, SCALES[2].values[0], mp=16)
    got, want = torch.tensor(-1.0, device=DEV), torch.tensor(-1.0, device=DEV)
    cast.amax(x, got)
    reference.amax(x, want)
    assert_bitwise(got, want, "amax")


def test_dispatcher_uses_triton_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(cast, "_launch", lambda *a, **k: calls.append(a))
    x = make_input((64, 64), torch.bfloat16)
    kernels.cast_amax(x, torch.empty(64, 64, dtype=E4M3, device=DEV), torch.ones((), device=DEV),
                      torch.ones((), device=DEV))
    assert len(calls) == 1


# --------------------------------------------------------------------------- scale update


def make_quantizers(num: int, length: int):
    """Histories with finite / unrecorded / inf / NaN / zero pending amaxes, some odd past entries."""
    histories, scales, counts, maxes = [], [], [], []
    pending = [2.5, scaling.UNRECORDED, math.inf, math.nan, -math.inf, -0.0, 0.0, 1e-42, 3e38, -5.0]
    for i in range(num):
        h = torch.exp(torch.randn(length, device=DEV) * 5)
        h[torch.rand(length, device=DEV) < 0.25] = scaling.UNRECORDED
        if length > 2 and i % 6 == 5:
            h[1 + i % (length - 1)] = (math.nan, math.inf)[i % 2]
        if i < len(pending):
            h[0] = pending[i]
        histories.append(h)
        scales.append(torch.exp(torch.randn((), device=DEV) * 3))
        counts.append(torch.randint(0, 100, (), dtype=torch.int32, device=DEV))
        maxes.append((448.0, 57344.0)[i % 2])
    return histories, scales, counts, maxes


@pytest.mark.parametrize("length", [1, 16, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
def test_scale_update_matches_reference(length, algo, margin):
    histories, scales, counts, maxes = make_quantizers(37, length)
    ref = [[t.clone() for t in ts] for ts in (histories, scales, counts)]
    launch = ScaleUpdateLaunch(histories, scales, counts, maxes, algo, margin)
    for step in range(4):
        launch()
        reference.scale_update(*ref, maxes, algo, margin)
        for name, got, want in zip(("history", "scale", "count"), (histories, scales, counts), ref):
            for i, (g, w) in enumerate(zip(got, want)):
                assert_bitwise(g, w, f"step {step}, quantizer {i}: {name}")
        new = torch.exp(torch.randn(len(histories), device=DEV) * 5)
        new[::7] = (math.inf, math.nan, scaling.UNRECORDED, 0.0)[step]
        for i, (h, h_ref) in enumerate(zip(histories, ref[0])):
            h[0] = new[i]
            h_ref[0] = new[i]


# --------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture_matches_eager():
    """One training step's FP8 bookkeeping (a delayed-scaling cast into history[0], then the
    scale update) captured once and replayed on new inputs equals running it eagerly."""

    def make_state():
        histories, scales, counts, maxes = make_quantizers(5, 16)
        return dict(x=make_input((1000, 512), torch.bfloat16), out=poisoned((1000, 512), E4M3, 0x5A),
                    out_t=poisoned((512, 1008), E4M3, 0x5A), inv=torch.zeros((), device=DEV),
                    inv_t=torch.zeros((), device=DEV), histories=histories, scales=scales, counts=counts, maxes=maxes)

    def step(s, update):
        cast.cast_amax(s["x"], s["out"], s["scales"][0], s["inv"], s["histories"][0][0])
        cast.cast_transpose_amax(s["x"], s["out"], s["out_t"], s["scales"][1], s["inv_t"], s["histories"][1][0])
        update()

    graphed = make_state()
    eager = {k: ([t.clone() for t in v] if isinstance(v, list) and torch.is_tensor(v[0]) else
                 v.clone() if torch.is_tensor(v) else v) for k, v in graphed.items()}
    g_update = kernels.ScaleUpdateBatch(graphed["histories"], graphed["scales"], graphed["counts"], graphed["maxes"],
                                        "max", 0)
    e_update = kernels.ScaleUpdateBatch(eager["histories"], eager["scales"], eager["counts"], eager["maxes"], "max", 0)
    # Warm up (compiles the kernels) on copies, outside the capture.
    warm = {k: ([t.clone() for t in v] if isinstance(v, list) and torch.is_tensor(v[0]) else
                v.clone() if torch.is_tensor(v) else v) for k, v in graphed.items()}
    warm_update = kernels.ScaleUpdateBatch(warm["histories"], warm["scales"], warm["counts"], warm["maxes"], "max", 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warm, warm_update)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, g_update)
    for replay in range(3):
        x_new = make_input((1000, 512), torch.bfloat16) * (replay + 1)
        graphed["x"].copy_(x_new)
        eager["x"].copy_(x_new)
        graph.replay()
        step(eager, e_update)
        torch.cuda.synchronize()
        for key in ("out", "out_t", "inv", "inv_t"):
            assert_bitwise(graphed[key], eager[key], f"replay {replay}: {key}")
        for key in ("histories", "scales", "counts"):
            for i, (g, e) in enumerate(zip(graphed[key], eager[key])):
                assert_bitwise(g, e, f"replay {replay}: {key}[{i}]")


# --------------------------------------------------------------------------- bias gradient

# The bias gradient rides on a grad-output cast (dbias_out): per-tile column sums in float32,
# then a sum of the tile rows. Compared with a float64 sum: the error of a float32 sum of
# M terms in that order is bounded by ~(log2 BLOCK_M + M / BLOCK_M) * 2^-24 * sum|x| per
# column; 2^-16 * sum|x| leaves room and still fails on a dropped or doubled row or tile.
DBIAS_SHAPES = [(1, 16), (3, 17), (129, 64), (1000, 1003), (4097, 520), (2, 7, 33)]


def check_dbias(got: torch.Tensor, x: torch.Tensor) -> None:
    x2 = x.reshape(-1, x.shape[-1]).double()
    want = x2.sum(0)
    bound = x2.abs().sum(0) * 2.0**-16 + 1e-30
    err = (got.double() - want).abs()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (err <= bound).all(), f"dbias: worst error {float((err / bound).max()):.3g}x the bound"


@pytest.mark.parametrize("shape", DBIAS_SHAPES, ids=str)
@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transpose"])
@pytest.mark.parametrize("mode", [SCALES[2], CURRENT[0]])
def test_cast_with_dbias(shape, x_dtype, transpose, mode):
    if transpose and len(shape) != 2:
        pytest.skip("cast_transpose_amax takes 2-D x")
    x = (torch.randn(shape, device=DEV) * 3).to(x_dtype)
    m, n = x.numel() // shape[-1], shape[-1]
    start = Scalars.make(x, mode)
    want_s = start.clone()
    want = poisoned(x.shape, E5M2, 0)
    mp = (m + 15) // 16 * 16
    want_t = poisoned((n, mp), E5M2, 0)
    if transpose:
        reference.cast_transpose_amax(x, want, want_t, *want_s.args())
    else:
        reference.cast_amax(x, want, *want_s.args())
    for byte in POISONS:
        got_s = start.clone()
        dbias = torch.full((n,), math.nan, device=DEV)
        out = poisoned(x.shape, E5M2, byte)
        if transpose:
            out_t = poisoned((n, mp), E5M2, byte)
            cast.cast_transpose_amax(x, out, out_t, *got_s.args(), dbias_out=dbias)
            assert_bitwise(out_t, want_t, f"out_t with dbias (poison {byte:#x})")
        else:
            cast.cast_amax(x, out, *got_s.args(), dbias_out=dbias)
        assert_bitwise(out, want, f"out with dbias (poison {byte:#x})")
        got_s.assert_equal(want_s)
        check_dbias(dbias, x)


def test_dbias_keeps_nonfinite_columns_to_themselves():
    x = torch.randn(300, 48, device=DEV, dtype=torch.bfloat16)
    x[17, 5], x[250, 9], x[3, 30], x[299, 30] = math.nan, math.inf, math.inf, -math.inf
    dbias = torch.empty(48, device=DEV)
    s = Scalars.make(x, SCALES[2].values[0])
    cast.cast_transpose_amax(x, torch.empty(x.shape, dtype=E4M3, device=DEV),
                             torch.empty((48, 304), dtype=E4M3, device=DEV), *s.args(), dbias_out=dbias)
    assert dbias[5].isnan() and dbias[30].isnan() and dbias[9] == math.inf
    finite = torch.ones(48, dtype=torch.bool, device=DEV)
    finite[[5, 9, 30]] = False
    check_dbias(dbias[finite], x[:, finite])


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transpose"])
def test_quantizer_cast_with_dbias_on_every_call(recipe, transpose):
    """The prepared launch (a quantizer's steady state) reuses its partial-sum buffer."""
    from fp8train.quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer
    from fp8train.roles import TensorRole
    q = (DelayedScalingQuantizer(TensorRole.GRAD_OUTPUT, E5M2, 16, device=DEV) if recipe == "delayed"
         else CurrentScalingQuantizer(TensorRole.GRAD_OUTPUT, E5M2, device=DEV))
    for step in range(4):
        x = torch.randn(777, 272, device=DEV, dtype=torch.bfloat16) * (step + 1)
        got = q.cast(x, transpose=transpose, dbias=True)
        check_dbias(got.dbias, x)
        plain = q.cast(x, transpose=transpose)  # no dbias: the same bytes
        assert plain.dbias is None
        assert_bitwise(got.data, plain.data, f"step {step}: data with and without dbias")
