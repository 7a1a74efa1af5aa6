"""The demo's settings: one frozen dataclass, a preset per device kind, and the CLI parser."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..models import GPTConfig
from ..recipe import CurrentScaling, DelayedScaling, Format, Recipe


@dataclass(frozen=True)
class DemoConfig:
    """One demo: three runs (BF16, FP8 delayed, FP8 current) of the same GPT on the same batches.

    Optimizer: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warmup to `lr`
    then cosine decay to `lr * min_lr_ratio`, gradient norm clipped to `grad_clip`.

    graphed: every run's training forward and backward replays CUDA graphs after a few eager
    steps (step.py); the optimizer, evaluations and inspection steps stay eager. CUDA only.
    fp8_format: the format of both FP8 recipes (HYBRID: e5m2 gradients; E4M3: e4m3 for all).
    """

    model: str = "tiny"          # GPTConfig preset (GPTConfig.named)
    steps: int = 120
    batch_size: int = 8          # sequences per step
    seq_len: int = 128           # bytes per sequence
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 12
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 20         # steps between validation evaluations (and the last step)
    eval_batches: int = 4        # fixed validation batches per evaluation
    log_every: int = 10          # steps between progress-bar loss updates (one host sync each)
    inspect_every: int = 20      # steps between numerics inspections of the FP8 runs
    seed: int = 0
    graphed: bool = False
    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        for f in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every", "inspect_every"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DemoConfig.{f} must be a positive int, got {v!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"DemoConfig.warmup must be an int >= 0, got {self.warmup!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"DemoConfig: need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")
        if not isinstance(self.graphed, bool):
            raise ValueError(f"DemoConfig.graphed must be a bool, got {self.graphed!r}")
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"DemoConfig.fp8_format must be a fp8train.Format, got {self.fp8_format!r}")
        GPTConfig.named(self.model)  # raises for an unknown preset

    def gpt_config(self) -> GPTConfig:
        """The model preset with its context set to the demo's sequence length."""
        return GPTConfig.named(self.model, seq_len=self.seq_len)

    def runs(self) -> Tuple[Tuple[str, Optional[Recipe]], ...]:
        """(name, recipe) of the three runs; None is the BF16 run, the reference of the gaps."""
        return (("bf16", None), ("fp8 delayed", DelayedScaling(fp8_format=self.fp8_format)),
                ("fp8 current", CurrentScaling(fp8_format=self.fp8_format)))

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


# CPU: the tiny model; 120 steps per run, 28 s for the three runs on 2 idle cores (AMD EPYC,
# 2026-12-01; the FP8 GEMMs are float32 matmuls of the FP8 values, gemm.emulated_scaled_mm).
# CUDA: GPT-2 small's shape on bytes (86M parameters), 16 x 1024 tokens per step, graphed:
# eager FP8 is host-bound at d_model 768 (0.47x BF16's tokens/s, docs/benchmarks.md).
PRESETS = {
    "cpu": DemoConfig(),
    "cuda": DemoConfig(model="gpt125m", steps=2000, batch_size=16, seq_len=1024, lr=6e-4, warmup=100,
                       eval_every=200, eval_batches=8, log_every=50, inspect_every=100, graphed=True),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fp8train demo",
        description="Train the same GPT on Python stdlib bytes in BF16, FP8 (DelayedScaling) and FP8 "
                    "(CurrentScaling) from the same initial weights; print a table and write loss.png, "
                    "scaling.png and report.json.")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--config", dest="model", metavar="NAME", help="GPT preset: tiny, small, gpt125m (default: tiny on CPU, "
                                                  "gpt125m on CUDA)")
    p.add_argument("--steps", type=int, help="training steps per run (CPU 120, CUDA 2000)")
    p.add_argument("--batch-size", type=int, help="sequences per step (CPU 8, CUDA 16)")
    p.add_argument("--seq-len", type=int, help="bytes per sequence (CPU 128, CUDA 1024)")
    p.add_argument("--lr", type=float, help="peak learning rate (CPU 3e-3, CUDA 6e-4)")
    p.add_argument("--warmup", type=int, help="linear warmup steps")
    p.add_argument("--eval-every", type=int, help="steps between validation evaluations")
    p.add_argument("--inspect-every", type=int, help="steps between numerics inspections")
    p.add_argument("--seed", type=int)
    p.add_argument("--graphed", action=argparse.BooleanOptionalAction,
                   help="replay each run's training forward+backward from CUDA graphs after a few eager steps "
                        "(default: on with CUDA; CUDA only)")
    p.add_argument("--fp8-format", choices=[f.value for f in Format],
                   help="FP8 format of both FP8 runs: hybrid (e4m3 forward, e5m2 gradients; default) or e4m3")
    p.add_argument("--out", default="demo_out", help="output folder (default: demo_out/)")
    p.add_argument("--replot", action="store_true",
                   help="train nothing: draw the figures again from --out's report.json and numerics logs")
    return p


def from_args(args: argparse.Namespace) -> tuple:
    """(DemoConfig, torch.device) from parsed arguments: the device's preset, then overrides."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fp8train demo: --device cuda, but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"fp8train demo: --device must be cpu or cuda, got {args.device!r}")
    if device.type == "cpu" and args.graphed:
        raise SystemExit("fp8train demo: --graphed needs CUDA (CUDA graphs do not exist on the CPU); "
                         "use --device cuda, or leave --graphed out (CPU runs train eagerly)")
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if "fp8_format" in overrides:
        overrides["fp8_format"] = Format(overrides["fp8_format"])
    preset = PRESETS[device.type]
    if "steps" in overrides and "warmup" not in overrides:
        overrides["warmup"] = min(preset.warmup, overrides["steps"] // 10)  # short runs warm up briefly
    try:
        return dataclasses.replace(preset, **overrides), device
    except ValueError as e:
        raise SystemExit(f"fp8train demo: {e}") from None


__all__ = ["DemoConfig", "PRESETS", "parser", "from_args"]
