"""FP8 loss against BF16 on a model nobody here wrote, over several seeds (issue 25; GPU machine).

The model and training are benchmarks/hf_llama.py's: a randomly initialised Hugging Face
`LlamaForCausalLM` over bytes of the Python standard library, FP32 master weights,
`torch.autocast(bfloat16)`, fused AdamW (lr 3e-4, betas 0.9/0.95). Per seed, every recipe
trains from the same initial weights on the same batches:

  bf16                       the model as it is (the baseline)
  fp8 delayed, fp8 current   fp8train.convert(model, recipe, not lm_head) under fp8train.autocast
  torchao tensorwise, torchao rowwise
                             torchao.float8 convert_to_float8_training (not lm_head), when
                             torchao imports (TARGETS.md: carry its wheel)
  fp8 <delayed|current> e4m3 / pow2 / pynode, fp8 delayed margin1 / hist16 / recent,
  fp8 block
                             on request (--recipes): e4m3 for every role (gradients too),
                             scales rounded down to powers of two (power_of_two_scales),
                             every layer through the Python node (the C++ node switched off),
                             delayed scales a binade lower (margin=1), from a 16-step history
                             or from the newest amax, or fp8train.BlockScaling
                             (1x128 / 128x128)

Runs (`--shapes`, as the issue's first measurements):
  h1024  hidden 1024, 4 layers, 1000 steps of 8 x 1024 tokens
  h2048  hidden 2048, 8 layers, 300 steps of 4 x 2048 tokens
  tiny   hidden 64, 2 layers, 30 steps of 2 x 64 (a smoke run, CPU included)
`--schedule const` (lr from step 0, no warm-up: the issue's runs) or `cosine` (linear warm-up
over `--warmup` steps, then cosine to 10%).

Reported per recipe: the final train loss (mean of the last 5% of steps) and validation loss
(`--val-batches` fixed batches), each as its gap to the same seed's BF16 run in percent, with
the mean, its standard error, standard deviation, min and max over the seeds; each recipe's
validation gap minus torchao tensorwise's in the same runs, paired per seed (the seed moves
both gaps alike: N1's "never worse than torchao in the same runs") and its train loss against
torchao's by quarter of the steps (where along the run a gap opens); BF16's own spread over
the seeds (the noise a gap must beat); for fp8train runs, `fp8train.inspect` statistics per tensor role
at the last inspection (mean over layers of saturation, flush to zero and SQNR, and the worst
layer), and per role the peak over every inspection of amax * scale / fp8_max (beyond
fp8_max plus half a step, 1.036 for e4m3 and 1.071 for e5m2, the cast clamped) and the share
of casts that clamped; `--inspect-every` sets how often. Loss curves of the first seed: a PNG through
fp8train.plots (`--png`). JSON (`--json`). Never asserts on loss.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_llama  # noqa: E402

import fp8train  # noqa: E402
from fp8train import scaling  # noqa: E402
from fp8train.data import ByteCorpus  # noqa: E402
from fp8train.kernels import native  # noqa: E402
from fp8train.recipe import Recipe  # noqa: E402


@dataclass(frozen=True)
class Run:
    shape: hf_llama.Shape
    steps: int


RUNS = {
    "h1024": Run(hf_llama.SHAPES["h1024"], 1000),
    "h2048": Run(replace(hf_llama.SHAPES["h2048"], batch=4, seq=2048), 300),
    "tiny": Run(hf_llama.SHAPES["tiny"], 30),
}
RECIPES = ["bf16", "fp8 delayed", "fp8 current", "torchao tensorwise", "torchao rowwise"]
# Run on request (--recipes), to find what a gap comes from: every format in e4m3 (the
# gradients too); scales rounded down to powers of two; the Python node instead of the C++
# one (pynode: not a recipe field, run_context switches kernels.native for that run); delayed
# scales one binade below fp8_max / amax (margin1: headroom for an amax that outgrows the
# history's, which the cast would otherwise clamp); delayed scales from a 16-step history or
# the newest amax alone (hist16, recent: a scale that follows the amaxes down instead of
# holding the run's largest)
EXTRA_RECIPES = ["fp8 delayed e4m3", "fp8 current e4m3", "fp8 delayed pow2", "fp8 current pow2", "fp8 delayed margin1",
                 "fp8 delayed hist16", "fp8 delayed recent", "fp8 delayed pynode", "fp8 current pynode",
                 "fp8 block"]
_OPTIONS = {"e4m3": {"fp8_format": fp8train.Format.E4M3}, "pow2": {"power_of_two_scales": True},
            "margin1": {"margin": 1}, "hist16": {"amax_history_len": 16},
            "recent": {"amax_compute_algo": "most_recent"}}


def lr_at(step: int, steps: int, schedule: str, warmup: int, lr: float) -> float:
    if schedule == "const":
        return lr
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def convert(recipe: str, model: torch.nn.Module) -> Optional[Recipe]:
    """Convert `model` in place for `recipe`; the fp8train recipe, or None."""
    kind, *rest = recipe.split()
    if kind == "fp8":
        unknown = [w for w in rest[1:] if w not in _OPTIONS and w != "pynode"]
        if unknown:
            raise ValueError(f"{recipe!r}: unknown option(s) {unknown}")
        options = {k: v for word in rest[1:] if word in _OPTIONS for k, v in _OPTIONS[word].items()}
        r = hf_llama.RECIPES[rest[0]](**options)
        fp8train.convert(model, r, filter_fn=hf_llama.not_lm_head)
        return r
    if kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(rest[0]),
                                   module_filter_fn=lambda m, fqn: hf_llama.not_lm_head(fqn))
    return None


@contextlib.contextmanager
def run_context(recipe: str):
    """What a request-only recipe changes outside its recipe object, for its run only: the
    C++ node off (pynode)."""
    native.ENABLED = "pynode" not in recipe.split()
    try:
        yield
    finally:
        native.ENABLED = True


def train(recipe: str, run: Run, seed: int, corpus: ByteCorpus, device: torch.device, args) -> Dict:
    """One training run; the batches depend on the seed only, never on the recipe."""
    model = hf_llama.build_llama(run.shape, device, seed=seed)
    fp8 = convert(recipe, model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    inspector = None
    if fp8 is not None and args.inspect_every > 0:
        inspector = fp8train.inspect.Inspector(model, every=args.inspect_every, sample=65536)
    shape = run.shape
    batches = torch.Generator().manual_seed(1000 + seed)
    val_gen = torch.Generator().manual_seed(12345)  # the same validation batches for every run
    val = [tuple(t.to(device) for t in corpus.batch("val", shape.batch, shape.seq, val_gen))
           for _ in range(args.val_batches)]

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        if fp8 is not None:
            stack.enter_context(fp8train.autocast(recipe=fp8))
        return stack

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), context():
            losses = [float(model(input_ids=x, labels=y).loss) for x, y in val]
        model.train()
        return statistics.fmean(losses)

    train_loss, val_loss = [], []
    for step in range(run.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, run.steps, args.schedule, args.warmup, args.lr)
        x, y = (t.to(device) for t in corpus.batch("train", shape.batch, shape.seq, batches))
        inspecting = inspector.step(step) if inspector is not None else contextlib.nullcontext()
        with inspecting:
            with context():
                loss = model(input_ids=x, labels=y).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_loss.append([step, float(loss)])  # one sync per step: a numerics run, not a timed one
        if (step + 1) % args.eval_every == 0 or step + 1 == run.steps:
            val_loss.append([step + 1, evaluate()])
    tail = max(1, run.steps // 20)
    out = {"recipe": recipe, "seed": seed, "final_train": statistics.fmean(v for _, v in train_loss[-tail:]),
           "final_val": val_loss[-1][1], "train_loss": train_loss, "val_loss": val_loss}
    if inspector is not None:
        inspector.close()
        out["inspect"] = last_inspection(inspector.records)
        out["inspect_peak"] = peak_overshoot(inspector.records)
    return out


def last_inspection(records: List[dict]) -> Dict[str, Dict]:
    """Per tensor role, at the last inspected step: the mean over layers of saturated,
    underflow and sqnr_db, and the layer with the most saturation and the one with the
    lowest SQNR."""
    if not records:
        return {}
    last = max(r["step"] for r in records)
    out = {}
    for role in sorted({r["role"] for r in records}):
        rows = [r for r in records if r["step"] == last and r["role"] == role]
        finite = [r for r in rows if r["sqnr_db"] is not None]
        out[role] = {
            "step": last,
            "saturated": statistics.fmean(r["saturated"] or 0.0 for r in rows),
            "underflow": statistics.fmean(r["underflow"] or 0.0 for r in rows),
            "sqnr_db": statistics.fmean(r["sqnr_db"] for r in finite) if finite else None,
            "most_saturated": max(rows, key=lambda r: r["saturated"] or 0.0)["layer"],
            "lowest_sqnr": min(finite, key=lambda r: r["sqnr_db"])["layer"] if finite else None,
        }
    return out


def peak_overshoot(records: List[dict]) -> Dict[str, Dict]:
    """Per tensor role, over every inspection: the largest amax * scale / fp8_max (a delayed
    scale that its tensor's amax outgrew: above 1.036 for e4m3, 1.071 for e5m2, the cast
    clamped that tensor's largest values), its step and layer, and the share of records
    whose cast clamped."""
    out = {}
    for role in sorted({r["role"] for r in records}):
        rows = []
        for r in records:
            if r["role"] == role and r["amax"] is not None and r["scale"] is not None:
                dtype = getattr(torch, r["dtype"])
                top = r["amax"] * r["scale"]
                rows.append((top / scaling.fp8_max(dtype), top > fp8train.inspect.CLAMP_FROM[dtype], r))
        if not rows:
            continue
        peak, _, rec = max(rows, key=lambda row: row[0])
        out[role] = {"overshoot": peak, "step": rec["step"], "layer": rec["layer"],
                     "clamped_share": sum(clamped for _, clamped, _ in rows) / len(rows)}
    return out


def spread(values: List[float]) -> Dict[str, float]:
    """Mean, sample standard deviation, min, max, count and the mean's standard error (std / sqrt(n))."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values),
            "n": len(values), "se": std / len(values) ** 0.5}


# The recipe that N1 says the default must never be worse than, in the same runs
REFERENCE = "torchao tensorwise"


def summarise(results: List[Dict]) -> Dict[str, Dict]:
    """Per recipe: gaps to the same seed's BF16 run of the same source (percent; runs merged
    from several files keep their file's index as `source`: a seed run twice is two samples,
    each against its own BF16, which is not deterministic), over the seeds; BF16's own final
    losses over the seeds; and where REFERENCE ran, each recipe's validation gap minus
    REFERENCE's in the same runs (paired by source and seed: what the seed moves in both cancels)."""
    def key(r):
        return r.get("source", 0), r["seed"]
    base = {key(r): r for r in results if r["recipe"] == "bf16"}
    out = {}
    for recipe in dict.fromkeys(r["recipe"] for r in results):
        rows = [r for r in results if r["recipe"] == recipe and key(r) in base]
        if recipe == "bf16":
            vals = [r["final_val"] for r in rows]
            out[recipe] = {"final_val": spread(vals), "final_train": spread([r["final_train"] for r in rows]),
                           "seed_spread_pct": 100 * (max(vals) - min(vals)) / statistics.fmean(vals)}
            continue
        gap = {k: [100 * (r[k] - base[key(r)][k]) / base[key(r)][k] for r in rows]
               for k in ("final_train", "final_val")}
        out[recipe] = {"val_gap_pct": spread(gap["final_val"]), "train_gap_pct": spread(gap["final_train"]),
                       "seeds": len(rows), "val_gaps": dict(zip(map(key, rows), gap["final_val"]))}
    gaps = {recipe: s.pop("val_gaps") for recipe, s in out.items() if recipe != "bf16"}
    ref = gaps.get(REFERENCE, {})
    for recipe, by_run in gaps.items():
        paired = [g - ref[k] for k, g in by_run.items() if k in ref]
        if recipe != REFERENCE and paired:
            out[recipe]["val_gap_vs_reference_pct"] = spread(paired)
    ref_runs = {key(r): r for r in results if r["recipe"] == REFERENCE}
    for recipe in out:
        pairs = [(r, ref_runs[key(r)]) for r in results
                 if r["recipe"] == recipe != REFERENCE and key(r) in ref_runs and r.get("train_loss")
                 and ref_runs[key(r)].get("train_loss")]
        if pairs:
            by_quarter = zip(*(quarter_gaps(r["train_loss"], q["train_loss"]) for r, q in pairs))
            out[recipe]["train_gap_vs_reference_by_quarter_pct"] = [statistics.fmean(g) for g in by_quarter]
    return out


def quarter_gaps(train_loss: List[list], reference: List[list]) -> List[float]:
    """The mean train loss over each quarter of the steps, against the reference run's over
    the same steps (percent): where along the run a gap opens."""
    ours, theirs = dict(train_loss), dict(reference)
    steps = sorted(set(ours) & set(theirs))
    quarters = [steps[len(steps) * i // 4:len(steps) * (i + 1) // 4] for i in range(4)]
    return [100 * (statistics.fmean(ours[s] for s in q) / statistics.fmean(theirs[s] for s in q) - 1)
            if q else float("nan") for q in quarters]


def print_summary(name: str, run: Run, summary: Dict, schedule: str) -> None:
    print(f"\n{name}: {run.shape}, {run.steps} steps, schedule {schedule}")
    b = summary.get("bf16")
    if b:
        print(f"  bf16: final val {b['final_val']['mean']:.4f} (seeds {b['final_val']['min']:.4f}.."
              f"{b['final_val']['max']:.4f}, spread {b['seed_spread_pct']:.2f}%)")
    print(f"  {'recipe':<20}{'val gap mean':>13}{'s.e.':>7}{'std':>7}{'min':>8}{'max':>8}{'train gap mean':>16}"
          f"  vs {REFERENCE}, paired (s.e.)")
    for recipe, s in summary.items():
        if recipe == "bf16":
            continue
        v, t = s["val_gap_pct"], s["train_gap_pct"]
        vs = s.get("val_gap_vs_reference_pct")
        paired = f"  {vs['mean']:>+6.2f}% (s.e. {vs['se']:.2f}%, {vs['n']} runs)" if vs else ""
        print(f"  {recipe:<20}{v['mean']:>+12.2f}%{v['se']:>6.2f}%{v['std']:>6.2f}%{v['min']:>+7.2f}%{v['max']:>+7.2f}%"
              f"{t['mean']:>+15.2f}%{paired}")
    quarters = {r: s["train_gap_vs_reference_by_quarter_pct"] for r, s in summary.items()
                if "train_gap_vs_reference_by_quarter_pct" in s}
    if quarters:
        print(f"  train loss against {REFERENCE} in the same runs, by quarter of the steps:")
        for recipe, q in quarters.items():
            print(f"  {recipe:<20}" + " / ".join(f"{g:+.2f}%" for g in q))


def merge(paths: List[str], out: Optional[str]) -> Dict:
    """The summary of the runs in several result files, shape by shape (same schedule)."""
    files = [json.loads(Path(p).read_text()) for p in paths]
    merged = {k: files[0][k] for k in ("date", "torch", "device", "schedule", "lr")}
    merged.update(merged_from=list(paths), shapes={})
    for name in dict.fromkeys(n for f in files for n in f["shapes"]):
        parts = [f["shapes"][name] for f in files if name in f["shapes"]]
        rows = [dict(r, source=i) for i, f in enumerate(files) if name in f["shapes"]
                for r in f["shapes"][name]["runs"]]
        summary = summarise(rows)
        run = Run(hf_llama.Shape(**parts[0]["shape"]), parts[0]["steps"])
        print_summary(name, run, summary, merged["schedule"])
        merged["shapes"][name] = {"shape": parts[0]["shape"], "steps": run.steps, "summary": summary, "runs": rows}
    if out:
        Path(out).write_text(json.dumps(merged, indent=1))
    return merged


def main(argv: Optional[List[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="h1024,h2048", help=f"comma-separated, of {sorted(RUNS)}")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, of: " + ", ".join(RECIPES + EXTRA_RECIPES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no training: the summary of the runs in these result files together (a run split by seeds)")
    p.add_argument("--steps", type=int, help="override every shape's step count")
    p.add_argument("--schedule", choices=["const", "cosine"], default="const")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps of the cosine schedule")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--inspect-every", type=int, default=250, help="0: no fp8train.inspect statistics")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--png", help="loss curves of the first seed of each shape: <png stem>_<shape>.png")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.json)
    device = torch.device(args.device)
    recipes = hf_llama.checked_variants(p, args.recipes.split(","), RECIPES + EXTRA_RECIPES)
    if "bf16" not in recipes:
        p.error("the gaps are to bf16: include it in --recipes")
    corpus = ByteCorpus.from_stdlib(max_bytes=4_000_000)
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "schedule": args.schedule, "lr": args.lr, "shapes": {}}
    for name in args.shapes.split(","):
        if name not in RUNS:
            p.error(f"unknown shape {name!r}; one of {sorted(RUNS)}")
        run = RUNS[name] if args.steps is None else Run(RUNS[name].shape, args.steps)
        rows = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for recipe in recipes:
                with run_context(recipe):
                    rows.append(train(recipe, run, seed, corpus, device, args))
                peak = "".join(f", {role} amax*scale/fp8_max peak {v['overshoot']:.2f} (step {v['step']})"
                               for role, v in rows[-1].get("inspect_peak", {}).items())
                print(f"  {name} seed {seed} {recipe}: final train {rows[-1]['final_train']:.4f}, "
                      f"val {rows[-1]['final_val']:.4f}{peak}", flush=True)
                # written after every run: a run cut short by a time limit keeps what finished
                results["shapes"][name] = {"shape": asdict(run.shape), "steps": run.steps,
                                           "summary": summarise(rows), "runs": rows}
                _write(results, args.json)
        print_summary(name, run, results["shapes"][name]["summary"], args.schedule)
        if args.png:
            from fp8train import plots
            plots.plot_losses([{"name": r["recipe"], "train_loss": r["train_loss"], "val_loss": r["val_loss"]}
                               for r in rows if r["seed"] == rows[0]["seed"]], f"{args.png}_{name}.png")
    _write(results, args.json)
    return results


def _write(results: Dict, path: Optional[str]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
