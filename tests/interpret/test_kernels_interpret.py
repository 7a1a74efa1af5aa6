"""The Triton kernels under the Triton interpreter on CPU, against their reference twins.

Run with `TRITON_INTERPRET=1 python -m pytest tests/interpret` (skipped otherwise).

The interpreter's own fp32 -> fp8 conversion (triton 3.9) is not the hardware's: it rounds
on the first cut-off bit alone (ties and sticky bits go up), loses a mantissa carry into an
odd exponent (1.98 -> 1.0 instead of 2.0), garbles results in the fp8 subnormal range and
turns e4m3 NaN into 256; its bf16 -> fp32 conversion flushes bf16 subnormals. So most tests
here swap in exact conversions (fixture `exact_conversions`) and compare everything bit for
bit: the kernels' scaling, clamping, NaN handling, masks, tails, padding and scalar side
effects. `test_interpreter_conversion_within_one_ulp` keeps the interpreter's own fp8
conversion and compares within one fp8 ulp where that conversion is sane. The conversion
instructions themselves are checked bit for bit on the GPU (tests/gpu).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")


from fp8train import scaling  # noqa: E402
from fp8train.kernels import cast, reference  # noqa: E402
from fp8train.kernels.scale_update import ScaleUpdateLaunch  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
INPUT_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
                pytest.param(torch.float32, id="fp32")]
# Launch shapes: the interpreter's own (small blocks: several loop steps per program, tails,
# edge tiles) and the GPU's (whole tensors inside one block or tile).
CONFIGS = [pytest.param(cast.launch_configs(torch.device("cpu")), id="cpu-config"),
           pytest.param(cast.launch_configs(torch.device("cuda")), id="gpu-config")]
# (mode, value): delayed scaling reads `value` as the scale; current scaling computes the
# scale from the amax `value` ("x" = the amax of its finite values).
DELAYED_1, DELAYED_TINY, DELAYED_3_7, DELAYED_HUGE = (("delayed", s) for s in (1.0, 2.0**-10, 3.7, 2.0**20))
CURRENT = ("current", "x")
MODES = [pytest.param(DELAYED_1, id="delayed-1"), pytest.param(DELAYED_TINY, id="delayed-2^-10"),
         pytest.param(DELAYED_3_7, id="delayed-3.7"), pytest.param(DELAYED_HUGE, id="delayed-2^20"),
         pytest.param(CURRENT, id="current")]
# numpy warns about the float32 overflow that the cast's clamp then handles.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


# --------------------------------------------------------------------------- helpers


# exact_conversions: tests/interpret/conftest.py


@pytest.fixture(params=CONFIGS)
def config(request, exact_conversions):
    """Every cast test runs under both launch shapes, with the exact conversion."""
    with cast.override_configs(*request.param):
        yield request.param


def make_input(shape, dtype, specials=True) -> torch.Tensor:
    """Normal values over a wide range of magnitudes, with NaN, +-inf, -0, subnormals sprinkled in."""
    x = torch.randn(shape) * torch.exp2(torch.randint(-12, 12, shape).float())
    x = x.to(dtype)
    if specials and x.numel() >= 4:
        finfo = torch.finfo(dtype)
        values = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, finfo.tiny / 4, -finfo.tiny,
                               finfo.max, 1000.0, -70000.0], dtype=dtype)
        flat = x.view(-1)
        k = min(values.numel(), max(1, flat.numel() // 8))
        flat[torch.randperm(flat.numel())[:k]] = values[torch.randperm(values.numel())[:k]]
    return x


def poisoned(shape, dtype) -> torch.Tensor:
    """An fp8 tensor full of 0x5A bytes, so elements a kernel forgot to write stand out."""
    return torch.full(shape, 0x5A, dtype=torch.uint8).view(dtype)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(int_view), want.view(int_view)), f"{what}: {got} != {want}"


def assert_fp8_equal(got: torch.Tensor, want: torch.Tensor, what: str = "fp8 output") -> None:
    """Bytewise, except that any NaN encoding matches any other (the GPU tests pin those)."""
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    nan_w, nan_g = want.float().isnan(), got.float().isnan()
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ"
    bad = (g != w) & ~nan_w
    assert not bad.any(), f"{what}: {int(bad.sum())} bytes differ, e.g. got {g[bad][:8].tolist()} want {w[bad][:8].tolist()}"


@dataclass
class Scalars:
    """The scalar tensors a cast reads and writes."""

    scale: torch.Tensor
    scale_inv: torch.Tensor
    amax: Optional[torch.Tensor]
    from_amax: Optional[torch.Tensor]
    count: Optional[torch.Tensor]

    @classmethod
    def make(cls, x: torch.Tensor, mode, amax_start: Optional[float] = scaling.UNRECORDED) -> "Scalars":
        kind, value = mode
        scalar = lambda v: torch.tensor(v, dtype=torch.float32)
        amax = None if amax_start is None else scalar(amax_start)
        if kind == "delayed":
            return cls(scalar(value), scalar(-7.0), amax, None, None)
        if value == "x":  # the amax of the finite entries, so that the scale does change
            from_amax = reference.abs_max(torch.where(x.isfinite(), x, 0.0))
        else:
            from_amax = scalar(value)
        return cls(scalar(0.625), scalar(-7.0), amax, from_amax, torch.tensor(5, dtype=torch.int32))

    def clone(self) -> "Scalars":
        c = lambda t: None if t is None else t.clone()
        return Scalars(c(self.scale), c(self.scale_inv), c(self.amax), c(self.from_amax), c(self.count))

    def args(self):
        return self.scale, self.scale_inv, self.amax, self.from_amax, self.count

    def assert_equal(self, other: "Scalars") -> None:
        for name in ("scale", "scale_inv", "amax", "from_amax", "count"):
            a, b = getattr(self, name), getattr(other, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert_bits_equal(a, b, name)


def run_cast_amax(x, fp8_dtype, mode, amax_start=scaling.UNRECORDED, power_of_two=False):
    s_kernel = Scalars.make(x, mode, amax_start)
    s_ref = s_kernel.clone()
    out = poisoned(x.shape, fp8_dtype)
    want = torch.empty(x.shape, dtype=fp8_dtype)
    cast.cast_amax(x, out, *s_kernel.args(), power_of_two=power_of_two)
    reference.cast_amax(x, want, *s_ref.args(), power_of_two=power_of_two)
    assert_fp8_equal(out, want)
    s_kernel.assert_equal(s_ref)
    return out, s_kernel


def run_cast_transpose_amax(x, fp8_dtype, mode, mp, amax_start=scaling.UNRECORDED, power_of_two=False):
    m, n = x.shape
    s_kernel = Scalars.make(x, mode, amax_start)
    s_ref = s_kernel.clone()
    out, out_t = poisoned((m, n), fp8_dtype), poisoned((n, mp), fp8_dtype)
    want, want_t = torch.empty((m, n), dtype=fp8_dtype), poisoned((n, mp), fp8_dtype)
    cast.cast_transpose_amax(x, out, out_t, *s_kernel.args(), power_of_two=power_of_two)
    reference.cast_transpose_amax(x, want, want_t, *s_ref.args(), power_of_two=power_of_two)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t, want_t, "transposed copy")
    assert_bits_equal(out_t[:, :m], out.t(), "out_t[:, :M] vs out.T")  # the kernel's own two copies agree
    assert not out_t[:, m:].view(torch.uint8).any(), "padding columns must be zero bytes"
    s_kernel.assert_equal(s_ref)


# --------------------------------------------------------------------------- casts


@pytest.mark.sweep
@pytest.mark.parametrize("shape", [(1,), (1, 1), (3, 17), (200,), (2, 7, 33)], ids=str)
@pytest.mark.parametrize("x_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_cast_amax(shape, x_dtype, fp8_dtype, mode, config):
    run_cast_amax(make_input(shape, x_dtype), fp8_dtype, mode)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("mode", [MODES[2], MODES[4]])
def test_cast_amax_row_slices(fp8_dtype, mode, config):
    """Non-contiguous x whose rows have unit stride takes the tiled path."""
    big = make_input((3, 11, 50), torch.bfloat16)
    run_cast_amax(big[:, :, 3:40], fp8_dtype, mode)     # 3-D, leading dims fold into one row stride
    run_cast_amax(big[1, 2:9, :37], fp8_dtype, mode)    # 2-D row slice


@pytest.mark.sweep
@pytest.mark.parametrize("shape", [(1, 1), (5, 33), (37, 20), (64, 70)], ids=str)
@pytest.mark.parametrize("pad", [0, "to16", 21], ids=lambda p: f"pad-{p}")
@pytest.mark.parametrize("x_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("mode", [MODES[0], MODES[2], MODES[4]])
def test_cast_transpose_amax(shape, pad, x_dtype, fp8_dtype, mode, config):
    m = shape[0]
    mp = (m + 15) // 16 * 16 if pad == "to16" else m + pad
    run_cast_transpose_amax(make_input(shape, x_dtype), fp8_dtype, mode, mp)


@pytest.mark.sweep
@pytest.mark.parametrize("shape", [(1, 1), (5, 33), (37, 20), (64, 70), (3, 4, 18)], ids=str)
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transpose"])
@pytest.mark.parametrize("x_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("mode", [MODES[2], MODES[4]])
def test_cast_with_dbias(shape, transpose, x_dtype, mode, config):
    """DBIAS: the tile kernel's column sums per tile, reduced on the host; the cast itself
    unchanged. Sums compared with float64 within float32 rounding (the order differs)."""
    if transpose and len(shape) != 2:
        pytest.skip("cast_transpose_amax takes 2-D x")
    x = (torch.randn(shape) * 3).to(x_dtype)
    n = shape[-1]
    m = x.numel() // n
    s_kernel = Scalars.make(x, mode)
    s_ref = s_kernel.clone()
    dbias = torch.full((n,), math.nan)
    out, want = poisoned(shape, E4M3), torch.empty(shape, dtype=E4M3)
    if transpose:
        mp = (m + 15) // 16 * 16
        out_t, want_t = poisoned((n, mp), E4M3), poisoned((n, mp), E4M3)
        cast.cast_transpose_amax(x, out, out_t, *s_kernel.args(), dbias_out=dbias)
        reference.cast_transpose_amax(x, want, want_t, *s_ref.args())
        assert_fp8_equal(out_t, want_t, "transposed copy")
    else:
        cast.cast_amax(x, out, *s_kernel.args(), dbias_out=dbias)
        reference.cast_amax(x, want, *s_ref.args())
    assert_fp8_equal(out, want)
    s_kernel.assert_equal(s_ref)
    x2 = x.reshape(m, n).double()
    err = (dbias.double() - x2.sum(0)).abs()
    assert (err <= x2.abs().sum(0) * 2.0**-18 + 1e-30).all(), f"dbias off by up to {float(err.max()):.3g}"


@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "tile-transpose"])
@pytest.mark.parametrize("flag", [0, 1], ids=["flag0", "flag1"])
@pytest.mark.parametrize("mode", [MODES[2], MODES[4]])
def test_skip_flag(transpose, flag, mode, config):
    """SKIP: with a nonzero device flag the launch writes nothing at all (payload, transposed
    copy, scale, scale_inv, amax, counter); with zero it is the ordinary cast."""
    x = make_input((37, 48), torch.bfloat16)
    s_kernel = Scalars.make(x, mode)
    s_ref = s_kernel.clone()
    out, out_t = poisoned((37, 48), E4M3), (poisoned((48, 48), E4M3) if transpose else None)
    skip = torch.tensor(flag, dtype=torch.int32)
    cast.launch_cast(x, out, out_t, *s_kernel.args(), None, skip)
    if flag:
        assert_fp8_equal(out, poisoned((37, 48), E4M3), "skipped out")
        if transpose:
            assert_fp8_equal(out_t, poisoned((48, 48), E4M3), "skipped out_t")
        s_kernel.assert_equal(s_ref)
        return
    want = torch.empty((37, 48), dtype=E4M3)
    if transpose:
        want_t = poisoned((48, 48), E4M3)
        reference.cast_transpose_amax(x, want, want_t, *s_ref.args())
        assert_fp8_equal(out_t, want_t, "transposed copy")
    else:
        reference.cast_amax(x, want, *s_ref.args())
    assert_fp8_equal(out, want)
    s_kernel.assert_equal(s_ref)


def test_dbias_out_is_checked(config):
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    s = Scalars.make(x, DELAYED_1)
    for bad in (torch.empty(32, dtype=torch.bfloat16), torch.empty(31), torch.empty(64)[::2]):
        with pytest.raises(ValueError, match="dbias_out must be a contiguous float32 tensor of shape"):
            cast.cast_amax(x, torch.empty(x.shape, dtype=E4M3), *s.args(), dbias_out=bad)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("mode", [MODES[1], MODES[4]])
def test_cast_transpose_amax_strided_rows(fp8_dtype, mode, config):
    big = make_input((40, 96), torch.float16)
    run_cast_transpose_amax(big[3:34, 5:72], fp8_dtype, mode, mp=48)  # row stride 96 > N = 67
    run_cast_transpose_amax(big[::2, :16], fp8_dtype, mode, mp=32)    # row stride 192


@pytest.mark.parametrize("amax_start", [scaling.UNRECORDED, 0.0, 0.5, 1e30], ids=lambda v: f"start{v:g}")
def test_amax_accumulates(amax_start, config):
    x = make_input((9, 31), torch.bfloat16, specials=False)
    run_cast_amax(x, E4M3, DELAYED_3_7, amax_start)
    run_cast_transpose_amax(x, E5M2, DELAYED_1, 16, amax_start)
    for t in (x, x[:, 2:29], x.view(3, 3, 31)):
        got, want = torch.tensor(amax_start), torch.tensor(amax_start)
        cast.amax(t, got)
        reference.amax(t, want)
        assert_bits_equal(got, want, "amax")


@pytest.mark.parametrize("special", [math.nan, -math.nan, math.inf, -math.inf], ids=["nan", "-nan", "inf", "-inf"])
def test_amax_of_nonfinite_is_inf(special, config):
    x = make_input((4, 50), torch.bfloat16, specials=False)
    x[2, 41] = special
    got = torch.tensor(scaling.UNRECORDED)
    cast.amax(x, got)
    assert got.item() == math.inf
    run_cast_amax(x, E4M3, CURRENT)
    run_cast_transpose_amax(x, E5M2, DELAYED_1, 16)


@pytest.mark.parametrize("from_amax", [0.0, 1e-40, 3e38, math.inf, math.nan, 2.5],
                         ids=["zero", "subnormal", "huge", "inf", "nan", "normal"])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_current_scaling_edge_amaxes(from_amax, fp8_dtype, pow2, config):
    """amax 0 / inf / NaN keep the old scale (inf / NaN count once); subnormal clamps to 2**126;
    pow2 (the flat and the tile kernel's POW2): the computed scale rounded down to a power of two."""
    x = make_input((6, 40), torch.bfloat16)  # subnormals included: 2**126 brings them into range
    _, s = run_cast_amax(x, fp8_dtype, ("current", from_amax), power_of_two=pow2)
    run_cast_transpose_amax(x, fp8_dtype, ("current", from_amax), 16, power_of_two=pow2)
    if pow2 and 0 < from_amax < math.inf:
        assert math.frexp(s.scale.item())[0] == 0.5 and s.scale_inv.item() == 1 / s.scale.item()


@pytest.mark.parametrize("rows_case", ["x", "x-pow2", "inf", "nan", "zero", "subnormal", "long"])
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "tile"])
def test_cast_from_rows_amax(rows_case, transpose, config):
    """launch_cast with rows_amax (traced code's per-row amaxes): every program reduces the
    vector, program 0 stores its max into from_amax, then current scaling's cast; against the
    twin, from_amax <- reference.abs_max(rows_amax) and the reference cast. NaN in the vector
    counts as +inf (keeps the old scale, counted once); "long": more entries than one load
    step of the reduction (_ROWS_BLOCK) with a tail."""
    m, n = (1100, 8) if rows_case == "long" else (37, 24)
    pow2 = rows_case == "x-pow2"
    x = make_input((m, n), torch.bfloat16, specials=False)  # finite: the special amaxes come from rows_case
    a = x.float().abs()
    rows = torch.where(a.isnan(), math.inf, a).amax(dim=1)
    special = {"inf": math.inf, "nan": math.nan, "subnormal": 1e-40}.get(rows_case)
    if rows_case == "zero":
        rows.zero_()
    elif special is not None:
        rows.zero_()[m // 2] = special
    s_kernel = Scalars.make(x, ("current", 7.0), amax_start=None)
    s_ref = s_kernel.clone()
    mp = m + 5 if transpose else None
    out, want = poisoned((m, n), E4M3), torch.empty((m, n), dtype=E4M3)
    out_t, want_t = (poisoned((n, mp), E4M3), poisoned((n, mp), E4M3)) if transpose else (None, None)
    cast.launch_cast(x, out, out_t, *s_kernel.args(), power_of_two=pow2, rows_amax=rows)
    s_ref.from_amax.copy_(reference.abs_max(rows))
    if transpose:
        reference.cast_transpose_amax(x, want, want_t, *s_ref.args(), power_of_two=pow2)
        assert_fp8_equal(out_t, want_t, "transposed copy")
    else:
        reference.cast_amax(x, want, *s_ref.args(), power_of_two=pow2)
    assert_fp8_equal(out, want)
    s_kernel.assert_equal(s_ref)
    assert s_kernel.from_amax.item() == (math.inf if rows_case == "nan" else rows.max().item())
    assert s_kernel.count.item() == 5 + (rows_case in ("inf", "nan"))


def test_special_values_only(config):
    x = torch.tensor([[math.nan, -math.nan, math.inf, -math.inf], [-0.0, 0.0, 1e-45, -449.0]], dtype=torch.float32)
    for fp8_dtype in (E4M3, E5M2):
        for mode in (DELAYED_1, DELAYED_HUGE, CURRENT):
            run_cast_amax(x, fp8_dtype, mode)
            run_cast_transpose_amax(x, fp8_dtype, mode, 16)


def test_empty_inputs_touch_only_scalars(config):
    x = torch.empty((0, 24), dtype=torch.bfloat16)
    run_cast_amax(x, E4M3, CURRENT)
    run_cast_transpose_amax(x, E4M3, DELAYED_3_7, 16)  # the whole out_t is padding: zeros
    got, want = torch.tensor(-1.0), torch.tensor(-1.0)
    cast.amax(x, got)
    reference.amax(x, want)
    assert_bits_equal(got, want, "amax")


def test_rejects_bad_arguments():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    scale, inv = torch.tensor(1.0), torch.tensor(1.0)
    out = torch.empty(8, 16, dtype=E4M3)
    with pytest.raises(ValueError, match="x must be"):
        cast.cast_amax(x.double(), out, scale, inv)
    with pytest.raises(ValueError, match="out must be float8"):
        cast.cast_amax(x, torch.empty(8, 16), scale, inv)
    with pytest.raises(ValueError, match="contiguous"):
        cast.cast_amax(x, torch.empty(16, 8, dtype=E4M3).t(), scale, inv)
    with pytest.raises(ValueError, match="unit stride"):
        cast.cast_amax(x.t(), torch.empty(16, 8, dtype=E4M3), scale, inv)
    with pytest.raises(ValueError, match="scale must be"):
        cast.cast_amax(x, out, scale.double(), inv)
    with pytest.raises(ValueError, match="out_t must be"):
        cast.cast_transpose_amax(x, out, torch.empty(16, 7, dtype=E4M3), scale, inv)
    with pytest.raises(ValueError, match="share an FP8 dtype"):
        cast.cast_transpose_amax(x, out, torch.empty(16, 8, dtype=E5M2), scale, inv)
    with pytest.raises(ValueError, match="different buffers"):
        a = torch.tensor(1.0)
        cast.cast_amax(x, out, scale, inv, amax_out=a, from_amax=a)
    with pytest.raises(ValueError, match="nonfinite_count"):
        cast.cast_amax(x, out, scale, inv, from_amax=torch.tensor(1.0), nonfinite_count=torch.tensor(0))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("x_dtype", INPUT_DTYPES)
def test_interpreter_conversion_within_one_ulp(fp8_dtype, x_dtype):
    """With the interpreter's own conversion: one fp8 ulp (or its known lost carry) off at most."""
    x = make_input((33, 70), x_dtype, specials=False)
    scale = torch.tensor(3.7)
    out, out_t = poisoned((33, 70), fp8_dtype), poisoned((70, 48), fp8_dtype)
    want = torch.empty((33, 70), dtype=fp8_dtype)
    cast.cast_transpose_amax(x, out, out_t, scale, torch.tensor(0.0))
    reference.cast_amax(x, want, scale.clone(), torch.tensor(0.0))
    mantissa_bits = 3 if fp8_dtype == E4M3 else 2
    g, w = out.view(torch.uint8).int(), want.view(torch.uint8).int()
    order = lambda b: torch.where(b >= 0x80, -(b & 0x7F), b & 0x7F)  # neighbours differ by 1; +0 ~ -0
    one_ulp = (order(g) - order(w)).abs() <= 1
    lost_carry = ((w & ((1 << mantissa_bits) - 1)) == 0) & (g == w - (1 << mantissa_bits))
    normal_range = (x.float() * scale).abs() >= torch.finfo(fp8_dtype).tiny  # it garbles subnormal results
    assert (one_ulp | lost_carry | ~normal_range).all()
    assert (g == w)[normal_range].float().mean() > 0.9
    assert_bits_equal(out_t[:, :33], out.t(), "out_t[:, :M] vs out.T")
    assert not out_t[:, 33:].view(torch.uint8).any()


# --------------------------------------------------------------------------- scale update


def make_quantizer_state(num: int, length: int):
    """Histories with recorded / unrecorded / inf / NaN / -0 pending entries and odd past entries."""
    histories, scales, counts, maxes = [], [], [], []
    pending_kinds = [1.5, scaling.UNRECORDED, math.inf, math.nan, -0.0, 0.0, 1e-41, 3e38, -math.inf]
    for i in range(num):
        h = torch.exp(torch.randn(length) * 4)
        h[torch.rand(length) < 0.2] = scaling.UNRECORDED
        if length > 2 and i % 5 == 4:
            h[1 + i % (length - 1)] = [math.nan, math.inf][i % 2]  # a past entry that should never be there
        if i < len(pending_kinds):
            h[0] = pending_kinds[i]
        histories.append(h)
        scales.append(torch.exp(torch.randn(())))
        counts.append(torch.randint(0, 9, (), dtype=torch.int32))
        maxes.append(448.0 if i % 3 else 57344.0)
    return histories, scales, counts, maxes


@pytest.mark.parametrize("length", [1, 5, 16, 40])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_scale_update_matches_reference(length, algo, margin, pow2):
    histories, scales, counts, maxes = make_quantizer_state(13, length)
    ref = [[t.clone() for t in ts] for ts in (histories, scales, counts)]
    launch = ScaleUpdateLaunch(histories, scales, counts, maxes, algo, margin, pow2)
    for step in range(3):
        launch()
        reference.scale_update(*ref, maxes, algo, margin, pow2)
        for name, got, want in zip(("history", "scale", "count"), (histories, scales, counts), ref):
            for i, (g, w) in enumerate(zip(got, want)):
                assert_bits_equal(g, w, f"step {step} quantizer {i} {name}")
        for h, h_ref in zip(histories, ref[0]):  # record a new amax (or an overflow) for the next step
            h[0] = h_ref[0] = torch.exp(torch.randn(())) if step % 2 == 0 else math.inf


def test_scale_update_rejects_bad_buffers():
    h, s, c = [torch.zeros(4)], [torch.ones(())], [torch.zeros((), dtype=torch.int32)]
    with pytest.raises(ValueError, match="amax_compute_algo"):
        ScaleUpdateLaunch(h, s, c, [448.0], "mean", 0)
    with pytest.raises(ValueError, match="counts"):
        ScaleUpdateLaunch(h, s, [torch.zeros(())], [448.0], "max", 0)
    with pytest.raises(ValueError, match="histories"):
        ScaleUpdateLaunch(h + [torch.zeros(5)], s + [s[0].clone()], c + [c[0].clone()], [448.0] * 2, "max", 0)
    with pytest.raises(ValueError, match="share a buffer"):
        ScaleUpdateLaunch(h + [torch.zeros(4)], s + [s[0].clone()], c * 2, [448.0] * 2, "max", 0)
    with pytest.raises(ValueError):
        ScaleUpdateLaunch(h, s, c, [100.0], "max", 0)
