"""Block-scaled FP8 casts (kernels/block_reference.py) against an independent reference
(numpy float32 for the per-block scale, ml_dtypes for the rounding), bit for bit, and the
block-scaled GEMM emulation (gemm.emulated_block_scaled_mm) against float64."""
import numpy as np
import pytest
import torch

from fp8train import gemm
from fp8train.kernels import block_reference as br
from helpers import all_bf16_values
from numpy_block_cast import FORMATS, numpy_block_cast

BLOCKS = [pytest.param(b, id=f"{b[0]}x{b[1]}") for b in br.BLOCKS]


def assert_same_fp8(ours: torch.Tensor, ref: np.ndarray, dtype) -> None:
    """Bytes equal; a NaN may use another NaN encoding (ml_dtypes' e5m2 NaN is 0x7E), same sign."""
    o = ours.view(torch.uint8).numpy()
    nan_o = np.isnan(o.view(FORMATS[dtype]).astype(np.float32))
    nan_r = np.isnan(ref.view(FORMATS[dtype]).astype(np.float32))
    assert np.array_equal(nan_o, nan_r)
    assert np.array_equal(o[~nan_o], ref[~nan_r])
    assert np.array_equal(o[nan_o] >> 7, ref[nan_r] >> 7)


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("order", ["by-pattern", "shuffled"])
def test_all_bf16_patterns_in_odd_shapes_match_the_independent_reference(order, block, dtype, power_of_two):
    # Every bf16 bit pattern once: in pattern order (a block holds neighbouring magnitudes, so
    # scales span the whole range) or the finite ones shuffled (blocks mix magnitudes and
    # flush their small values); NaN and inf gathered at the end (a block holding one has
    # scale 1); in a shape whose dims are not multiples of 128 (tail blocks both ways).
    v = all_bf16_values()
    finite = v[torch.isfinite(v)]
    if order == "shuffled":
        finite = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))]
    x = torch.cat([finite, v[~torch.isfinite(v)]])
    x = torch.cat([x, torch.zeros(259 * 255 - x.numel(), dtype=x.dtype)]).reshape(259, 255)
    data, scale_inv = br.block_cast(x, dtype, block, power_of_two)
    want, want_si = numpy_block_cast(x, dtype, block, power_of_two)
    assert data.dtype == dtype and data.shape == x.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == br.blocks_of(x.shape, block)
    assert np.array_equal(scale_inv.numpy(), want_si)
    assert_same_fp8(data, want, dtype)


@pytest.mark.parametrize("block", BLOCKS)
def test_special_blocks(block):
    # a zero block, a block with a NaN, a block with an inf: scale 1 (NaN kept, inf saturated);
    # a tiny block (amax 2^-130, subnormal): the scale is clamped at 2^126
    x = torch.zeros(256, 256)
    x[:128, :128] = 0.0
    x[:128, 128:] = torch.randn(128, 128)
    x[0, 130] = float("nan")
    x[128:, :128] = torch.randn(128, 128)
    x[129, 1] = float("inf")
    x[128:, 128:] = 2.0**-130
    data, scale_inv = br.block_cast(x, torch.float8_e4m3fn, block)
    si = br.expand(scale_inv, x.shape, block)
    assert torch.isnan(data[0, 130].float()) and si[0, 130] == 1.0
    assert data[129, 1].float() == 448.0 and si[129, 1] == 1.0
    assert (data[:128, :128].float() == 0).all() and si[0, 0] == 1.0
    assert si[255, 255] == 2.0**-126  # 1 / 2^126
    assert (data[128:, 128:].float() * 2.0**-126 == 2.0**-130).all()  # 2^-130 * 2^126 = 2^-4: exact in e4m3


@pytest.mark.parametrize("block", BLOCKS)
def test_power_of_two_scales_are_exact_powers_and_lose_no_range(block):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 260, generator=g) * torch.logspace(-8, 8, 260)
    data, scale_inv = br.block_cast(x, torch.float8_e4m3fn, block, power_of_two=True)
    mant, _ = torch.frexp(scale_inv)
    assert (mant == 0.5).all()  # powers of two
    amax = br.block_amax(x, block)
    assert (amax / scale_inv <= 448).all() and (amax / scale_inv > 224).all()  # within a factor 2 of the top
    back = br.block_dequantize(data, scale_inv, block)
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[x.abs() * br.expand(1 / scale_inv, x.shape, block) >= 2**-6]
    assert rel.max() <= 2.0**-4  # e4m3: half an ulp of 3 mantissa bits, normal values


def test_block_cast_refuses_what_it_does_not_define():
    with pytest.raises(ValueError, match="2-D"):
        br.block_cast(torch.zeros(2, 3, 128), torch.float8_e4m3fn, (1, 128))
    with pytest.raises(ValueError, match="block must be one of"):
        br.block_cast(torch.zeros(4, 128), torch.float8_e4m3fn, (1, 64))


@pytest.mark.parametrize("a_block, b_block", [((1, 128), (128, 128)), ((1, 128), (128, 1)), ((128, 128), (128, 1))])
@pytest.mark.parametrize("k", [128, 384, 300])
def test_block_scaled_gemm_emulation_against_float64(a_block, b_block, k):
    # y = sum over 128-wide slices of K of (slice products) x (a's and b's slice scales):
    # against the float64 product of the dequantized operands, within float32 summation's
    # bound (K roundings of the slice sums, one per slice for the scaling and the accumulation)
    g = torch.Generator().manual_seed(k)
    m, n = 70, 200
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
    w = torch.randn(k, n, generator=g)
    a, sa = br.block_cast(x, torch.float8_e4m3fn, a_block)
    # b (K, N): blocks of (128, 1) are W's columns cut along K; (128, 128) tiles
    bt, sbt = br.block_cast(w.t().contiguous(), torch.float8_e4m3fn, (b_block[1], b_block[0]))
    b, sb = bt.t(), sbt.t()
    y = gemm.emulated_block_scaled_mm(a, sa, a_block, b, sb, b_block, torch.float32)
    da = br.block_dequantize(a, sa, a_block).double()
    db = br.block_dequantize(bt, sbt, (b_block[1], b_block[0])).double().t()
    exact = da @ db
    slices = -(-k // 128)
    bound = (k + 2 * slices + 2) * 2.0**-24 * (da.abs() @ db.abs())
    assert ((y.double() - exact).abs() <= bound).all()
    # bf16 output: the float32 total rounded once
    y16 = gemm.emulated_block_scaled_mm(a, sa, a_block, b, sb, b_block, torch.bfloat16)
    assert torch.equal(y16, y.to(torch.bfloat16))


def test_block_scaled_gemm_emulation_checks_its_operands():
    a = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    b = torch.zeros(256, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="blocks"):
        gemm.emulated_block_scaled_mm(a, torch.ones(4, 2), (1, 64), b, torch.ones(2, 8), (128, 1), torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        gemm.emulated_block_scaled_mm(a, torch.ones(4, 3), (1, 128), b, torch.ones(2, 8), (128, 1), torch.float32)


def test_kernels_block_cast_on_the_cpu_is_the_twin():
    from fp8train import kernels
    x = torch.randn(130, 257) * 100
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(br.blocks_of(x.shape, (1, 128)))
    kernels.block_cast(x, out, scale_inv, (1, 128), power_of_two=True)
    data, si = br.block_cast(x, torch.float8_e4m3fn, (1, 128), power_of_two=True)
    assert torch.equal(out.view(torch.uint8), data.view(torch.uint8)) and torch.equal(scale_inv, si)



def test_no_kernel_module_shadows_a_dispatcher():
    # Importing a submodule binds its name on the package: a module named like one of
    # fp8train.kernels' functions (block_cast.py once did) replaced the function by the module
    # for every later caller, on the GPU only (where the dispatcher imports the Triton module).
    import importlib
    import pkgutil
    from fp8train import kernels
    public = {name for name, v in vars(kernels).items() if callable(v) and not isinstance(v, type(kernels))}
    for info in pkgutil.iter_modules(kernels.__path__):
        assert info.name not in public, f"fp8train/kernels/{info.name}.py shadows kernels.{info.name}()"
    importlib.import_module("fp8train.kernels.block_kernel")
    assert callable(kernels.block_cast)


@pytest.mark.parametrize("nb, kb", [(3, 8), (5, 6), (2, 22), (1, 1)])
def test_tile_scales_are_the_gemms_padded_layout(nb, kb):
    # (round_up(Kb, 4), Nb) with strides (1, rows), the padding 1; a view (no copy) where the
    # tiles' scales are already laid out so: contiguous with Kb a multiple of 4
    s = torch.rand(nb, kb) + 0.5
    got = gemm.tile_scales(s)
    kb4 = -(-kb // 4) * 4
    assert got.shape == (kb4, nb) and got.stride() == (1, kb4)
    assert torch.equal(got[:kb], s.t()) and bool((got[kb:] == 1).all())
    assert (got.data_ptr() == s.data_ptr()) == (kb % 4 == 0)
    assert gemm.tile_scales(s.t().contiguous().t()).stride() == (1, kb4)  # a column-major s is copied


def test_tile_scales_read_a_padded_buffer_in_place_only_where_it_is_there():
    # the first Kb columns of an (Nb, round_up(Kb, 4)) buffer: a view over its padding
    buf = torch.full((5, 4), 7.0)
    buf[:, :3] = torch.rand(5, 3) + 0.5
    got = gemm.tile_scales(buf[:, :3])
    assert got.data_ptr() == buf.data_ptr() and got.stride() == (1, 4) and torch.equal(got, buf.t())
    # the same strides over storage that ends before the last row's padding: a padded copy
    short = torch.rand(5 * 4 - 1).as_strided((5, 3), (4, 1))
    got = gemm.tile_scales(short)
    assert got.data_ptr() != short.data_ptr() and torch.equal(got[:3], short.t()) and bool((got[3] == 1).all())
