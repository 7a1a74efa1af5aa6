"""The seed MLP training step (T1), side by side in one run (GPU machine).

LayerNorm -> Linear(h -> f) -> GELU(tanh) -> Linear(f -> h), MSE loss, backward, fused Adam,
`tokens` tokens of bf16 activations; default h=4096, f=16384, 8192 tokens (TARGETS.md T1;
`--small` runs h=1024, f=4096, 4096 tokens). Variants: BF16 eager, BF16 torch.compile,
fp8train LayerNormMLP with DelayedScaling and CurrentScaling; each with bf16 parameters and
with FP32 master parameters (torch.autocast for BF16; FP32 params and bf16 activations for
fp8train). torchao float8 joins when it is importable. Prints step times, the ratio to BF16
eager, and the per-kernel device-time breakdown of the fp8train step; writes JSON. Never
asserts on time.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os

import torch
import triton
import torch.nn.functional as F
from torch import nn

import fp8train


def torch_mlp(h, f, dtype, device):
    return nn.Sequential(nn.LayerNorm(h), nn.Linear(h, f), nn.GELU(approximate="tanh"), nn.Linear(f, h)).to(
        device=device, dtype=dtype)


def fp8_mlp(h, f, dtype, device):
    return fp8train.LayerNormMLP(h, f, activation="gelu_tanh", params_dtype=dtype, device=device)


def make_step(model, x, target, fp8_recipe=None, amp=False):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    fp8 = (lambda: fp8train.autocast(recipe=fp8_recipe)) if fp8_recipe is not None else contextlib.nullcontext
    amp_ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp else contextlib.nullcontext

    def step():
        with amp_ctx(), fp8():
            y = model(x)
        loss = F.mse_loss(y.float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def variants(h, f, device, compile_bf16):
    out = []
    for master in (False, True):
        pdtype = torch.float32 if master else torch.bfloat16
        tag = " fp32-master" if master else ""
        out.append((f"bf16 eager{tag}", lambda pd=pdtype, m=master: (torch_mlp(h, f, pd, device), None, m)))
        if compile_bf16:
            out.append((f"bf16 compile{tag}",
                        lambda pd=pdtype, m=master: (torch.compile(torch_mlp(h, f, pd, device)), None, m)))
        out.append((f"fp8train delayed{tag}",
                    lambda pd=pdtype: (fp8_mlp(h, f, pd, device), fp8train.DelayedScaling(), False)))
        out.append((f"fp8train current{tag}",
                    lambda pd=pdtype: (fp8_mlp(h, f, pd, device), fp8train.CurrentScaling(), False)))
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            continue
        for name in ("tensorwise", "rowwise"):
            def build(pd=pdtype, m=master, name=name):
                model = torch_mlp(h, f, pd, device)
                convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(name))
                return torch.compile(model), None, m
            out.append((f"torchao {name} compile{tag}", build))
    return out


def kernel_breakdown(step, iters=5):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters / 1e3, e.count // iters) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return [{"kernel": k[:100], "ms": ms, "per_step": n} for k, ms, n in rows]


def print_breakdown(title: str, kernels, top: int = 14) -> None:
    """One kernel_breakdown as a table: the top kernels by device time per step."""
    total = sum(k["ms"] for k in kernels)
    print(f"\n{title}: device time per step by kernel (sum {total:.3f} ms)")
    for k in kernels[:top]:
        print(f"  {k['ms']:7.3f} ms  x{k['per_step']:<3} {k['kernel'][:90]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="h=1024, f=4096, 4096 tokens")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile BF16 variant")
    p.add_argument("--json", default="benchmarks/results/mlp.json")
    args = p.parse_args()
    h, f, tokens = (1024, 4096, 4096) if args.small else (4096, 16384, 8192)
    device = torch.device("cuda")
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "h": h, "f": f, "tokens": tokens}
    torch.manual_seed(0)
    x = torch.randn(tokens // 2048 if tokens >= 2048 else 1, min(tokens, 2048), h, device=device,
                    dtype=torch.bfloat16)
    target = torch.randn(*x.shape, device=device)
    rows, base, breakdown = [], None, {}
    for name, build in variants(h, f, device, not args.no_compile):
        model, recipe, amp = build()
        step = make_step(model, x, target, recipe, amp)
        ms = triton.testing.do_bench(step, warmup=200, rep=1000, return_mode="median")
        base = base or ms
        rows.append({"variant": name, "ms": ms, "ratio_to_bf16_eager": ms / base})
        if name in ("fp8train delayed", "fp8train current"):
            breakdown[name] = kernel_breakdown(step)
        del model, step
        torch.cuda.empty_cache()

    print(f"\nMLP train step h={h} f={f} tokens={tokens} -- {meta['device']}, torch {meta['torch']}, "
          f"triton {meta['triton']}, {meta['date']}")
    print(f"{'variant':<34} {'ms':>8} {'vs bf16 eager':>14}")
    for r in rows:
        print(f"{r['variant']:<34} {r['ms']:>8.3f} {r['ratio_to_bf16_eager']:>13.2f}x")
    for name, kernels in breakdown.items():
        print_breakdown(name, kernels)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"meta": meta, "steps": rows, "breakdown": breakdown}, fh, indent=1)


if __name__ == "__main__":
    main()
