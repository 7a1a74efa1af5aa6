"""The block-scaled cast kernel (kernels/block_kernel.py) on the GPU against its twin
(kernels/block_reference.py), bit for bit, with the hardware's fp8 conversion: every bf16
pattern in shapes with tails, float32 and float16 inputs, both formats, power-of-two scales."""
import pytest
import torch

from fp8train import kernels
from fp8train.kernels import block_reference as br
from helpers import all_bf16_values

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BLOCKS = [pytest.param(b, id=f"{b[0]}x{b[1]}") for b in br.BLOCKS]


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("block", BLOCKS)
def test_block_cast_kernel_is_the_twin_on_the_gpu(block, dtype, fp8, power_of_two):
    v = all_bf16_values()
    x = torch.cat([v, torch.zeros(259 * 255 - v.numel(), dtype=v.dtype)]).reshape(259, 255).to(dtype).to(CUDA)
    out = torch.empty(x.shape, dtype=fp8, device=CUDA)
    scale_inv = torch.full(br.blocks_of(x.shape, block), -1.0, device=CUDA)
    kernels.block_cast(x, out, scale_inv, block, power_of_two)
    want, want_si = br.block_cast(x, fp8, block, power_of_two)  # the twin, in torch's CUDA ops
    assert torch.equal(scale_inv, want_si)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
