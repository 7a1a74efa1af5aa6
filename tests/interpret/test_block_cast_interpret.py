"""The block-scaled cast kernels (kernels/block_kernel.py) under the Triton interpreter against
their twin (kernels/block_reference.py), bit for bit: payload, every block's scale_inv, the
one-read kernel's transposed copy and its zero padding, tails in both dims, NaN / inf / zero blocks, power-of-two scales, strided rows. The fp32 -> fp8
conversion is swapped for an exact one (conftest `exact_conversions`: the interpreter's own
rounds wrongly; it writes e5m2 NaN as ml_dtypes does, 0x7E, so NaN bytes are compared as
NaN); the hardware's conversion is the GPU tests' to check."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from fp8train import kernels  # noqa: E402
from fp8train.kernels import block_kernel  # noqa: E402
from fp8train.kernels import block_reference as br  # noqa: E402
from fp8train.kernels.block_kernel import block_cast_both_into, block_cast_into, weight_tiles_into  # noqa: E402

BLOCKS = [pytest.param(b, id=f"{b[0]}x{b[1]}") for b in br.BLOCKS]


def assert_fp8_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bytewise, except that any NaN encoding matches any other."""
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def _scale_buffer(shape, column_major: bool) -> torch.Tensor:
    """A -1-filled float32 scale_inv buffer, column-major as the layers' 1 x 128 scales are."""
    return torch.full(shape[::-1], -1.0).t() if column_major else torch.full(shape, -1.0)


def _input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-20, 20, shape[1])  # blocks of very different amax
    x[0, 3] = float("nan")
    x[min(shape[0] - 1, 130), 0] = float("inf")
    x[:, -5:] = 0.0  # zero columns: a zero block where a block is one column wide
    return x.to(dtype)


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("block", BLOCKS)
def test_block_cast_kernel_matches_the_twin(block, dtype, fp8, power_of_two, exact_conversions):
    x = _input((200, 300), dtype, seed=7)  # tails: 200 = 128 + 72 rows, 300 = 2 x 128 + 44 columns
    out = torch.empty(x.shape, dtype=fp8)
    scale_inv = _scale_buffer(br.blocks_of(x.shape, block), column_major=block == (1, 128))
    block_cast_into(x, out, scale_inv, block, power_of_two)
    want, want_si = br.block_cast(x, fp8, block, power_of_two)
    assert torch.equal(scale_inv, want_si)
    assert_fp8_equal(out, want)


# traced: the launch a torch.library.triton_op's body makes (block_quantizer's fp8train::block_cast),
# through wrap_triton, which runs it as Triton's `kernel[grid]` outside a trace
TRACED = pytest.mark.parametrize("traced", [False, True], ids=["direct", "wrap_triton"])


@TRACED
@pytest.mark.parametrize("block", BLOCKS)
def test_block_cast_kernel_reads_strided_rows(block, traced, exact_conversions):
    base = _input((150, 400), torch.bfloat16, seed=3)
    x = base[:, 50:350]  # row stride 400, 300 columns
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale_inv = _scale_buffer(br.blocks_of(x.shape, block), column_major=False)  # row-major too
    block_cast_into(x, out, scale_inv, block, traced=traced)
    want, want_si = br.block_cast(x, torch.float8_e4m3fn, block)
    assert torch.equal(scale_inv, want_si)
    assert_fp8_equal(out, want)


def test_block_cast_into_checks_its_buffers():
    x = torch.zeros(64, 256)
    with pytest.raises(ValueError, match="scale_inv_out must be"):
        block_cast_into(x, torch.empty(64, 256, dtype=torch.float8_e4m3fn), torch.empty(64, 1), (1, 128))
    with pytest.raises(ValueError, match="out must be"):
        block_cast_into(x, torch.empty(64, 255, dtype=torch.float8_e4m3fn), torch.empty(64, 2), (1, 128))
    with pytest.raises(ValueError, match="block one of"):
        block_cast_into(x, torch.empty(64, 256, dtype=torch.float8_e4m3fn), torch.empty(64, 2), (1, 64))


def _both_twin(x, fp8, power_of_two=False):
    """kernels.block_cast_both's twin (CPU tensors: two block_reference casts and a byte
    transpose); x a tensor or its column-stacked parts."""
    m, k = x.shape if isinstance(x, torch.Tensor) else (x[0].shape[0], sum(p.shape[1] for p in x))
    data, data_t = torch.empty((m, k), dtype=fp8), torch.empty((k, -(-m // 128) * 128), dtype=fp8)
    si, si_t = torch.empty(br.blocks_of((m, k), (1, 128))), torch.empty(br.blocks_of((m, k), (128, 1)))
    kernels.block_cast_both(x, data, data_t, si, si_t, power_of_two)
    return data, si, data_t, si_t


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape, dtype", [((200, 300), torch.bfloat16), ((128, 256), torch.float32),
                                          ((37, 144), torch.bfloat16), ((200, 300), torch.float16)],
                         ids=["tails-bf16", "whole-fp32", "short-bf16", "tails-fp16"])
def test_block_cast_both_kernel_matches_the_twin(shape, dtype, fp8, power_of_two, exact_conversions):
    # both casts in one kernel: tails in both dims (200 x 300), whole blocks (128 x 256),
    # fewer rows than a block (37: 91 padding columns in the transposed copy)
    _check_both(shape, dtype, fp8, power_of_two)


def _check_both(shape, dtype, fp8, power_of_two):
    x = _input(shape, dtype, seed=11)
    m, k = shape
    out, out_t = torch.empty(shape, dtype=fp8), torch.full((k, -(-m // 128) * 128), 0x55, dtype=torch.uint8).view(fp8)
    si = _scale_buffer(br.blocks_of(shape, (1, 128)), column_major=True)
    si_t = torch.full(br.blocks_of(shape, (128, 1)), -1.0)
    block_cast_both_into(x, out, out_t, si, si_t, power_of_two)
    want, want_si, want_t, want_si_t = _both_twin(x, fp8, power_of_two)
    assert torch.equal(si, want_si) and torch.equal(si_t, want_si_t)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t, want_t)  # the padding bytes (0x55 before) are zero


@TRACED
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_block_cast_both_kernel_unmasked_matches_the_twin(dtype, fp8, traced, unmasked, exact_conversions):
    # whole tiles (256 x 384) under BlockShapes.even: the kernel without masks, whole and as
    # column-stacked parts
    _check_both_whole_and_in_parts(_input((256, 384), dtype, seed=12), fp8, traced)


def _check_both_whole_and_in_parts(x, fp8, traced):
    """block_cast_both_into of x, and of x as two column-stacked parts, against the twin."""
    m, k = x.shape
    want, want_si, want_t, want_si_t = _both_twin(x, fp8)
    for source in (x, [x[:, :128].contiguous(), x[:, 128:]]):
        out, out_t = torch.empty(x.shape, dtype=fp8), torch.full((k, -(-m // 128) * 128), 0x55, dtype=torch.uint8)
        si = _scale_buffer(br.blocks_of(x.shape, (1, 128)), column_major=True)
        si_t = torch.full(br.blocks_of(x.shape, (128, 1)), -1.0)
        block_cast_both_into(source, out, out_t.view(fp8), si, si_t, traced=traced)
        assert torch.equal(si, want_si) and torch.equal(si_t, want_si_t)
        assert_fp8_equal(out, want)
        assert_fp8_equal(out_t.view(fp8), want_t)  # the padding bytes (0x55 before) are zero


@TRACED
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape, dtype", [((200, 300), torch.bfloat16), ((256, 384), torch.float32),
                                          ((37, 144), torch.bfloat16)], ids=["tails-bf16", "whole-fp32", "short-bf16"])
def test_block_cast_both_kernel_packed_matches_the_twin(shape, dtype, fp8, traced, packed, exact_conversions):
    # BlockShapes.packed_t: the tile's rows loaded permuted and the transposed copy stored a
    # word of four rows at a time; tails, padding rows, whole tiles, and column-stacked parts
    _check_both_whole_and_in_parts(_input(shape, dtype, seed=13), fp8, traced)


def test_block_cast_both_kernel_packed_needs_a_word_aligned_transposed_copy(packed, exact_conversions):
    # a transposed copy that starts off a 4-byte boundary takes the byte-wise form
    x = _input((200, 300), torch.bfloat16, seed=14)
    fp8 = torch.float8_e4m3fn
    buffer = torch.full((300 * 256 + 1,), 0x55, dtype=torch.uint8)
    out, out_t = torch.empty(x.shape, dtype=fp8), buffer[1:].view(300, 256).view(fp8)
    si, si_t = _scale_buffer(br.blocks_of(x.shape, (1, 128)), column_major=True), torch.full((2, 300), -1.0)
    block_cast_both_into(x, out, out_t, si, si_t)
    want, want_si, want_t, want_si_t = _both_twin(x, fp8)
    assert torch.equal(si, want_si) and torch.equal(si_t, want_si_t)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t, want_t)
    assert buffer[0] == 0x55


@TRACED
def test_block_cast_both_kernel_reads_strided_rows(traced, exact_conversions):
    x = _input((150, 400), torch.bfloat16, seed=5)[:, 50:350]  # row stride 400, 300 columns
    out, out_t = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(300, 256, dtype=torch.float8_e4m3fn)
    si, si_t = torch.empty(br.blocks_of(x.shape, (1, 128))), torch.empty(br.blocks_of(x.shape, (128, 1)))
    block_cast_both_into(x, out, out_t, si, si_t, traced=traced)
    want, want_si, want_t, want_si_t = _both_twin(x, torch.float8_e4m3fn)
    assert torch.equal(si, want_si) and torch.equal(si_t, want_si_t)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t, want_t)


@TRACED
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cols", [(256, 128, 77), (128, 300), (300,)], ids=["three", "two", "one"])
def test_block_cast_both_kernel_reads_column_stacked_parts(cols, dtype, traced, exact_conversions):
    """A stacked tie's output gradient given as its members' parts (modules/stacked.py): each
    tile read from the part that holds it, one part a strided view, the outputs those of the
    parts' concatenation, bit for bit."""
    m = 200  # a tail of 72 rows
    parts = [_input((m, n + 40), dtype, seed=30 + i)[:, 40:] for i, n in enumerate(cols)]  # row stride n + 40
    x = torch.cat(parts, dim=1)
    k, mp = x.shape[1], 256
    out, out_t = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.full((k, mp), 0x55, dtype=torch.uint8)
    si = _scale_buffer(br.blocks_of(x.shape, (1, 128)), column_major=True)
    si_t = torch.full(br.blocks_of(x.shape, (128, 1)), -1.0)
    block_cast_both_into(parts, out, out_t.view(torch.float8_e4m3fn), si, si_t, traced=traced)
    want, want_si, want_t, want_si_t = _both_twin(x, torch.float8_e4m3fn)
    assert torch.equal(si, want_si) and torch.equal(si_t, want_si_t)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t.view(torch.float8_e4m3fn), want_t)
    # kernels.block_cast_both's twin takes the parts too (their concatenation)
    twin = _both_twin(parts, torch.float8_e4m3fn)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
               for a, b in zip(twin, (want, want_si, want_t, want_si_t)))


@TRACED
@pytest.mark.parametrize("even", [False, True], ids=["masked", "even"])
@pytest.mark.parametrize("cols", [(256, 128, 128), (128, 300), (300,)], ids=["three", "two", "one"])
def test_block_cast_both_kernel_without_the_transposed_copy(cols, even, traced, exact_conversions):
    """out_t and scale_inv_t_out None (COLS 0): the 1 x 128 cast of the parts' concatenation
    alone, bit for bit the twin's, one part strided; whole tiles (256 rows, every width a
    multiple of 128) launch the unmasked form where the shapes ask for it."""
    m = 256 if even else 200
    parts = [_input((m, n + 40), torch.bfloat16, seed=50 + i)[:, 40:] for i, n in enumerate(cols)]
    x = torch.cat(parts, dim=1)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    si = _scale_buffer(br.blocks_of(x.shape, (1, 128)), column_major=True)
    shapes = block_kernel.BlockShapes(even=True) if even else block_kernel.BlockShapes()
    with block_kernel.override_shapes(shapes):
        block_cast_both_into(parts, out, None, si, None, traced=traced)
    want, want_si = br.block_cast(x, torch.float8_e4m3fn, (1, 128))
    assert torch.equal(si, want_si)
    assert_fp8_equal(out, want)
    # the twin (kernels.block_cast_both off CUDA) likewise, from the parts
    out2, si2 = torch.empty_like(out), _scale_buffer(si.shape, column_major=True)
    kernels.block_cast_both(parts, out2, None, si2, None)
    assert torch.equal(si2, want_si)
    assert_fp8_equal(out2, want)


def test_block_cast_both_into_checks_its_parts():
    out, out_t = torch.empty(64, 300, dtype=torch.float8_e4m3fn), torch.empty(300, 128, dtype=torch.float8_e4m3fn)
    si, si_t = torch.empty(64, 3), torch.empty(1, 300)
    with pytest.raises(ValueError, match="multiple of 128 columns"):
        block_cast_both_into([torch.zeros(64, 100), torch.zeros(64, 200)], out, out_t, si, si_t)
    with pytest.raises(ValueError, match="share their row count"):
        block_cast_both_into([torch.zeros(64, 128), torch.zeros(32, 172)], out, out_t, si, si_t)
    with pytest.raises(ValueError, match="1 to 3"):
        block_cast_both_into([torch.zeros(64, 128)] * 4, out, out_t, si, si_t)


def test_block_cast_both_into_checks_its_buffers():
    x, e4m3 = torch.zeros(64, 256), torch.float8_e4m3fn
    out, si, si_t = torch.empty(64, 256, dtype=e4m3), torch.empty(64, 2), torch.empty(1, 256)
    with pytest.raises(ValueError, match="out_t must be"):
        block_cast_both_into(x, out, torch.empty(256, 64, dtype=e4m3), si, si_t)  # not padded to 128
    with pytest.raises(ValueError, match="scale_inv_t_out must be"):
        block_cast_both_into(x, out, torch.empty(256, 128, dtype=e4m3), si, torch.empty(256, 1))
    with pytest.raises(ValueError, match="scale_inv_t_out must be"):  # one of the two given
        block_cast_both_into(x, out, torch.empty(256, 128, dtype=e4m3), si, None)
    with pytest.raises(ValueError, match="out_t must be"):
        block_cast_both_into(x, out, None, si, si_t)


def _weight_want(x, fp8, power_of_two, mp):
    """The weight tiles' outputs from the twin: its 128 x 128 cast, the payload transposed by
    torch with zero columns M..mp, both scale grids padded with 1 to a multiple of 4 columns."""
    data, si = br.block_cast(x, fp8, (128, 128), power_of_two)
    mb, kb = si.shape
    scales, scales_t = torch.ones(mb, -(-kb // 4) * 4), torch.ones(kb, -(-mb // 4) * 4)
    scales[:, :kb], scales_t[:, :mb] = si, si.t()
    data_t = torch.zeros(x.shape[1], mp, dtype=torch.uint8)
    data_t[:, :x.shape[0]] = data.view(torch.uint8).t()
    return data, scales, data_t.view(fp8), scales_t


@TRACED
@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape, dtype", [((200, 300), torch.bfloat16), ((512, 640), torch.float32),
                                          ((37, 1000), torch.float32)], ids=["tails-bf16", "whole-fp32", "short-fp32"])
def test_weight_tiles_kernel_matches_the_twin(shape, dtype, fp8, power_of_two, traced, exact_conversions):
    # 200 x 300: Mb 2, Kb 3 (both grids padded); 512 x 640: Mb 4, Kb 5; 37 x 1000: Mb 1, Kb 8
    # (no padding in scales, 3 in scales_t; Mp 48: 11 zero columns in out_t)
    x = _input(shape, dtype, seed=13)
    m, k = shape
    mp = -(-m // 16) * 16
    want, want_s, want_t, want_s_t = _weight_want(x, fp8, power_of_two, mp)
    out, out_t = torch.empty(shape, dtype=fp8), torch.full((k, mp), 0x55, dtype=torch.uint8).view(fp8)
    scales, scales_t = torch.full(want_s.shape, -1.0), torch.full(want_s_t.shape, -1.0)
    weight_tiles_into(x, out, scales, out_t, scales_t, power_of_two, traced=traced)
    assert torch.equal(scales, want_s) and torch.equal(scales_t, want_s_t)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t, want_t)
    # without the transposed copy: the payload and padded scales alone, and the twin's dispatch agrees
    out2, scales2 = torch.empty(shape, dtype=fp8), torch.full(want_s.shape, -1.0)
    weight_tiles_into(x, out2, scales2, power_of_two=power_of_two, traced=traced)
    assert torch.equal(scales2, want_s)
    assert_fp8_equal(out2, want)


def test_weight_tiles_kernel_reads_strided_rows(exact_conversions):
    x = _input((150, 400), torch.bfloat16, seed=5)[:, 50:350]  # row stride 400
    want, want_s, want_t, want_s_t = _weight_want(x, torch.float8_e4m3fn, False, 160)
    out, out_t = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(300, 160, dtype=torch.float8_e4m3fn)
    scales, scales_t = torch.empty(want_s.shape), torch.empty(want_s_t.shape)
    weight_tiles_into(x, out, scales, out_t, scales_t)
    assert torch.equal(scales, want_s) and torch.equal(scales_t, want_s_t)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t, want_t)


@pytest.mark.parametrize("rows", [(128, 256, 77), (256, 128), (384,)], ids=["three", "two", "one"])
def test_weight_tiles_kernel_reads_row_stacked_parts(rows, exact_conversions):
    """A stacked weight given as its parts (modules/stacked.py): each tile read from the part
    that holds it, the outputs those of the parts' concatenation, bit for bit."""
    parts = [_input((n, 300), torch.float32, seed=20 + i) for i, n in enumerate(rows)]
    x = torch.cat(parts)
    mp = -(-x.shape[0] // 16) * 16
    want, want_s, want_t, want_s_t = _weight_want(x, torch.float8_e4m3fn, False, mp)
    out, out_t = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(300, mp, dtype=torch.float8_e4m3fn)
    scales, scales_t = torch.full(want_s.shape, -1.0), torch.full(want_s_t.shape, -1.0)
    weight_tiles_into(parts, out, scales, out_t, scales_t)
    assert torch.equal(scales, want_s) and torch.equal(scales_t, want_s_t)
    assert_fp8_equal(out, want)
    assert_fp8_equal(out_t, want_t)


def test_weight_tiles_into_checks_its_parts():
    out, scales = torch.empty(300, 300, dtype=torch.float8_e4m3fn), torch.empty(3, 4)
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        weight_tiles_into([torch.zeros(100, 300), torch.zeros(200, 300)], out, scales)
    with pytest.raises(ValueError, match="share their column count"):
        weight_tiles_into([torch.zeros(128, 300), torch.zeros(172, 200)], out, scales)
    with pytest.raises(ValueError, match="1 to 3"):
        weight_tiles_into([torch.zeros(128, 300)] * 4, out, scales)


def test_weight_tiles_into_checks_its_buffers():
    x, e4m3 = torch.zeros(200, 300), torch.float8_e4m3fn
    out, scales = torch.empty(200, 300, dtype=e4m3), torch.empty(2, 4)
    with pytest.raises(ValueError, match="scales must be"):
        weight_tiles_into(x, out, torch.empty(2, 3))  # Kb 3 not padded to 4
    with pytest.raises(ValueError, match="come together"):
        weight_tiles_into(x, out, scales, torch.empty(300, 208, dtype=e4m3))
    with pytest.raises(ValueError, match="out_t must be"):
        weight_tiles_into(x, out, scales, torch.empty(300, 200, dtype=e4m3), torch.empty(3, 4))  # 200 % 16
    with pytest.raises(ValueError, match="scales_t must be"):
        weight_tiles_into(x, out, scales, torch.empty(300, 208, dtype=e4m3), torch.empty(3, 2))
