"""Bandwidth of the fp8 cast kernels against a device copy and torch.compile (GPU only).

    python benchmarks/cast.py                    # 8192 x 16384 bf16, table + JSON
    python benchmarks/cast.py --rows 4096 --cols 4096 --json /tmp/cast.json
    python benchmarks/cast.py --variants         # also time other launch shapes of each kernel
    python benchmarks/cast.py --block --rows 8192 --cols 1024 --input-dtype float32
                                                 # BlockScaling's casts too (1 x 128, 128 x 128,
                                                 # the one-read pair), against torch.compile of
                                                 # their torch-op form (ops.block_cast)

GB/s counts the bytes a kernel must move: read 2 B (bf16; 4 B float32) + write 1 B per
element for a cast, + 1 B more for a transposed copy, the read alone for amax, read + write
for the copy, + 4 B per block for block scale_invs; "% copy" is that rate over the measured
copy rate. Times are medians of CUDA-graph replays (median_ms).
The launch shapes the library uses come from fp8train.kernels.cast.launch_configs; pick
the best --variants row there.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

try:
    import fp8train  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from fp8train import ops  # noqa: E402
from fp8train.kernels import block_kernel, block_reference, cast, reference  # noqa: E402

TARGETS = {"triton cast+amax (delayed)": 85.0, "triton cast+transpose+amax (delayed)": 75.0}
FP8 = torch.float8_e4m3fn
FLAT_VARIANTS = [cast.FlatConfig(block, warps, per_sm)
                 for block, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16))
                 for per_sm in (2, 4, 5, 8)]
TILE_VARIANTS = [cast.TileConfig(bm, bn, warps, per_sm)
                 for bm, bn, warps, per_sm in ((64, 128, 8, 1), (64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 4),
                                               (64, 64, 4, 4), (64, 64, 4, 6), (64, 64, 4, 8), (64, 64, 8, 4),
                                               (32, 128, 4, 4), (32, 128, 4, 8), (128, 64, 8, 2), (128, 64, 8, 3),
                                               (128, 128, 8, 1), (128, 128, 16, 1), (64, 128, 4, 2), (64, 128, 4, 4))]
# one field changed from the defaults per variant: (field, values)
BLOCK_VARIANTS = [("rows", [(tm, 128, w) for tm, w in ((16, 2), (16, 4), (32, 2), (32, 8), (64, 4), (64, 8), (128, 8))]),
                  ("cols", [(128, tk, w) for tk, w in ((16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 8), (128, 8))]),
                  ("tiles", [(128, 128, w) for w in (4, 8, 32)]),
                  # a dict: several fields at once (fifty-ninth session's probe: the conversion
                  # saturates on the GPU, so the clamp only repeats it; 8 warps capped at 128
                  # registers fit two programs an SM; sixty-first: whole tiles unmasked at 8
                  # warps without the clamp fit two without a cap, slower in a compiled step on the H100;
                  # sixty-second: the transposed copy packed in words, 18% fewer instructions)
                  ("both", [2, 8, 16, {"both_clamp": False}, {"both": 8, "both_regs": 128},
                            {"both": 8, "both_regs": 128, "both_clamp": False}, {"even": True},
                            {"both": 8, "both_clamp": False, "even": True}, {"packed_t": True},
                            {"both_clamp": False, "even": True}, {"both_clamp": False, "even": True, "packed_t": True},
                            {"both": 8, "both_clamp": False, "even": True, "packed_t": True}]),
                  # the gated MLP's forms (bf16 inputs only): (the product's warps, the gradients')
                  ("gated", [(8, 8), (4, 4), (16, 16), {"both_clamp": False},
                             {"both_clamp": False, "even": True}, {"packed_t": True},
                             {"both_clamp": False, "even": True, "packed_t": True},
                             {"gated": (8, 8), "both_clamp": False, "even": True},
                             {"gated": (8, 16), "both_clamp": False, "even": True},
                             {"gated": (8, 8), "both_clamp": False, "even": True, "gated_sides": True},
                             {"gated": (8, 8), "both_clamp": False, "even": True, "gated_sides": True,
                              "packed_t": True}]),
                  # the norm's form (float32 inputs only), its warps apart since the sixty-third session
                  ("norm", [8, 16, {"both_clamp": False, "even": True}, {"packed_t": True},
                            {"norm": 8, "both_clamp": False, "even": True},
                            {"norm": 8, "both_clamp": False, "even": True, "packed_t": True}])]


def median_ms(fn, calls: int = 20, replays: int = 15) -> float:
    """fn's device time: the median over replays of a CUDA graph of `calls` calls, so no host
    launch cost enters (do_bench's per-call events let a ~20 us kernel's launch show, and the
    2026-12-02 sweeps scattered by 2x). Nothing flushes L2 between calls: inputs larger than
    L2 (50 MB) measure DRAM."""
    fn()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


class Buffers:
    """Inputs and outputs of every kernel, allocated once."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda"):
        self.x = torch.randn(rows, cols, device=device, dtype=dtype)  # (M, N)
        self.copy_dst = torch.empty_like(self.x)
        self.out = torch.empty(rows, cols, device=device, dtype=FP8)           # (M, N) fp8
        self.out_t = torch.empty(cols, rows, device=device, dtype=FP8)         # (N, M) fp8, transposed copy
        self.scale = torch.tensor(1.0, device=device)
        self.scale_inv = torch.empty((), device=device)
        self.amax = torch.tensor(-1.0, device=device)
        self.from_amax = reference.abs_max(self.x)
        self.current_scale = torch.tensor(1.0, device=device)
        self.numel = self.x.numel()
        self.in_bytes = self.x.element_size()
        # block casts: scale_invs as the quantizers lay them out (block_quantizer._scales)
        mb, kb = block_reference.blocks_of((rows, cols), (128, 128))
        self.sinv_rows = torch.empty(kb, rows, device=device).t()    # (M, Kb) column-major
        self.sinv_tiles = torch.empty(mb, kb, device=device)         # (Mb, Kb)
        self.sinv_cols = torch.empty(mb, cols, device=device)        # (Mb, K)
        self.out_t_blocks = torch.empty(cols, mb * 128, device=device, dtype=FP8)  # (K, Mp) fp8
        # a gated MLP's casts (bf16 x only): x as g (forward) or da (backward), u, and the
        # backward's outputs, dg | du side by side (M, 2K); the unfused kernels' products
        self.gated = dtype == torch.bfloat16 and cols % 128 == 0  # the gradients' tiles: each one side's
        if self.gated:
            self.u = torch.randn_like(self.x)
            self.g2 = torch.randn_like(self.x)
            self.prod = torch.empty_like(self.x)
            self.dg, self.du = torch.empty_like(self.x), torch.empty_like(self.x)
            self.out2 = torch.empty(rows, 2 * cols, device=device, dtype=FP8)
            self.out2_t = torch.empty(2 * cols, mb * 128, device=device, dtype=FP8)
            self.sinv2_rows = torch.empty(2 * kb, rows, device=device).t()
            self.sinv2_cols = torch.empty(mb, 2 * cols, device=device)
        # an RMS norm's cast (float32 x: HF's residual stream under FP32 master weights): its
        # weight and the formula's rstd; the output y = w * (x * rstd) is float32 there
        self.norm = dtype == torch.float32 and cols % 128 == 0
        if self.norm:
            self.w = torch.randn(cols, device=device)
            self.rstd = torch.rand(rows, device=device) + 0.5
            self.y = torch.empty_like(self.x)


def triton_cases(b: Buffers):
    """(name, callable, bytes moved) of the Triton kernels with the current launch shapes."""
    n, r = b.numel, b.in_bytes
    return [
        ("triton cast+amax (delayed)", lambda: cast.cast_amax(b.x, b.out, b.scale, b.scale_inv, b.amax), (r + 1) * n),
        ("triton cast, current scaling (from_amax)",
         lambda: cast.cast_amax(b.x, b.out, b.current_scale, b.scale_inv, from_amax=b.from_amax), (r + 1) * n),
        ("triton amax", lambda: cast.amax(b.x, b.amax), r * n),
        ("triton cast+transpose+amax (delayed)",
         lambda: cast.cast_transpose_amax(b.x, b.out, b.out_t, b.scale, b.scale_inv, b.amax), (r + 2) * n),
    ]


def block_cases(b: Buffers):
    """(name, callable, bytes moved) of the block cast kernels (BlockScaling) with the current
    launch shapes: 1 x 128 blocks (inputs, gradients), 128 x 128 (weights), and the one-read
    pair a layer's input and gradient take (1 x 128, and 128 x 1 transposed)."""
    n, r = b.numel, b.in_bytes
    row_scales, tile_scales = 4 * b.sinv_rows.numel(), 4 * b.sinv_tiles.numel()
    return [
        ("triton block cast 1x128", lambda: block_kernel.block_cast_into(b.x, b.out, b.sinv_rows, (1, 128)),
         (r + 1) * n + row_scales),
        ("triton block cast 128x128", lambda: block_kernel.block_cast_into(b.x, b.out, b.sinv_tiles, (128, 128)),
         (r + 1) * n + tile_scales),
        ("triton block cast both (1x128 + 128x1 t)",
         lambda: block_kernel.block_cast_both_into(b.x, b.out, b.out_t_blocks, b.sinv_rows, b.sinv_cols),
         (r + 2) * n + row_scales + 4 * b.sinv_cols.numel()),
    ] + (gated_cases(b) if b.gated else []) + (norm_cases(b) if b.norm else [])


GATED_FWD = "triton gated block cast both: act(g) * u"
GATED_GRAD = "triton gated block cast both: dg | du"
NORM = "triton norm block cast both: w * (x * rstd)"


def norm_y(b: Buffers) -> torch.Tensor:
    """The norm's output as rms_norm_formula computes it from its rstd (float32 x and w)."""
    return torch.mul(b.w, (b.x * b.rstd[:, None]).to(b.x.dtype), out=b.y)


def norm_cases(b: Buffers):
    """An RMS norm's two-way cast (a compiled BlockScaling step's norms read by stacked
    Linears: y computed in the cast's read of x, never stored), beside the unfused pair (y
    written, then the two-way cast of it)."""
    n, r = b.numel, b.in_bytes
    both_scales = 4 * (b.sinv_rows.numel() + b.sinv_cols.numel())
    side = r * b.x.shape[1] + 4 * b.x.shape[0]  # w and rstd

    def unfused():
        block_kernel.block_cast_both_into(norm_y(b), b.out, b.out_t_blocks, b.sinv_rows, b.sinv_cols)

    return [
        (NORM, lambda: block_kernel.norm_block_cast_into(b.x, b.w, b.rstd, b.x.dtype, b.out, b.out_t_blocks,
                                                          b.sinv_rows, b.sinv_cols), (r + 2) * n + side + both_scales),
        ("unfused: norm output, then block cast both", unfused, (3 * r + 2) * n + side + both_scales),
    ]


def gated_cases(b: Buffers):
    """The gated MLP's two-way casts (a compiled BlockScaling step's GatedMLP: the product and
    its gradients computed in the cast's read, never stored), each beside the unfused pair
    it replaces (gated.py's kernel writing the product or dg and du, then the two-way cast of
    it), with the bytes each moves: the fused ones' ratio to the unfused time is the saving."""
    n, r = b.numel, b.in_bytes
    both_scales = 4 * (b.sinv_rows.numel() + b.sinv_cols.numel())
    from fp8train.kernels import gated

    def unfused_fwd():
        gated.gated_fwd(b.x, b.u, "silu", b.prod)
        block_kernel.block_cast_both_into(b.prod, b.out, b.out_t_blocks, b.sinv_rows, b.sinv_cols)

    def unfused_grad():
        gated.gated_bwd(b.x, b.g2, b.u, "silu", b.dg, b.du)
        block_kernel.block_cast_both_into([b.dg, b.du], b.out2, b.out2_t, b.sinv2_rows, b.sinv2_cols)

    return [
        (GATED_FWD, lambda: block_kernel.gated_block_cast_into(b.x, b.u, "silu", b.out, b.out_t_blocks, b.sinv_rows,
                                                               b.sinv_cols), (2 * r + 2) * n + both_scales),
        ("unfused: gated fwd, then block cast both", unfused_fwd, (4 * r + 2) * n + both_scales),
        (GATED_GRAD, lambda: block_kernel.gated_grad_block_cast_into(b.x, b.g2, b.u, "silu", b.out2, b.out2_t,
                                                                     b.sinv2_rows, b.sinv2_cols),
         (3 * r + 4) * n + 2 * both_scales),
        ("unfused: gated bwd, then block cast both of dg | du", unfused_grad, (7 * r + 4) * n + 2 * both_scales),
    ]


def compiled_block_cases(b: Buffers):
    """torch.compile of the block casts' torch-op form (ops.block_cast: what compiled layers
    ran before the operator fp8train::block_cast launched the kernels, and what Inductor would
    fuse into a producer): the same outputs as block_cases."""
    n, r = b.numel, b.in_bytes
    row_scales = 4 * b.sinv_rows.numel()
    cases = []
    for name, block, transpose, nbytes in (
            ("torch.compile block cast 1x128", (1, 128), False, (r + 1) * n + row_scales),
            ("torch.compile block cast both (1x128 + 128x1 t)", (1, 128), True,
             (r + 2) * n + row_scales + 4 * b.sinv_cols.numel())):
        try:
            compiled = torch.compile(lambda x, block=block, t=transpose: ops.block_cast(x, FP8, block, False, t, False))
            compiled(b.x)
            cases.append((name, lambda c=compiled: c(b.x), nbytes))
        except Exception as e:  # report, don't crash
            cases.append((name, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    return cases


def check_block_bitwise(b: Buffers) -> dict:
    """The block kernels' outputs on this input against their twin (tests/gpu is the real check)."""
    same = lambda p, q: bool(torch.equal(p.view(torch.uint8), q.view(torch.uint8)))
    result = {}
    for name, block, sinv in (("1x128", (1, 128), b.sinv_rows), ("128x128", (128, 128), b.sinv_tiles)):
        want, want_sinv = block_reference.block_cast(b.x, FP8, block)
        block_kernel.block_cast_into(b.x, b.out, sinv, block)
        result[name] = same(b.out, want) and bool(torch.equal(sinv, want_sinv))
    want_t, want_sinv_t = block_reference.block_cast(b.x, FP8, (128, 1))
    block_kernel.block_cast_both_into(b.x, b.out, b.out_t_blocks, b.sinv_rows, b.sinv_cols)
    m = b.x.shape[0]
    result["both"] = (same(b.out_t_blocks[:, :m], want_t.t()) and bool(torch.equal(b.sinv_cols, want_sinv_t))
                      and not bool(b.out_t_blocks[:, m:].view(torch.uint8).any()))
    return result


def block_variant_calls(b: Buffers, fields=None):
    """(field, value, shapes, name, callable, bytes) per launch-shape variant of the block
    kernels: each variant changes one field of the default BlockShapes, or the fields of a
    dict value (the default first); the callable launches under it."""
    cases = {name: (fn, nbytes) for name, fn, nbytes in block_cases(b)}
    kernel_of = {"rows": ("triton block cast 1x128",), "cols": (None,), "tiles": ("triton block cast 128x128",),
                 "both": ("triton block cast both (1x128 + 128x1 t)",), "gated": (GATED_FWD, GATED_GRAD),
                 "norm": (NORM,)}
    default = block_kernel.BlockShapes()
    for field, values in BLOCK_VARIANTS:
        if fields is not None and field not in fields:
            continue
        for name in kernel_of[field]:
            if name is None:  # 128 x 1 alone is no layer's cast: timed as a plain cast of its own
                sinv = torch.empty(block_reference.blocks_of(b.x.shape, (128, 1)), device=b.x.device)
                fn, nbytes = (lambda s=sinv: block_kernel.block_cast_into(b.x, b.out, s, (128, 1))), \
                    (b.in_bytes + 1) * b.numel + 4 * sinv.numel()
                name = "triton block cast 128x1"
            elif name not in cases:  # the gated forms with a float32 x
                continue
            else:
                fn, nbytes = cases[name]
            for value in [getattr(default, field)] + values:
                shapes = dataclasses.replace(default, **(value if isinstance(value, dict) else {field: value}))

                def launch(fn=fn, shapes=shapes):
                    with block_kernel.override_shapes(shapes):
                        fn()
                yield field, value, shapes, name, launch, nbytes


BLOCK_OF = {"triton block cast 1x128": (1, 128), "triton block cast 128x128": (128, 128),
            "triton block cast both (1x128 + 128x1 t)": (1, 128), "triton block cast 128x1": (128, 1)}


def variant_gives_the_twins_bytes(b: Buffers, name: str) -> bool:
    """After a variant's launch: its payload (and the two-way cast's transposed one) equal the twin's."""
    same = lambda p, q: bool(torch.equal(p.view(torch.uint8), q.view(torch.uint8)))
    if name in (GATED_FWD, GATED_GRAD):
        return gated_gives_the_twins_bytes(b, name == GATED_GRAD)
    if name == NORM:  # against the two-way cast of the formula's y (whose own check is the branch below)
        got, got_t = b.out.clone(), b.out_t_blocks.clone()
        block_kernel.block_cast_both_into(norm_y(b), b.out, b.out_t_blocks, b.sinv_rows, b.sinv_cols)
        return bool(torch.equal(got.view(torch.uint8), b.out.view(torch.uint8))
                    and torch.equal(got_t.view(torch.uint8), b.out_t_blocks.view(torch.uint8)))
    want, _ = block_reference.block_cast(b.x, FP8, BLOCK_OF[name])
    if not same(b.out, want):
        return False
    if "both" in name:
        want_t, _ = block_reference.block_cast(b.x, FP8, (128, 1))
        return same(b.out_t_blocks[:, :b.x.shape[0]], want_t.t())
    return True


def gated_gives_the_twins_bytes(b: Buffers, grad: bool) -> bool:
    """After a gated form's launch: its two payloads equal the unfused kernels' (gated.py's
    product or gradients, then the two-way cast), byte for byte."""
    from fp8train.kernels import gated
    out, out_t = (b.out2, b.out2_t) if grad else (b.out, b.out_t_blocks)
    got, got_t = out.clone(), out_t.clone()
    if grad:
        gated.gated_bwd(b.x, b.g2, b.u, "silu", b.dg, b.du)
        block_kernel.block_cast_both_into([b.dg, b.du], b.out2, b.out2_t, b.sinv2_rows, b.sinv2_cols)
    else:
        gated.gated_fwd(b.x, b.u, "silu", b.prod)
        block_kernel.block_cast_both_into(b.prod, b.out, b.out_t_blocks, b.sinv_rows, b.sinv_cols)
    return bool(torch.equal(got.view(torch.uint8), out.view(torch.uint8))
                and torch.equal(got_t.view(torch.uint8), out_t.view(torch.uint8)))


def sweep_block_variants(b: Buffers, copy_gbps: float, fields=None) -> dict:
    """Time every launch-shape variant of the block kernels (each checked against the twin's
    bytes on this input first); the fastest first per kernel."""
    results: dict = {}
    for field, value, shapes, name, launch, nbytes in block_variant_calls(b, fields):
        try:
            for t in (b.out, b.out_t_blocks) + ((b.out2, b.out2_t) if b.gated else ()):
                t.view(torch.uint8).fill_(0xAB)  # no twin's byte here: a kernel that writes nothing fails
            launch()
            bitwise = variant_gives_the_twins_bytes(b, name)
            ms = median_ms(launch)
        except Exception as e:  # e.g. out of registers or shared memory
            results.setdefault(name, []).append({"shapes": repr(shapes), "error": f"{type(e).__name__}: {str(e)[:100]}"})
            continue
        gbps = nbytes / ms / 1e6
        results.setdefault(name, []).append({"shapes": repr(value), "field": field, "ms": ms,
                                             "gbps": gbps, "pct_copy": 100.0 * gbps / copy_gbps, "bitwise": bitwise})
    for name, rows in results.items():
        rows.sort(key=lambda r: r.get("ms", float("inf")))
        print(f"\n{name}: launch-shape variants (default {block_kernel.BlockShapes()})")
        for r in rows:
            if "error" in r:
                print(f"  {r['shapes']:<40} failed: {r['error']}")
            else:
                print(f"  {r['field']}={r['shapes']:<30}{r['ms']:>9.4f} ms{r['gbps']:>8.0f} GB/s{r['pct_copy']:>7.1f}%"
                      + ("" if r["bitwise"] else "  NOT the twin's bytes"))
    return results


def compiled_cases(b: Buffers):
    """torch.compile of the same math (functional: new outputs each call)."""

    def cast_amax(x, scale, amax):
        a = x.float().abs()
        a = torch.where(torch.isnan(a), torch.inf, a).max()
        return (x.float() * scale).clamp(-448.0, 448.0).to(FP8), torch.maximum(amax, a)

    def cast_transpose_amax(x, scale, amax):
        q, a = cast_amax(x, scale, amax)
        return q, q.t().contiguous(), a

    n, r = b.numel, b.in_bytes
    cases = []
    for name, fn, nbytes in (("torch.compile cast+amax", cast_amax, (r + 1) * n),
                             ("torch.compile cast+transpose+amax", cast_transpose_amax, (r + 2) * n)):
        try:
            compiled = torch.compile(fn)
            compiled(b.x, b.scale, b.amax)  # compile now, so a failure is reported here
            cases.append((name, lambda c=compiled: c(b.x, b.scale, b.amax), nbytes))
        except Exception as e:  # report, don't crash: the Triton numbers matter more
            cases.append((name, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    return cases


def check_bitwise(b: Buffers) -> dict:
    """One quick equality check against the reference twins on this input (tests/gpu is the real one)."""
    want, want_t = torch.empty_like(b.out), torch.empty_like(b.out_t)
    s, inv, amax = b.scale.clone(), torch.empty((), device="cuda"), torch.tensor(-1.0, device="cuda")
    reference.cast_transpose_amax(b.x, want, want_t, s, inv, amax)
    got, got_t = torch.empty_like(b.out), torch.empty_like(b.out_t)
    g_inv, g_amax = torch.empty((), device="cuda"), torch.tensor(-1.0, device="cuda")
    cast.cast_transpose_amax(b.x, got, got_t, b.scale, g_inv, g_amax)
    flat = torch.empty_like(b.out)
    cast.cast_amax(b.x, flat, b.scale, torch.empty((), device="cuda"))
    same = lambda p, q: bool(torch.equal(p.view(torch.uint8), q.view(torch.uint8)))
    return {"cast_amax": same(flat, want), "cast_transpose_amax": same(got, want) and same(got_t, want_t),
            "amax": bool(torch.equal(g_amax, amax)), "scale_inv": bool(torch.equal(g_inv, inv))}


def kernel_resources() -> list:
    """Registers / spills / shared memory of every compiled cast kernel, and how many programs
    of each fit on one SM (best effort: reads Triton's kernel cache, whose layout may change)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    rows = []
    for name, fn in (("flat", cast._flat_kernel), ("tile", cast._tile_kernel),
                     ("block", block_kernel._block_cast_kernel), ("block both", block_kernel._block_cast_both_kernel)):
        try:
            compiled = [k for cache in fn.device_caches.values() for k in cache[0].values()]
        except Exception as e:
            rows.append({"kernel": name, "error": repr(e)})
            continue
        for k in compiled:
            threads = 32 * k.metadata.num_warps
            regs = max(1, k.n_regs)
            by_regs = 65536 // (((regs + 7) // 8 * 8) * threads)
            by_smem = smem_per_sm // max(1, k.metadata.shared) if k.metadata.shared else 32
            fit = min(by_regs, 2048 // threads, by_smem, 32)
            rows.append({"kernel": name, "num_warps": k.metadata.num_warps, "n_regs": k.n_regs,
                         "n_spills": k.n_spills, "shared": k.metadata.shared, "programs_per_sm_fit": fit})
    return rows


def measure(cases, copy_gbps: float):
    rows = []
    for name, fn, nbytes in cases:
        if fn is None:
            rows.append({"name": name, "error": nbytes})
            continue
        ms = median_ms(fn)
        gbps = nbytes / ms / 1e6
        rows.append({"name": name, "ms": ms, "gbps": gbps, "pct_copy": 100.0 * gbps / copy_gbps, "bytes": nbytes})
    return rows


def print_table(rows) -> None:
    print(f"{'kernel':<50}{'time ms':>10}{'GB/s':>10}{'% copy':>9}  target")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<50}{'failed':>10}  {r['error']}")
            continue
        target = TARGETS.get(r["name"])
        mark = "" if target is None else f">= {target:.0f}% {'ok' if r['pct_copy'] >= target else 'MISSED'}"
        print(f"{r['name']:<50}{r['ms']:>10.4f}{r['gbps']:>10.0f}{r['pct_copy']:>8.1f}%  {mark}")


def sweep_variants(b: Buffers, copy_gbps: float) -> dict:
    """Time every launch-shape variant of each kernel; the fastest first."""
    default_flat, default_tile = cast.launch_configs(b.x.device)
    results = {}
    for kind, variants in (("flat", FLAT_VARIANTS), ("tile", TILE_VARIANTS)):
        for name, fn, nbytes in triton_cases(b):
            if (kind == "tile") != ("transpose" in name):
                continue
            rows = []
            for v in variants:
                flat = v if kind == "flat" else default_flat
                tile = v if kind == "tile" else default_tile
                with cast.override_configs(flat, tile):
                    try:
                        ms = median_ms(fn)
                    except Exception as e:  # e.g. out of shared memory / registers
                        rows.append({"config": repr(v), "error": f"{type(e).__name__}: {str(e)[:100]}"})
                        continue
                gbps = nbytes / ms / 1e6
                rows.append({"config": repr(v), "ms": ms, "gbps": gbps, "pct_copy": 100.0 * gbps / copy_gbps})
            rows.sort(key=lambda r: r.get("ms", float("inf")))
            default = repr(default_flat if kind == "flat" else default_tile)
            print(f"\n{name}: launch-shape variants (default {default})")
            for r in rows:
                if "error" in r:
                    print(f"  {r['config']:<72} failed: {r['error']}")
                else:
                    star = " *" if r["config"] == default else ""
                    print(f"  {r['config']:<72}{r['ms']:>9.4f} ms{r['gbps']:>8.0f} GB/s{r['pct_copy']:>7.1f}%{star}")
            results[name] = rows
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=16384)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "cast.json"))
    parser.add_argument("--variants", action="store_true", help="also time other launch shapes of each kernel")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile comparison")
    parser.add_argument("--block", action="store_true", help="BlockScaling's block casts too (--variants: theirs)")
    parser.add_argument("--block-only", action="store_true",
                        help="the block casts alone (implies --block): no per-tensor kernels, nor their variants")
    parser.add_argument("--fields", help="--variants of these BlockShapes fields alone (comma-separated: "
                        "rows, cols, tiles, both, gated, norm; default all)")
    parser.add_argument("--input-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the input's dtype (a converted HF Llama's q/k/v and gate/up inputs are float32)")
    args = parser.parse_args()
    args.block = args.block or args.block_only
    known = [field for field, _ in BLOCK_VARIANTS]
    if args.fields and not set(args.fields.split(",")) <= set(known):
        parser.error(f"--fields: some of {known}, got {args.fields!r}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/cast.py needs a CUDA GPU")

    b = Buffers(args.rows, args.cols, getattr(torch, args.input_dtype))
    device = torch.cuda.get_device_name()
    copy_ms = median_ms(lambda: b.copy_dst.copy_(b.x))
    copy_gbps = 2 * b.in_bytes * b.numel / copy_ms / 1e6
    print(f"fp8 cast kernels on {device}: {args.input_dtype} x ({args.rows}, {args.cols}) -> e4m3; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"device copy ({args.input_dtype} read + write): {copy_ms:.4f} ms, {copy_gbps:.0f} GB/s = 100%")
    print("targets: cast+amax >= 85% of copy bandwidth, cast+transpose+amax >= 75%")
    flat, tile = cast.launch_configs(b.x.device)
    print(f"launch shapes: {flat}, {tile}" + (f", {block_kernel.launch_shapes()}" if args.block else ""))
    checks = {} if args.block_only else check_bitwise(b)
    if args.block:
        checks.update({f"block {k}": v for k, v in check_block_bitwise(b).items()})
    print(f"bitwise vs reference on this input: {checks}\n")

    cases = [] if args.block_only else triton_cases(b) + ([] if args.no_compile else compiled_cases(b))
    if args.block:
        cases += block_cases(b) + ([] if args.no_compile else compiled_block_cases(b))
    rows = measure(cases, copy_gbps)
    print_table(rows)
    resources = kernel_resources()
    print("\ncompiled kernels (programs_per_sm above 'fit' means a second, partial wave):")
    for r in resources:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    variants = sweep_variants(b, copy_gbps) if args.variants and not args.block_only else None
    block_variants = sweep_block_variants(b, copy_gbps, args.fields and args.fields.split(",")) \
        if args.variants and args.block else None

    result = {
        "device": device, "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": [args.rows, args.cols], "input_dtype": args.input_dtype, "fp8_dtype": "float8_e4m3fn",
        "copy": {"ms": copy_ms, "gbps": copy_gbps}, "launch_configs": [repr(flat), repr(tile)],
        "bitwise_vs_reference": checks, "kernels": rows, "targets_pct_copy": TARGETS,
        "compiled_kernels": resources, "variants": variants, "block_variants": block_variants,
        "block_shapes": repr(block_kernel.launch_shapes()) if args.block else None,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
