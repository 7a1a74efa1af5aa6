"""Bandwidth of the fused norm kernels (fp8train/kernels/norm.py), to choose their launch shapes.

    python benchmarks/norm.py                   # the library's launch shapes, table + JSON (GPU)
    python benchmarks/norm.py --variants        # also other launch shapes (pick the best for launch_configs)
    TRITON_INTERPRET=1 python benchmarks/norm.py --device cpu --sizes 64x48 --variants   # smoke test only

Per size (M rows of K features, bf16, LayerNorm with bias, delayed scaling, e4m3 out): the
forward into FP8 (row kernel), the same with the transposed copy (on CUDA the row kernel then
kernels/transpose.py; with norm._FUSED_TRANSPOSE_ON_CUDA set, e.g. by tools/run_with_flags.py,
the tile kernel, and the separate copy beside it), and the backward (dx, dgamma,
dbeta), beside torch's bf16 F.layer_norm forward and backward. GB/s counts the bytes an op
must move (x read once, fp8 outputs written once; backward: dy and x read, dx written);
"% copy" is that rate over a measured bf16 device copy's. On CUDA times are medians of
triton.testing.do_bench (L2 flushed between runs); `--device cpu` runs every op once under
the Triton interpreter, to check the script, and its times mean nothing. Never asserts on time.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import fp8train  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from fp8train.kernels import norm  # noqa: E402

FP8 = torch.float8_e4m3fn
# (row config of the forward, tile config of the forward with out_t: only its transposing
# variant uses it, bwd row config)
ROW_VARIANTS = [norm.RowConfig(block, max_n, long_m, warps, per_sm)
                for block, max_n, long_m, warps, per_sm in ((4096, 4096, 1, 8, 3), (4096, 4096, 1, 8, 2),
                                                            (4096, 4096, 1, 4, 4), (2048, 2048, 1, 4, 4),
                                                            (8192, 8192, 1, 16, 1), (8192, 8192, 2, 8, 2),
                                                            (2048, 4096, 1, 4, 8), (4096, 4096, 4, 8, 2))]
BWD_VARIANTS = [norm.RowConfig(block, max_n, long_m, warps, per_sm)
                for block, max_n, long_m, warps, per_sm in ((4096, 4096, 4, 8, 2), (4096, 4096, 4, 8, 1),
                                                            (4096, 4096, 4, 4, 4), (8192, 8192, 4, 16, 1),
                                                            (2048, 2048, 2, 4, 4), (8192, 4096, 4, 8, 2),
                                                            (2048, 4096, 1, 4, 4), (1024, 1024, 1, 4, 8),
                                                            (1024, 1024, 1, 4, 4), (2048, 2048, 2, 4, 8),
                                                            (2048, 2048, 2, 8, 4))]

TILE_VARIANTS = [norm.TileConfig(bm, bn, warps, per_sm)
                 for bm, bn, warps, per_sm in ((32, 128, 8, 2), (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 8, 2),
                                               (16, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 8), (32, 256, 8, 2))]


@contextlib.contextmanager
def separate_copy():
    """norm_fwd_fp8 writes out only; kernels/transpose.py makes out_t (the route before the fused one)."""
    saved = norm._FUSED_TRANSPOSE_ON_CUDA
    norm._FUSED_TRANSPOSE_ON_CUDA = False
    try:
        yield
    finally:
        norm._FUSED_TRANSPOSE_ON_CUDA = saved


def timer(device: torch.device):
    if device.type == "cuda":
        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def once(fn):  # the interpreter: one run, to exercise the code
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return once


def run_size(m: int, k: int, device: torch.device, variants: bool) -> tuple:
    time_ms = timer(device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, device=device, dtype=torch.bfloat16)
    mean, rstd = torch.empty(m, device=device), torch.empty(m, device=device)
    out, out_t = torch.empty(m, k, device=device, dtype=FP8), torch.empty(k, m, device=device, dtype=FP8)
    scale, scale_inv, amax = torch.tensor(1.0, device=device), torch.empty((), device=device), \
        torch.zeros((), device=device)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    copy_dst = torch.empty_like(x)
    copy_gbs = 2 * x.numel() * 2 / time_ms(lambda: copy_dst.copy_(x)) / 1e6
    rows = []

    def add(op, cfg, ms, nbytes):
        gbs = nbytes / ms / 1e6
        rows.append({"M": m, "K": k, "op": op, "config": cfg, "ms": ms, "GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs})

    xr = x.detach().requires_grad_(True)
    wr, br = w.detach().requires_grad_(True), b.detach().requires_grad_(True)
    y = F.layer_norm(xr, (k,), wr, br)
    add("torch bf16 forward", None, time_ms(lambda: F.layer_norm(x, (k,), w, b)), 2 * m * k * 2)
    add("torch bf16 backward", None, time_ms(lambda: torch.autograd.grad(y, (xr, wr, br), dy, retain_graph=True)),
        3 * m * k * 2)

    def fwd(transpose):
        return lambda: norm.norm_fwd_fp8(x, w, b, 1e-5, mean, rstd, out, out_t if transpose else None, scale,
                                         scale_inv, amax)

    def bwd():
        norm.norm_bwd(dy, x, w, mean, rstd, dx, dw, db)

    fwd(False)()  # the statistics the backward reads
    base = norm.launch_configs(device)
    shapes = [("-", base)]
    if variants:
        shapes += [(f"rows {c.block}/{c.max_block_n}/{c.long_block_m} w{c.num_warps} p{c.programs_per_sm}",
                    dataclasses.replace(base, rows=c)) for c in ROW_VARIANTS]
        if device.type != "cuda" or norm._FUSED_TRANSPOSE_ON_CUDA:  # else the tile kernel does not run
            shapes += [(f"tiles {c.block_m}x{c.block_n} w{c.num_warps} p{c.programs_per_sm}",
                        dataclasses.replace(base, tiles=c)) for c in TILE_VARIANTS]
        shapes += [(f"bwd {c.block}/{c.max_block_n}/{c.long_block_m} w{c.num_warps} p{c.programs_per_sm}",
                    dataclasses.replace(base, bwd=c, wide_bwd=c, narrow_bwd=None)) for c in BWD_VARIANTS]
    for label, cfgs in shapes:
        with norm.override_configs(cfgs) if label != "-" else contextlib.nullcontext():
            if label == "-" or label.startswith("rows"):
                add("fp8 forward", label, time_ms(fwd(False)), m * k * 2 + m * k)
            if label == "-" or label.startswith("tiles"):
                add("fp8 forward + transpose", label, time_ms(fwd(True)), m * k * 2 + 2 * m * k)
            if label == "-" and device.type == "cuda" and norm._FUSED_TRANSPOSE_ON_CUDA:
                with separate_copy():
                    add("fp8 forward + transpose (separate copy)", label, time_ms(fwd(True)), m * k * 2 + 2 * m * k)
            if label == "-" or label.startswith("bwd"):
                add("backward (dx, dgamma, dbeta)", label, time_ms(bwd), 3 * m * k * 2)
    return rows, copy_gbs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096x1024,8192x4096,8192x8192", help="MxK pairs")
    p.add_argument("--variants", action="store_true", help="also time the ROW_VARIANTS / TILE_VARIANTS / BWD_VARIANTS launch shapes")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json", default="benchmarks/results/norm.json")
    args = p.parse_args()
    device = torch.device(args.device)
    meta = {"date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke test)",
            "torch": torch.__version__, "triton": triton.__version__}
    results, copies = [], {}
    for size in args.sizes.split(","):
        m, k = (int(v) for v in size.split("x"))
        rows, copy_gbs = run_size(m, k, device, args.variants)
        results += rows
        copies[size] = copy_gbs
    print(f"\nfused norm kernels (LayerNorm, bf16 in, e4m3 out) -- {meta}")
    print("bf16 copy GB/s: " + ", ".join(f"{k}: {v:.0f}" for k, v in copies.items()))
    print(f"{'M x K':<11} {'op':<30} {'launch (library = -)':<26} {'ms':>8} {'GB/s':>7} {'% copy':>7}")
    for r in results:
        print(f"{r['M']}x{r['K']:<6} {r['op']:<30} {r['config'] or '-':<26} {r['ms']:>8.4f} {r['GB/s']:>7.0f} "
              f"{r['pct_copy']:>6.1f}%")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"meta": meta, "copy_GBps": copies, "rows": results}, fh, indent=1)


if __name__ == "__main__":
    main()
