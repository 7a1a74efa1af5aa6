"""fp8train.distributed on CUDA with NCCL: the collective matmuls (side stream, events) equal
the non-overlapped path.

World size 1 runs in this process (tcp://127.0.0.1, a free port): every ring has zero
transfers, but the NCCL all-gather / all-reduce, the stream and event set-up, the Triton
byte transpose and the FP8 GEMMs all run. With two or more GPUs, one spawned launch of two
processes runs the rings for real (transfers on the side stream, NCCL P2P) against
all_gather / reduce_scatter + one GEMM. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 in the
environment before NCCL initialises), as on the lent machines.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8train import GemmConfig, gemm
from fp8train.distributed import (all_gather_dgrad, all_gather_fp8, all_gather_fprop, dgrad_reduce_scatter,
                                  fprop_reduce_scatter, gather_cast, reduce_delayed_amaxes)
from fp8train.distributed import symm_transport
from fp8train.quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer
from fp8train.roles import TensorRole

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CFG = GemmConfig()
TIMEOUT = timedelta(seconds=120)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_nccl(rank: int, world: int, port: int) -> torch.device:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, before NCCL initialises
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # and in symmetric memory (symm_transport)
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    return device


def _bytes_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _cast(x, dtype, role=TensorRole.INPUT, transpose=False):
    return CurrentScalingQuantizer(role, dtype, device=x.device).cast(x, transpose=transpose)


@pytest.fixture(scope="module")
def nccl1():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    device = _init_nccl(0, 1, _free_port())
    yield device
    dist.destroy_process_group()


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_gather_cast_world1(nccl1, recipe):
    x = torch.randn(40, 256, device=nccl1, dtype=torch.bfloat16)  # 40 rows: padded transposed copy
    make = ((lambda: CurrentScalingQuantizer(TensorRole.INPUT, E4M3, device=nccl1)) if recipe == "current" else
            (lambda: DelayedScalingQuantizer(TensorRole.INPUT, E4M3, 16, device=nccl1)))
    q, ref_q = make(), make()
    out, ref = gather_cast(x, q, transpose=True), ref_q.cast(x, transpose=True)
    torch.cuda.synchronize()
    assert torch.equal(out.scale_inv, ref.scale_inv)
    assert _bytes_equal(out.data, ref.data) and _bytes_equal(out.data_t, ref.data_t)


def test_delayed_reduction_world1(nccl1):
    qs = [DelayedScalingQuantizer(TensorRole.INPUT, E4M3, 4, device=nccl1) for _ in range(3)]
    for q, v in zip(qs, (3.0, -1.0, float("nan"))):
        q.amax_history[0] = v
    reduce_delayed_amaxes(qs)
    got = torch.stack([q.amax_history[0] for q in qs]).cpu()
    assert torch.equal(got, torch.tensor([3.0, -1.0, float("inf")]))


def test_collective_matmuls_world1(nccl1):
    m, k, n = 256, 512, 384
    x = _cast(torch.randn(m, k, device=nccl1), E4M3)
    dy = _cast(torch.randn(m, n, device=nccl1), E5M2, TensorRole.GRAD_OUTPUT)
    w = _cast(torch.randn(n, k, device=nccl1), E4M3, TensorRole.WEIGHT, transpose=True)  # w.data_t (k, n)
    bias = torch.randn(n, device=nccl1, dtype=torch.bfloat16)
    bf16 = torch.bfloat16

    y, x_all = all_gather_fprop(x.data, x.scale_inv, w.data, w.scale_inv, CFG, bf16, bias=bias)
    assert _bytes_equal(x_all, x.data)
    assert torch.equal(y, gemm.fprop(all_gather_fp8(x.data), x.scale_inv, w.data, w.scale_inv, CFG, bf16, bias))
    dx, dy_all = all_gather_dgrad(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, bf16)
    assert _bytes_equal(dy_all, dy.data)
    assert torch.equal(dx, gemm.dgrad(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, bf16))
    y_rs = fprop_reduce_scatter(x.data, x.scale_inv, w.data, w.scale_inv, CFG, bf16, bias=bias)
    ref = (gemm.fprop(x.data, x.scale_inv, w.data, w.scale_inv, CFG, torch.float32) + bias.float()).to(bf16)
    assert torch.equal(y_rs, ref)
    dx_rs = dgrad_reduce_scatter(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, bf16)
    assert torch.equal(dx_rs, gemm.dgrad(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, torch.float32).to(bf16))


# --------------------------------------------------------------------------- two GPUs


def _ring_cases(device: torch.device) -> None:
    """The four collective matmuls against all_gather / reduce_scatter + one GEMM, 2+ ranks.
    Errors are bounded by float32 summation order (the GEMMs of chunks vs one GEMM may sum K
    in another order; the reduce-scatter sums in another order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    m, k, n, f32 = 96, 512, 256, torch.float32

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)

    def close(a, b, what):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item(),
                                   msg=lambda s: f"rank {rank} {what}: {s}")

    # column-parallel forward / row-parallel dgrad: the input is gathered. A group-consistent
    # scale matters for the meaning, not for this comparison: both paths use the same bytes.
    x = _cast(rand(m, k), E4M3)
    dy = _cast(rand(m, n), E5M2, TensorRole.GRAD_OUTPUT)
    w = _cast(rand(n, k), E4M3, TensorRole.WEIGHT, transpose=True)
    y, x_all = all_gather_fprop(x.data, x.scale_inv, w.data, w.scale_inv, CFG, f32)
    ref_x = all_gather_fp8(x.data)
    assert _bytes_equal(x_all, ref_x), f"rank {rank}: gathered bytes differ"
    close(y, gemm.fprop(ref_x, x.scale_inv, w.data, w.scale_inv, CFG, f32), "all_gather_fprop")
    dx, dy_all = all_gather_dgrad(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, f32)
    ref_dy = all_gather_fp8(dy.data)
    assert _bytes_equal(dy_all, ref_dy), f"rank {rank}: gathered grad bytes differ"
    close(dx, gemm.dgrad(ref_dy, dy.scale_inv, w.data_t, w.scale_inv, CFG, f32), "all_gather_dgrad")

    # row-parallel forward / column-parallel dgrad: the output is reduce-scattered
    big = _cast(rand(world * m, k), E4M3)
    big_dy = _cast(rand(world * m, n), E5M2, TensorRole.GRAD_OUTPUT)

    def reduce_scatter(t):
        out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=device)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        rs(out, t)
        return out

    y_rs = fprop_reduce_scatter(big.data, big.scale_inv, w.data, w.scale_inv, CFG, f32)
    close(y_rs, reduce_scatter(gemm.fprop(big.data, big.scale_inv, w.data, w.scale_inv, CFG, f32)),
          "fprop_reduce_scatter")
    dx_rs = dgrad_reduce_scatter(big_dy.data, big_dy.scale_inv, w.data_t, w.scale_inv, CFG, f32)
    close(dx_rs, reduce_scatter(gemm.dgrad(big_dy.data, big_dy.scale_inv, w.data_t, w.scale_inv, CFG, f32)),
          "dgrad_reduce_scatter")
    torch.cuda.synchronize(device)


def _ring_worker(rank: int, world: int, port: int, errors) -> None:
    try:
        device = _init_nccl(rank, world, port)
        try:
            # the copy-engine transport (symmetric memory) where the machine has it, which
            # the H200 machines do, then the NCCL ring
            assert symm_transport.usable(dist.group.WORLD, device), "no symmetric memory: the copy-engine path is untested"
            _ring_cases(device)
            with symm_transport.nccl_transport():
                assert not symm_transport.usable(dist.group.WORLD, device)
                _ring_cases(device)
        finally:
            dist.destroy_process_group()
    except Exception:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_collective_matmuls_world2():
    errors = mp.get_context("spawn").Queue()
    procs = mp.start_processes(_ring_worker, args=(2, _free_port(), errors), nprocs=2, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + 300
    try:
        while not procs.join(timeout=5):
            assert time.monotonic() < deadline, "the 2-GPU launch ran past 300 s"
    finally:
        for p in procs.processes:  # only ours, by handle
            if p.is_alive():
                p.kill()
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)
