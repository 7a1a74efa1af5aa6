"""benchmarks/cast.py's block-cast code path under the Triton interpreter (CPU tensors): its
cases, its bitwise check and every launch-shape variant run, and the variants give the
default shapes' bytes (so the GPU machine's first run of the sweep is not spent on a broken
script). Times are not taken here.

Run with `TRITON_INTERPRET=1 python -m pytest tests/interpret` (skipped otherwise).
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

import cast as cast_bench  # noqa: E402

from fp8train.kernels import block_kernel, block_reference  # noqa: E402


@pytest.mark.parametrize("dtype, cols", [(torch.bfloat16, 300), (torch.float32, 300), (torch.bfloat16, 256),
                                         (torch.float32, 256)], ids=["bf16", "fp32", "bf16-gated", "fp32-norm"])
def test_block_cases_run_and_match_the_twin(dtype, cols, exact_conversions):
    torch.manual_seed(0)
    b = cast_bench.Buffers(200, cols, dtype, device="cpu")  # tail blocks both ways (gated: rows only)
    assert cast_bench.check_block_bitwise(b) == {"1x128": True, "128x128": True, "both": True}
    names = [name for name, fn, nbytes in cast_bench.block_cases(b)]
    gated = [cast_bench.GATED_FWD, "unfused: gated fwd, then block cast both", cast_bench.GATED_GRAD,
             "unfused: gated bwd, then block cast both of dg | du"] if b.gated else []
    norm = [cast_bench.NORM, "unfused: norm output, then block cast both"] if b.norm else []
    assert b.norm == (dtype == torch.float32 and cols == 256)
    assert names == ["triton block cast 1x128", "triton block cast 128x128",
                     "triton block cast both (1x128 + 128x1 t)"] + gated + norm
    for name, fn, nbytes in cast_bench.block_cases(b):
        fn()
        assert nbytes > b.in_bytes * b.numel


def test_every_block_variant_gives_the_twins_bytes(exact_conversions):
    torch.manual_seed(1)
    b = cast_bench.Buffers(130, 256, torch.bfloat16, device="cpu")  # the gated forms take whole column blocks
    seen = set()
    for field, value, shapes, name, launch, nbytes in cast_bench.block_variant_calls(b):
        for t in (b.out, b.out_t_blocks, b.out2, b.out2_t):
            t.view(torch.uint8).fill_(0xAB)  # not an e4m3 byte of any twin output here
        if name not in (cast_bench.GATED_FWD, cast_bench.GATED_GRAD):  # their check rewrites the outputs
            assert not cast_bench.variant_gives_the_twins_bytes(b, name)  # the benchmark's own check can fail
        launch()
        assert cast_bench.variant_gives_the_twins_bytes(b, name), (field, shapes)
        assert block_kernel.launch_shapes() == block_kernel.BlockShapes()  # the override ended with the launch
        seen.add((field, repr(value)))
        if name in (cast_bench.GATED_FWD, cast_bench.GATED_GRAD):
            continue
        want, _ = block_reference.block_cast(b.x, cast_bench.FP8, cast_bench.BLOCK_OF[name])
        assert torch.equal(b.out.view(torch.uint8), want.view(torch.uint8)), (field, shapes)
        if "both" in name:
            want_t, _ = block_reference.block_cast(b.x, cast_bench.FP8, (128, 1))
            assert torch.equal(b.out_t_blocks[:, :130].view(torch.uint8), want_t.t().view(torch.uint8))
    # every variant once; a field's own list leaves out its default, which comes first (the
    # norm's form takes float32 x: the next test)
    assert len(seen) == sum(len(values) + 1 for field, values in cast_bench.BLOCK_VARIANTS if field != "norm")


def test_every_norm_variant_gives_the_formulas_bytes(exact_conversions):
    """The norm's form (float32 x) under each of its variants: the benchmark's check
    passes, and the bytes are the reference cast of the formula's y (w * (x * rstd))."""
    torch.manual_seed(2)
    b = cast_bench.Buffers(130, 256, torch.float32, device="cpu")
    y = b.w * (b.x * b.rstd[:, None])
    want, _ = block_reference.block_cast(y, cast_bench.FP8, (1, 128))
    want_t, _ = block_reference.block_cast(y, cast_bench.FP8, (128, 1))
    calls = list(cast_bench.block_variant_calls(b, ["gated", "norm"]))
    assert {name for *_, name, launch, nbytes in calls} == {cast_bench.NORM}  # the gated forms take bf16
    assert len(calls) == len(dict(cast_bench.BLOCK_VARIANTS)["norm"]) + 1
    for field, value, shapes, name, launch, nbytes in calls:
        for t in (b.out, b.out_t_blocks):
            t.view(torch.uint8).fill_(0xAB)
        assert not cast_bench.variant_gives_the_twins_bytes(b, name)  # the check can fail
        launch()
        assert cast_bench.variant_gives_the_twins_bytes(b, name), value
        assert torch.equal(b.out.view(torch.uint8), want.view(torch.uint8)), value
        assert torch.equal(b.out_t_blocks[:, :130].view(torch.uint8), want_t.t().view(torch.uint8)), value


def test_block_shapes_refuse_tiles_of_partial_blocks():
    with pytest.raises(ValueError, match="rows"):
        block_kernel.BlockShapes(rows=(32, 64, 4))
    with pytest.raises(ValueError, match="cols"):
        block_kernel.BlockShapes(cols=(64, 32, 4))
    with pytest.raises(ValueError, match="tiles"):
        block_kernel.BlockShapes(tiles=(128, 128, 6))
    for warps in (3, 0, 64, (64, 4)):
        with pytest.raises(ValueError, match="both"):
            block_kernel.BlockShapes(both=warps)
    for regs in (-1, 16, 256, True, 128.0):
        with pytest.raises(ValueError, match="both_regs"):
            block_kernel.BlockShapes(both_regs=regs)
    with pytest.raises(ValueError, match="both_clamp"):
        block_kernel.BlockShapes(both_clamp=0)
    with pytest.raises(ValueError, match="even"):
        block_kernel.BlockShapes(even=1)
    block_kernel.BlockShapes(both=8, both_regs=128, both_clamp=False, even=True)  # the sweep's forms
    for gated in (8, (4,), (4, 3), (0, 8), (True, 8), [4, 8]):
        with pytest.raises(ValueError, match="gated"):
            block_kernel.BlockShapes(gated=gated)
    block_kernel.BlockShapes(gated=(16, 2))
    for warps in (3, 0, 64, (8,), True):
        with pytest.raises(ValueError, match="norm"):
            block_kernel.BlockShapes(norm=warps)
    shapes = block_kernel.BlockShapes(both=2, gated=(4, 16), norm=8)
    assert [shapes.both_warps(g) for g in range(4)] == [2, 4, 16, 8]
    # each form's kernel launches at its own warps
    warps = [block_kernel._both_kernel(448.0, False, shapes, (256, 256), gated=g)._options["num_warps"]
             for g in range(4)]
    assert warps == [2, 4, 16, 8]
