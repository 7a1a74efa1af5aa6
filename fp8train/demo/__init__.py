"""`fp8train demo`: the same GPT trained on Python stdlib bytes in BF16, FP8 with
DelayedScaling and FP8 with CurrentScaling, from the same initial weights on the same
batches (on CUDA with graphed training steps); a table, loss.png, scaling.png and
report.json in --out.
"""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import List

import torch

from ..data import ByteCorpus
from ..models import GPT
from .config import PRESETS, DemoConfig, from_args, parser
from .report import build_report, check_report, print_table, write_report
from .train import RunResult, train_run

def main(argv=None) -> List[RunResult]:
    args = parser().parse_args(argv)
    out = Path(args.out)
    if args.replot:
        replot(out)
        return []
    cfg, device = from_args(args)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    corpus = ByteCorpus.from_stdlib(device=device)
    gpt_cfg = cfg.gpt_config()
    torch.manual_seed(cfg.seed)
    base = GPT(gpt_cfg, device=device)  # every run trains a deep copy of these weights
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    val_batches = [corpus.batch("val", cfg.batch_size, cfg.seq_len, gen) for _ in range(cfg.eval_batches)]
    print(f"fp8train demo: GPT '{cfg.model}' ({n_params / 1e6:.1f}M parameters: {gpt_cfg.n_layer} layers, "
          f"d_model {gpt_cfg.d_model}) on {device}; {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} bytes "
          f"from {len(corpus.train_files)} stdlib files ({corpus.train.numel() / 1e6:.1f} MB; validation "
          f"{len(corpus.val_files)} files); AdamW lr {cfg.lr:g}, warmup {cfg.warmup}, cosine; FP8 format "
          f"{cfg.fp8_format.value}; training steps {'graphed (CUDA graphs)' if cfg.graphed else 'eager'}")
    results = []
    for name, recipe in cfg.runs():
        results.append(train_run(name, recipe, base, corpus, val_batches, cfg, device, out))
        gc.collect()  # the run's model leaves the delayed-scaling registry (weak references)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(results, device, cfg)
    corpus_info = {"source": "Python stdlib .py files, split by CRC32 of the relative path",
                   "train_files": len(corpus.train_files), "val_files": len(corpus.val_files),
                   "train_bytes": corpus.train.numel(), "val_bytes": corpus.val.numel()}
    report = build_report(cfg, n_params, device, corpus_info, results)
    report["files"] = _figures_or_note(report["runs"], out)
    write_report(report, out / "report.json")
    print(f"wrote {out / 'report.json'}, {', '.join(str(out / f) for f in report['files'].values())} "
          f"({time.perf_counter() - started:.0f} s in all)")
    return results


def replot(out: Path) -> None:
    """Draw the figures again from report.json and the numerics logs in `out` (e.g. a run
    from a machine without matplotlib)."""
    path = out / "report.json"
    try:
        report = json.loads(path.read_text())
        check_report(report)
    except (OSError, ValueError) as e:
        raise SystemExit(f"fp8train demo --replot: cannot use {path}: {e}") from None
    files = write_figures(report["runs"], out)
    print(f"wrote {', '.join(str(out / f) for f in files.values() if f.endswith('.png'))}")


def _figures_or_note(runs: List[dict], out: Path) -> dict:
    logs = {f"numerics {r['name']}": r["numerics_log"] for r in runs if r["numerics_log"]}
    try:
        return write_figures(runs, out)
    except ImportError:
        print("matplotlib is not installed: no figures drawn (pip install 'fp8train[plot]', then "
              f"`fp8train demo --replot --out {out}` draws them from report.json)")
        return logs


def write_figures(runs: List[dict], out: Path) -> dict:
    """loss.png, scaling.png (the first FP8 run's numerics, delayed scaling) and
    scaling_<run>.png for the further FP8 runs; returns {what: file name}, logs included.

    runs: report.json's runs (name, recipe, train_loss, val_loss, numerics_log)."""
    from ..inspect import load
    from ..plots import plot_losses, plot_numerics

    plot_losses(runs, out / "loss.png")
    files = {"loss": "loss.png"}
    for r in runs:
        if not r["numerics_log"]:
            continue
        key, fname = ("scaling", "scaling.png") if "scaling" not in files else \
            (f"scaling {r['name']}", f"scaling_{r['name'].replace(' ', '_')}.png")
        plot_numerics(load(out / r["numerics_log"]), out / fname, title=f"{r['name']} ({r['recipe'].split('(')[0]})")
        files[key] = fname
        files[f"numerics {r['name']}"] = r["numerics_log"]
    return files


__all__ = ["main", "replot", "write_figures", "DemoConfig", "PRESETS", "RunResult", "check_report"]
