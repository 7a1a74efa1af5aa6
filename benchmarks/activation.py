"""Bandwidth of the fused MLP activation kernels (fp8train/kernels/activation.py, GPU only).

    python benchmarks/activation.py                 # the library's launch shapes, table + JSON
    python benchmarks/activation.py --variants      # also other launch shapes (pick the best for launch_config)

Per activation and size (M rows, F activation columns): the forward (act(h) -> fp8 + its
transposed copy + amax, delayed scaling) and the backward (da * act'(h) -> fp8 + transposed
copy + amax + dbias), each also without the transposed copy (on CUDA the copy is a second
kernel, kernels/transpose.py, unless activation._FUSED_TRANSPOSE_ON_CUDA is set, e.g. by
tools/run_with_flags.py: then the library's shapes are also timed with the second kernel,
side by side), the backward also without dbias;
beside them torch's bf16 activation forward / backward. relu shows the kernels' cost
with next to no activation math. GB/s counts the bytes an op must move (bf16 inputs read
once, each fp8 output written once); "% copy" is that rate over a measured bf16 device
copy's. Times are medians of triton.testing.do_bench (L2 flushed between runs). Never
asserts on time.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import fp8train  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from fp8train.kernels import activation  # noqa: E402

FP8 = torch.float8_e4m3fn
VARIANTS = [activation.ActConfig(bm, bn, warps, per_sm)
            for bm, bn, warps, per_sm in ((128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 4, 4), (64, 64, 4, 8),
                                          (64, 128, 4, 4), (64, 128, 8, 2), (64, 128, 8, 4), (32, 128, 4, 8),
                                          (32, 64, 4, 8), (64, 64, 8, 4), (128, 128, 8, 2), (32, 256, 8, 4))]


def median_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


@contextlib.contextmanager
def separate_copy(module):
    """module's kernels write the row-major output only; kernels/transpose.py makes out_t."""
    saved = module._FUSED_TRANSPOSE_ON_CUDA
    module._FUSED_TRANSPOSE_ON_CUDA = False
    try:
        yield
    finally:
        module._FUSED_TRANSPOSE_ON_CUDA = saved


def run_size(act: str, m: int, f: int, configs) -> list:
    gated = act == "swiglu"
    fh = 2 * f if gated else f
    h = torch.randn(m, fh, device="cuda", dtype=torch.bfloat16)  # fc1 output (gate | up for swiglu)
    da = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)   # grad w.r.t. the activation
    out_f, out_b = torch.empty(m, f, device="cuda", dtype=FP8), torch.empty(m, fh, device="cuda", dtype=FP8)
    out_ft, out_bt = torch.empty(f, m, device="cuda", dtype=FP8), torch.empty(fh, m, device="cuda", dtype=FP8)
    scale, scale_inv = torch.tensor(1.0, device="cuda"), torch.empty((), device="cuda")
    amax = torch.zeros((), device="cuda")
    dbias = torch.empty(fh, device="cuda", dtype=torch.bfloat16)
    copy_src = torch.randn(m, fh, device="cuda", dtype=torch.bfloat16)
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() * 2 / median_ms(lambda: copy_dst.copy_(copy_src)) / 1e6

    fwd_bytes = {False: m * fh * 2 + m * f, True: m * fh * 2 + 2 * m * f}
    bwd_bytes = {False: m * f * 2 + m * fh * 2 + m * fh, True: m * f * 2 + m * fh * 2 + 2 * m * fh}
    rows = []

    def add(name, cfg, ms, nbytes):
        gbs = nbytes / ms / 1e6
        rows.append({"act": act, "M": m, "F": f, "op": name, "config": cfg, "ms": ms, "GB/s": gbs,
                     "pct_copy": 100 * gbs / copy_gbs})

    if gated:
        def torch_fwd():
            g, u = h.chunk(2, dim=-1)
            return F.silu(g) * u
    else:
        approx = "tanh" if act == "gelu_tanh" else "none"

        def torch_fwd():
            return F.gelu(h, approximate=approx) if act != "relu" else F.relu(h)
    add("torch bf16 forward", None, median_ms(torch_fwd), m * fh * 2 + m * f * 2)
    if not gated and act != "relu":
        add("torch bf16 backward", None, median_ms(lambda: torch.ops.aten.gelu_backward(da, h, approximate=approx)),
            3 * m * f * 2)
    for cfg in configs:
        label = None if cfg is None else f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} p{cfg.programs_per_sm}"
        with activation.override_config(cfg) if cfg is not None else contextlib.nullcontext():
            for transpose in (False, True):
                t = " + transpose" if transpose else ""
                add(f"fp8 forward{t}", label, median_ms(lambda: activation.act_fwd_fp8(
                    h, act, out_f, out_ft if transpose else None, scale, scale_inv, amax)), fwd_bytes[transpose])
                add(f"fp8 backward + dbias{t}", label, median_ms(lambda: activation.act_bwd_fp8(
                    da, h, act, out_b, out_bt if transpose else None, scale, scale_inv, amax, dbias_out=dbias)),
                    bwd_bytes[transpose])
            if cfg is None and activation._FUSED_TRANSPOSE_ON_CUDA:  # the copy in a second launch, for comparison
                with separate_copy(activation):
                    add("fp8 forward + transpose (separate copy)", label, median_ms(lambda: activation.act_fwd_fp8(
                        h, act, out_f, out_ft, scale, scale_inv, amax)), fwd_bytes[True])
                    add("fp8 backward + dbias + transpose (separate copy)", label, median_ms(
                        lambda: activation.act_bwd_fp8(da, h, act, out_b, out_bt, scale, scale_inv, amax,
                                                       dbias_out=dbias)), bwd_bytes[True])
            # the dbias partial sums' own cost (the layers without fc1 bias skip them)
            add("fp8 backward, no dbias", label, median_ms(lambda: activation.act_bwd_fp8(
                da, h, act, out_b, None, scale, scale_inv, amax)), bwd_bytes[False])
    return rows, copy_gbs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--acts", default="gelu_tanh,swiglu,relu")
    p.add_argument("--sizes", default="4096x4096,8192x16384", help="MxF pairs")
    p.add_argument("--variants", action="store_true", help="also time the VARIANTS launch shapes")
    p.add_argument("--json", default="benchmarks/results/activation.json")
    args = p.parse_args()
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__}
    configs = [None] + (VARIANTS if args.variants else [])
    results, copies = [], {}
    for act in args.acts.split(","):
        for size in args.sizes.split(","):
            m, f = (int(v) for v in size.split("x"))
            rows, copy_gbs = run_size(act, m, f, configs)
            results += rows
            copies[size] = copy_gbs
    print(f"\nfused activation kernels -- {meta}")
    print("bf16 copy GB/s: " + ", ".join(f"{k}: {v:.0f}" for k, v in copies.items()))
    print(f"{'act':<10} {'M x F':<12} {'op':<34} {'launch (library = -)':<20} {'ms':>8} {'GB/s':>7} {'% copy':>7}")
    for r in results:
        print(f"{r['act']:<10} {r['M']}x{r['F']:<7} {r['op']:<34} {r['config'] or '-':<20} {r['ms']:>8.4f} "
              f"{r['GB/s']:>7.0f} {r['pct_copy']:>6.1f}%")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"meta": meta, "copy_GBps": copies, "rows": results}, fh, indent=1)


if __name__ == "__main__":
    main()
