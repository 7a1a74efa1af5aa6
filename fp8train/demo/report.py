"""The demo's outputs: the printed table and report.json (schema checked by `check_report`)."""
from __future__ import annotations

import dataclasses
import json
import math
import platform
from pathlib import Path
from typing import List

import torch

from .. import __version__
from ..recipe import Format
from .config import DemoConfig
from .train import RunResult

SCHEMA = "fp8train.demo.report/1"
SETUP = ("FP32 master weights; activations in bf16 under torch.autocast for every run; FP8 runs add "
         "fp8train.autocast(recipe) around the forward (fprop, dgrad and wgrad GEMMs in FP8); "
         "same initial weights and training batches for every run; config.graphed: every run's training "
         "forward and backward replay CUDA graphs after a few eager steps (optimizer, evaluations and "
         "inspection steps eager)")
# Top-level keys and per-run keys of report.json, with their types (what check_report enforces).
REPORT_KEYS = {"schema": str, "config": dict, "model": dict, "n_params": int, "setup": str, "versions": dict,
               "device": dict, "data": dict, "runs": list, "gaps": dict, "files": dict}
RUN_KEYS = {"name": str, "recipe": (str, type(None)), "final_train_loss": float, "final_val_loss": float,
            "tokens_per_s": (float, type(None)), "timed_steps": int, "timed_seconds": float,
            "train_loss": list, "val_loss": list, "numerics_log": (str, type(None))}
GAP_KEYS = {"train_rel": float, "val_rel": float, "speedup": (float, type(None))}


def _finite(v):
    return v if isinstance(v, float) and math.isfinite(v) else None


def versions() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"fp8train": __version__, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "capability": list(torch.cuda.get_device_capability(device))}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def gaps(results: List[RunResult]) -> dict:
    """Each FP8 run against the first (BF16) run: relative loss differences and speedup."""
    base = results[0]
    out = {}
    for r in results[1:]:
        speedup = r.tokens_per_s / base.tokens_per_s if base.tokens_per_s and base.tokens_per_s > 0 else None
        out[r.name] = {"train_rel": (r.final_train_loss - base.final_train_loss) / base.final_train_loss,
                       "val_rel": (r.final_val_loss - base.final_val_loss) / base.final_val_loss,
                       "speedup": _finite(speedup)}
    return out


def build_report(cfg: DemoConfig, n_params: int, device: torch.device, corpus_info: dict,
                 results: List[RunResult]) -> dict:
    """report.json's content; "files" (what else was written to --out) is filled by the caller."""
    runs = [{"name": r.name, "recipe": r.recipe, "final_train_loss": r.final_train_loss,
             "final_val_loss": r.final_val_loss, "tokens_per_s": _finite(r.tokens_per_s),
             "timed_steps": r.timed_steps, "timed_seconds": r.timed_seconds,
             "train_loss": [list(p) for p in r.train_loss], "val_loss": [list(p) for p in r.val_loss],
             "numerics_log": r.numerics_log} for r in results]
    return {"schema": SCHEMA, "config": config_dict(cfg), "model": dataclasses.asdict(cfg.gpt_config()),
            "n_params": n_params, "setup": SETUP, "versions": versions(), "device": device_info(device),
            "data": corpus_info, "runs": runs, "gaps": gaps(results), "files": {}}


def config_dict(cfg: DemoConfig) -> dict:
    """The config as JSON values: the FP8 format by its name ("hybrid" or "e4m3")."""
    out = dataclasses.asdict(cfg)
    out["fp8_format"] = cfg.fp8_format.value
    return out


def check_report(report: dict) -> None:
    """Raise ValueError naming the first key of `report` that is missing or of the wrong type."""
    def check(obj: dict, keys: dict, where: str):
        for k, t in keys.items():
            if k not in obj:
                raise ValueError(f"report.json: {where} has no {k!r}")
            if not isinstance(obj[k], t) or isinstance(obj[k], bool):
                raise ValueError(f"report.json: {where}[{k!r}] is {type(obj[k]).__name__}, expected {t}")
    check(report, REPORT_KEYS, "report")
    if report["schema"] != SCHEMA:
        raise ValueError(f"report.json: schema {report['schema']!r}, expected {SCHEMA!r}")
    for i, run in enumerate(report["runs"]):
        check(run, RUN_KEYS, f"runs[{i}]")
    for name, gap in report["gaps"].items():
        check(gap, GAP_KEYS, f"gaps[{name!r}]")


def write_report(report: dict, path: Path) -> None:
    check_report(report)
    path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")


def print_table(results: List[RunResult], device: torch.device, cfg: DemoConfig) -> None:
    base = results[0]
    g = gaps(results)
    formats = {Format.HYBRID: "e4m3 forward, e5m2 gradients", Format.E4M3: "e4m3 forward and gradients"}
    print(f"\nFP8 format {cfg.fp8_format.value} ({formats[cfg.fp8_format]}); training steps "
          f"{'replayed from CUDA graphs' if cfg.graphed else 'eager'}")
    print(f"{'run':<13}{'train loss':>11}{'val loss':>10}{'train gap':>11}{'val gap':>9}{'tokens/s':>11}"
          f"{'speedup':>9}")
    for r in results:
        gap = g.get(r.name, {"train_rel": 0.0, "val_rel": 0.0, "speedup": 1.0})
        speedup = f"{gap['speedup']:.2f}x" if gap["speedup"] is not None else "-"
        tps = f"{r.tokens_per_s:.0f}" if math.isfinite(r.tokens_per_s) else "-"
        print(f"{r.name:<13}{r.final_train_loss:>11.4f}{r.final_val_loss:>10.4f}{gap['train_rel']:>+11.2%}"
              f"{gap['val_rel']:>+9.2%}{tps:>11}{speedup:>9}")
    print(f"(train loss: mean of the last 10% of steps; val loss: {base.val_loss[-1][0]} steps, fixed validation "
          "batches; gaps: relative to bf16; tokens/s: training steps only, without warmup (and graph capture), "
          "evaluation and inspection steps)")
    if device.type == "cpu":
        print("(on CPU the FP8 GEMMs run as float32 matmuls of the FP8 values (gemm.emulated_scaled_mm) and casts as "
              "pure-torch reference kernels: tokens/s and speedup say nothing about FP8 on a GPU)")


__all__ = ["SCHEMA", "build_report", "check_report", "config_dict", "write_report", "print_table", "gaps"]
