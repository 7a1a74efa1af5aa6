"""The block-scaled cast kernels (kernels/block_kernel.py) on the GPU against their twin
(kernels/block_reference.py), bit for bit, with the hardware's fp8 conversion: every bf16
pattern in shapes with tails, and fresh random values whose float32 mantissas go past bf16's
(a float32 x holding bf16 values hid a wrong transposed copy: the one-launch weight kernel,
2026-12-02), with a column count that is a multiple of 16 and one that is not (Triton
compiles each apart); float32 and float16 inputs, both formats, power-of-two scales; the
one-read kernel (1 x 128 and transposed 128 x 1 casts) against the twin's composition; the
one-launch weight kernel against the twin's cast, byte transpose and padded scales."""
import dataclasses

import pytest
import torch

from fp8train import kernels
from fp8train.kernels import block_kernel
from fp8train.kernels import block_reference as br
from fp8train.tensor import padded_rows
from helpers import all_bf16_values

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BLOCKS = [pytest.param(b, id=f"{b[0]}x{b[1]}") for b in br.BLOCKS]
# tails in both dims, then whole tiles (the two-way cast's unmasked kernel, BlockShapes.even)
INPUTS = ["every-bf16", "random-259x255", "random-291x304", "random-256x384"]


def _every_bf16_pattern(dtype) -> torch.Tensor:
    """(259, 255) on CUDA: every bf16 bit pattern, then zeros; tails in both dims."""
    v = all_bf16_values()
    return torch.cat([v, torch.zeros(259 * 255 - v.numel(), dtype=v.dtype)]).reshape(259, 255).to(dtype).to(CUDA)


def _input(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """every-bf16, or random-MxK: fresh normal values over 12 decades of column magnitude
    (blocks with very different scales; a third of the rows 1000x smaller), then in dtype."""
    if kind == "every-bf16":
        return _every_bf16_pattern(dtype)
    m, k = (int(n) for n in kind.split("-")[1].split("x"))
    x = torch.randn(m, k) * torch.logspace(-6, 6, k)
    x[: m // 3] *= 1e-3
    return x.to(dtype).to(CUDA)


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("block", BLOCKS)
def test_block_cast_kernel_is_the_twin_on_the_gpu(block, kind, dtype, fp8, power_of_two):
    x = _input(kind, dtype)
    out = torch.empty(x.shape, dtype=fp8, device=CUDA)
    scale_inv = torch.full(br.blocks_of(x.shape, block), -1.0, device=CUDA)
    kernels.block_cast(x, out, scale_inv, block, power_of_two)
    want, want_si = br.block_cast(x, fp8, block, power_of_two)  # the twin, in torch's CUDA ops
    assert torch.equal(scale_inv, want_si)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def _cast_params(test):
    """Every input, input dtype, FP8 format and scale kind."""
    for name, values, ids in (("power_of_two", [False, True], ["scale", "pow2"]),
                              ("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ["e4m3", "e5m2"]),
                              ("dtype", [torch.bfloat16, torch.float16, torch.float32], ["bf16", "fp16", "fp32"]),
                              ("kind", INPUTS, None)):
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


@_cast_params
@pytest.mark.parametrize("parts", [1, 2], ids=["whole", "2-parts"])
def test_block_cast_both_kernel_is_the_twin_on_the_gpu(parts, kind, dtype, fp8, power_of_two):
    # parts: x given as column-stacked parts (a stacked tie's output gradients), each a copy
    # of its own (read where it lies), against the twin on x
    _check_both_kernel(parts, kind, dtype, fp8, power_of_two)


# the two-way cast's other forms (BlockShapes: no clamp, the conversion saturating alone; 8
# warps capped at 128 registers; whole tiles unmasked, and so at 8 warps without the clamp; the
# transposed copy packed in words by inline PTX): the twin's bytes too, every bf16 pattern's
# inf, NaN and values past the format's largest saturating in blocks whose scale is 1
BOTH_FORMS = [pytest.param({"both_clamp": False}, id="no-clamp"),
              pytest.param({"both": 8, "both_regs": 128, "both_clamp": False}, id="8-warps-128-regs-no-clamp"),
              pytest.param({"both": 8, "both_clamp": False, "even": True}, id="8-warps-no-clamp-unmasked"),
              pytest.param({"packed_t": True}, id="packed"),
              pytest.param({"both": 8, "both_clamp": False, "even": True, "packed_t": True},
                           id="8-warps-no-clamp-unmasked-packed")]


@_cast_params
@pytest.mark.parametrize("form", BOTH_FORMS)
def test_block_cast_both_forms_are_the_twin_on_the_gpu(form, kind, dtype, fp8, power_of_two):
    with block_kernel.override_shapes(dataclasses.replace(block_kernel.BlockShapes(), **form)):
        _check_both_kernel(1, kind, dtype, fp8, power_of_two)


def _check_both_kernel(parts, kind, dtype, fp8, power_of_two):
    x = _input(kind, dtype)
    m, k = x.shape
    source = x if parts == 1 else [p.clone() for p in x.split([128, k - 128], dim=1)]
    mp = -(-m // 128) * 128  # rows rounded up to 128: zero columns in the transposed copy
    out, out_t = torch.empty(x.shape, dtype=fp8, device=CUDA), torch.full((k, mp), 0x55, dtype=torch.uint8, device=CUDA)
    si = torch.full(br.blocks_of(x.shape, (1, 128)), -1.0, device=CUDA)
    si_t = torch.full(br.blocks_of(x.shape, (128, 1)), -1.0, device=CUDA)
    kernels.block_cast_both(source, out, out_t.view(fp8), si, si_t, power_of_two)
    want, want_si = br.block_cast(x, fp8, (1, 128), power_of_two)
    cols, want_si_t = br.block_cast(x, fp8, (128, 1), power_of_two)
    want_t = torch.zeros((k, mp), dtype=torch.uint8, device=CUDA)
    want_t[:, :m] = cols.view(torch.uint8).t()
    assert torch.equal(si, want_si) and torch.equal(si_t, want_si_t)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(out_t, want_t)


@pytest.mark.parametrize("form", [pytest.param({}, id="default"), pytest.param({"even": True}, id="unmasked")])
@pytest.mark.parametrize("parts", [1, 2], ids=["whole", "2-parts"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", INPUTS)
def test_block_cast_both_kernel_without_the_transposed_copy_on_the_gpu(kind, dtype, parts, form):
    # out_t and scale_inv_t_out None (the kernel's COLS 0: BlockScaling(fp8_wgrad=False)'s
    # stacked gradients): the 1 x 128 cast alone, the twin's bytes and scales
    x = _input(kind, dtype)
    k = x.shape[1]
    source = x if parts == 1 else [p.clone() for p in x.split([128, k - 128], dim=1)]
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=CUDA)
    si = torch.full(br.blocks_of(x.shape, (1, 128)), -1.0, device=CUDA)
    with block_kernel.override_shapes(dataclasses.replace(block_kernel.BlockShapes(), **form)):
        kernels.block_cast_both(source, out, None, si, None)
    want, want_si = br.block_cast(x, torch.float8_e4m3fn, (1, 128))
    assert torch.equal(si, want_si)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("parts", [1, 2, 3], ids=["whole", "2-parts", "3-parts"])
@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", INPUTS)
def test_weight_tiles_kernel_is_the_twin_on_the_gpu(kind, dtype, fp8, power_of_two, parts):
    # both scale grids padded with 1 to a multiple of 4 columns; the transposed copy's rows
    # padded to padded_rows(M) with zero bytes. parts: x given as row-stacked parts (a stacked
    # tie's weights), each a copy of its own (read where it lies), against the twin on x
    x = _input(kind, dtype)
    m, k = x.shape
    source = x if parts == 1 else [p.clone() for p in x.split([128] * (parts - 1) + [m - 128 * (parts - 1)])]
    mb, kb, mp = -(-m // 128), -(-k // 128), padded_rows(m)
    out = torch.empty(x.shape, dtype=fp8, device=CUDA)
    out_t = torch.full((k, mp), 0x55, dtype=torch.uint8, device=CUDA)
    scales = torch.full((mb, -(-kb // 4) * 4), -1.0, device=CUDA)
    scales_t = torch.full((kb, -(-mb // 4) * 4), -1.0, device=CUDA)
    kernels.weight_tiles(source, out, scales, out_t.view(fp8), scales_t, power_of_two)
    want, want_si = br.block_cast(x, fp8, (128, 128), power_of_two)
    want_s, want_s_t = torch.ones_like(scales), torch.ones_like(scales_t)
    want_s[:, :kb], want_s_t[:, :mb] = want_si, want_si.t()
    want_t = torch.zeros((k, mp), dtype=torch.uint8, device=CUDA)
    want_t[:, :m] = want.view(torch.uint8).t()
    assert torch.equal(scales, want_s) and torch.equal(scales_t, want_s_t)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(out_t, want_t)
