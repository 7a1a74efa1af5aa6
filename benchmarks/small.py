"""Small and medium MLP training steps: does FP8 ever make a model slower? (GPU machine)

LayerNorm -> Linear(h -> 4h) -> GELU(tanh) -> Linear(4h -> h), MSE, backward, fused Adam,
4096 tokens of bf16, bf16 parameters, for h in 512, 1024, 2048, 4096 (issue: FP8 that pays
at every size). Variants, side by side per size: BF16 eager; BF16 with forward+backward in
CUDA graphs (torch.cuda.make_graphed_callables); fp8train LayerNormMLP (delayed scaling)
graphed (fp8train.make_graphed_callables, after one eager step), eager, and eager with
`auto_precision=True` (fp8train/precision.py measures each layer shape once and keeps the
faster path); BF16 and fp8train with the whole step (loss and Adam too) in one CUDA graph
(torch.cuda.graph, capturable Adam), where the wall time is the device's; torchao float8
tensorwise compiled, default and "reduce-overhead", at h=1024 when importable
(`--torchao-all` for every size). Loss and Adam stay eager in every other variant. Every
variant is built and timed once per round (--rounds, default 5; each round starts one
variant later than the previous, so no variant always follows the same one).
A variant's time is its steps issued back to back, as training issues them, with one sync
at each end of the timed block (`time_steps`): not triton's do_bench, which puts a 256 MB
L2 flush and a pair of events between steps; on a host-bound step that measures the host's
gaps around those extra launches as much as the step. Rounds lie seconds apart (builds,
captures), and the host drifts between them, so after the rounds auto precision and BF16
eager are also timed interleaved in a b b a blocks (precision.time_pair): the auto-precision
target's measurement.
Prints a table with each variant's median and its ratio to BF16 eager, its fastest round
and that ratio (on a host-bound step the fastest round is the one the host disturbed
least), the auto-precision report and the host time of one fwd+bwd of a 1024 x 1024 FP8
Linear against nn.Linear's (linear.py's host_time), so one run shows the issue's three
targets; writes JSON. Never asserts on time.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import triton

import fp8train
from fp8train import precision
from fp8train.quantizer import _REGISTRY

sys.path.insert(0, os.path.dirname(__file__))
from linear import host_time  # noqa: E402
from mlp import fp8_mlp, kernel_breakdown, make_step, print_breakdown, torch_mlp  # noqa: E402


def time_steps(step, block_ms: float = 300.0, warmup: int = 20) -> float:
    """ms per step: `warmup` steps, then a block of back-to-back steps lasting about
    `block_ms` (its length from the warm-up's rate), timed from one device sync to the next.
    The first step runs before the warm-up's clock starts (auto precision measures in it)."""
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    iters = max(10, int(block_ms / max((time.perf_counter() - t0) * 1e3 / warmup, 1e-3)))
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def graphed_bf16(h, f, device, x, target):
    """BF16 forward+backward replayed from CUDA graphs; loss and Adam stay eager."""
    model = torch_mlp(h, f, torch.bfloat16, device)
    graphed = torch.cuda.make_graphed_callables(model, (x.detach().clone(),))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step():
        y = graphed(x)
        torch.nn.functional.mse_loss(y.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, model


def graphed_fp8(h, f, device, x, target):
    """fp8train's forward+backward (with the delayed update) replayed from CUDA graphs after
    one eager step; loss and Adam stay eager, as for BF16."""
    model = fp8_mlp(h, f, torch.bfloat16, device)
    recipe = fp8train.DelayedScaling()
    eager_step = make_step(model, x, target, recipe)
    eager_step()
    fp8train.make_graphed_callables(model, (x.detach().clone(),), recipe=recipe)
    return make_step(model, x, target), model  # no autocast around replays: the FP8 region is in the graph


def whole_step_graphed(model, x, target, recipe=None):
    """The whole training step (forward, MSE, backward, fused Adam) replayed from one CUDA
    graph (torch.cuda.graph; Adam with capturable=True), BF16 and fp8train alike: the host
    issues one replay per step, so the step's wall time is its device time. fp8train's
    forward runs under fp8train.autocast inside the graph (the delayed-scaling update is
    captured with it) after three eager warm-up steps (calibration, prepared launches)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True, capturable=True)
    static_x = x.detach().clone()
    region = (lambda: fp8train.autocast(recipe=recipe)) if recipe is not None else contextlib.nullcontext

    def body():
        with region():
            y = model(static_x)
        torch.nn.functional.mse_loss(y.float(), target).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # the captured backward makes the .grad tensors, static from then on
    with torch.cuda.graph(graph):
        body()
    # the scale update's pointer tables must live as long as the graph (fp8train/graphs.py)
    keep = (_REGISTRY.batches(), graph, opt, static_x)

    def step():
        graph.replay()
    step.keep = keep
    return step, model


def variants(h, device, x, target, with_torchao):
    """(name, build) pairs; build() returns (step, model)."""
    f = 4 * h

    def eager(model, recipe=None):
        return make_step(model, x, target, recipe), model

    out = [("bf16 eager", lambda: eager(torch_mlp(h, f, torch.bfloat16, device))),
           ("bf16 graphed", lambda: graphed_bf16(h, f, device, x, target)),
           ("fp8train graphed", lambda: graphed_fp8(h, f, device, x, target)),
           ("fp8train eager", lambda: eager(fp8_mlp(h, f, torch.bfloat16, device), fp8train.DelayedScaling())),
           ("fp8train eager auto", lambda: eager(fp8_mlp(h, f, torch.bfloat16, device),
                                                 fp8train.DelayedScaling(auto_precision=True))),
           ("bf16 whole step graphed", lambda: whole_step_graphed(torch_mlp(h, f, torch.bfloat16, device), x,
                                                                  target)),
           ("fp8train whole step graphed", lambda: whole_step_graphed(fp8_mlp(h, f, torch.bfloat16, device), x,
                                                                      target, fp8train.DelayedScaling()))]
    if with_torchao:
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            return out
        for mode in ("default", "reduce-overhead"):
            def build(mode=mode):
                model = torch_mlp(h, f, torch.bfloat16, device)
                convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
                return eager(torch.compile(model, mode=mode))
            out.append((f"torchao compile {mode}", build))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="512,1024,2048,4096")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--torchao-all", action="store_true", help="torchao at every size, not only h=1024")
    p.add_argument("--profile", type=int, default=1024,
                   help="print the per-kernel device time of the graphed variants at this h (0: none)")
    p.add_argument("--rounds", type=int, default=5, help="times each variant is built and timed (median)")
    p.add_argument("--pair-blocks", type=int, default=7,
                   help="a b b a blocks of the interleaved auto-precision vs BF16 eager timing")
    p.add_argument("--json", default="benchmarks/results/small.json")
    args = p.parse_args()
    device = torch.device("cuda")
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "tokens": args.tokens}
    results, reports, profiles, interleaved = [], [], {}, []
    failed: dict = {}  # variant -> why it could not run
    for h in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        x = torch.randn(args.tokens, h, device=device, dtype=torch.bfloat16)
        target = torch.randn(args.tokens, h, device=device)
        # The host of the GPU machine moves step times by +-20% between runs, so every
        # variant is built and timed once per round, rounds one after another, and the table
        # takes each variant's median: the ratios compare times taken side by side. Each
        # round starts one variant later than the one before (a rotation), so no variant
        # always runs in the same place, e.g. always right after the slowest one.
        samples: dict = {name: [] for name, _ in variants(h, device, x, target, False)}
        for r in range(args.rounds):
            # torchao's compiled variants are timed in the first round only (compiling takes
            # tens of seconds per variant)
            order = variants(h, device, x, target, r == 0 and (args.torchao_all or h == 1024))
            shift = r % len(order)
            for name, build in order[shift:] + order[:shift]:
                if name in failed:
                    continue
                try:
                    step, model = build()
                    ms = time_steps(step)
                except RuntimeError as e:
                    if "whole step" not in name:
                        raise
                    # the whole-step capture is the newest variant: its failure is reported, and
                    # the rest of the run goes on without it
                    failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    samples.pop(name, None)
                    torch.cuda.synchronize()
                    continue
                samples.setdefault(name, []).append(ms)
                if r == 0 and h == args.profile and name in ("bf16 graphed", "fp8train graphed"):
                    profiles[name] = kernel_breakdown(step)
                if r == 0 and name == "fp8train eager auto":
                    reports.append(precision.report(torch.nn.ModuleDict({f"h{h}": model})))
                # Free the variant (graphed modules hold reference cycles) before the next one:
                # the delayed-scaling update at each autocast entry covers every live layer.
                del step, model
                gc.collect()
                torch.cuda.empty_cache()
        # Auto precision against BF16 eager once more, interleaved finely: both steps built and
        # kept, timed in a b b a blocks of 50 steps each (precision.time_pair, the method auto
        # precision decides by), so the host's drift between the rounds' variants cancels.
        steps = [make_step(torch_mlp(h, 4 * h, torch.bfloat16, device), x, target),
                 make_step(fp8_mlp(h, 4 * h, torch.bfloat16, device), x, target,
                           fp8train.DelayedScaling(auto_precision=True))]
        steps[1]()  # the auto-precision decision (a table lookup: measured in the rounds above)
        bf16_ms, auto_ms = precision.time_pair(*steps, device, warmup=20, iters=50, blocks=args.pair_blocks)
        interleaved.append({"h": h, "bf16_eager_ms": bf16_ms, "auto_ms": auto_ms, "ratio": auto_ms / bf16_ms})
        del steps
        gc.collect()
        torch.cuda.empty_cache()
        base, base_min = statistics.median(samples["bf16 eager"]), min(samples["bf16 eager"])
        for name, ms in samples.items():
            if not ms:  # a variant that failed (see `failed`)
                continue
            med = statistics.median(ms)
            # the median of each round's own ratio: a host that drifts between rounds moves
            # both times of a round together, so this is steadier than a ratio of medians
            paired = statistics.median(m / b for m, b in zip(ms, samples["bf16 eager"]))
            results.append({"h": h, "variant": name, "ms": med, "ratio_to_bf16_eager": med / base,
                            "paired_ratio_to_bf16_eager": paired, "min_ms": min(ms),
                            "min_ratio_to_bf16_eager": min(ms) / base_min, "rounds_ms": ms})

    print(f"\nMLP train step, {args.tokens} tokens -- {meta['device']}, torch {meta['torch']}, "
          f"triton {meta['triton']}, {meta['date']}")
    print(f"(median of {args.rounds} rounds, the median of the rounds' own ratios ('paired'), and the fastest "
          "round; each round builds and times every variant in turn)")
    print(f"{'h':>6} {'variant':<28} {'ms':>8} {'vs bf16 eager':>14} {'paired':>7} {'min ms':>8} {'min vs':>7}  "
          f"{'rounds ms':<24}")
    for r in results:
        rounds = " ".join(f"{v:.3f}" for v in r["rounds_ms"])
        print(f"{r['h']:>6} {r['variant']:<28} {r['ms']:>8.3f} {r['ratio_to_bf16_eager']:>13.2f}x "
              f"{r['paired_ratio_to_bf16_eager']:>6.2f}x {r['min_ms']:>8.3f} {r['min_ratio_to_bf16_eager']:>6.2f}x  "
              f"{rounds}")
    for name, kernels in profiles.items():
        print_breakdown(f"{name} at h={args.profile}", kernels, top=16)
    if len(profiles) == 2:  # the graphed steps' device time alone: what the step costs where the host keeps up
        device_ms = {name: sum(k["ms"] for k in kernels) for name, kernels in profiles.items()}
        print(f"\ndevice time per graphed step at h={args.profile}: fp8train {device_ms['fp8train graphed']:.3f} ms, "
              f"BF16 {device_ms['bf16 graphed']:.3f} ms: "
              f"{device_ms['fp8train graphed'] / device_ms['bf16 graphed']:.2f}x (the wall-time ratio above is the "
              "host's where it is the bound)")
    print("\nwhole training step in one CUDA graph (loss and Adam captured too; wall time = device time), "
          "fp8train / BF16 (T2: <= 0.90 at h=1024):")
    for h in sorted({r["h"] for r in results}):
        rows = {r["variant"]: r for r in results if r["h"] == h}
        fp8, bf16 = rows.get("fp8train whole step graphed"), rows.get("bf16 whole step graphed")
        if fp8 is not None and bf16 is not None:
            paired = statistics.median(a / b for a, b in zip(fp8["rounds_ms"], bf16["rounds_ms"]))
            print(f"  h={h:<5} {fp8['ms']:.3f} / {bf16['ms']:.3f} ms = {fp8['ms'] / bf16['ms']:.2f}x "
                  f"(paired by round: {paired:.2f}x)")
    for name, why in failed.items():
        print(f"\n{name}: not measured ({why})")
    print("\nauto precision choices:")
    for text in reports:
        print(text)
    print("\nfp8train eager auto against BF16 eager, interleaved (a b b a blocks of 50 steps, median block ratio; "
          "target <= 1.0 at every size):")
    for r in interleaved:
        print(f"  h={r['h']:<5} {r['auto_ms']:.3f} / {r['bf16_eager_ms']:.3f} ms = {r['ratio']:.2f}x")
    # the third target: host time of one fwd+bwd of a 1024 x 1024 layer on 256
    # tokens against nn.Linear's, measured here too so one run shows all three
    host = host_time(device)
    print("\nhost time per fwd+bwd, 1024 x 1024 layer, 256 tokens (target: <= 1.5x nn.Linear; median of the "
          "rounds, then the median of the rounds' own ratios)")
    for r in host:
        print(f"  {r['kind']:<26} {r['host_us']:>8.1f} us {r['ratio_to_nn_linear']:>7.2f}x "
              f"(paired {r['paired_ratio_to_nn_linear']:.2f}x)")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"meta": meta, "steps": results, "failed": failed, "auto_precision": reports, "profiles": profiles,
                   "auto_interleaved": interleaved, "host_time": host}, fh, indent=1)


if __name__ == "__main__":
    main()
