"""One demo run: train a copy of the GPT with one precision setup and measure it.

Every run: FP32 master weights, activations in bf16 under torch.autocast, and for the FP8
runs fp8train.autocast(recipe) around the forward; with cfg.graphed the training forward and
backward replay CUDA graphs (step.py). Losses stay on the device; the host reads them only
every `log_every` steps (progress bar), at evaluations and at the end.
"""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from tqdm import tqdm

from ..data import ByteCorpus
from ..inspect import Inspector
from ..models import GPT
from ..recipe import Recipe
from .config import DemoConfig
from .step import Batch, Capture, StepPlan, TrainStep, capture_graphs, forward_loss, fp8_region


@dataclass
class RunResult:
    name: str
    recipe: Optional[str]
    train_loss: List[Tuple[int, float]]      # (step, loss) of every step
    val_loss: List[Tuple[int, float]]        # (step, mean loss over the fixed validation batches)
    tokens_per_s: float
    timed_steps: int
    timed_seconds: float
    numerics_log: Optional[str] = None       # the Inspector's JSON-lines file in --out (FP8 runs)

    @property
    def final_train_loss(self) -> float:
        """Mean training loss of the last 10% of steps (a single step's loss is noisy)."""
        tail = [v for _, v in self.train_loss[-max(1, len(self.train_loss) // 10):]]
        return sum(tail) / len(tail)

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1][1]


class Throughput:
    """Seconds and steps of plain training steps only: segments between host syncs, with
    warmup, evaluations and inspection steps left out (they end and restart a segment)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.steps = device, 0.0, 0
        self._start: Optional[float] = None
        self._n = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def segment(self, on: bool) -> None:
        """Start a segment if `on` and none runs; end the running one if not."""
        if on and self._start is None:
            self.start()
        elif not on:
            self.stop()

    def start(self) -> None:
        self._sync()
        self._start, self._n = time.perf_counter(), 0

    def count(self) -> None:
        if self._start is not None:
            self._n += 1

    def stop(self) -> None:
        if self._start is not None:
            self._sync()
            self.seconds += time.perf_counter() - self._start
            self.steps += self._n
            self._start = None


def make_optimizer(model: torch.nn.Module, cfg: DemoConfig, device: torch.device) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def evaluate(model: GPT, batches: List[Batch], recipe: Optional[Recipe]) -> float:
    """Mean loss over the fixed validation batches, in the run's own precision, through the
    GPT's eager forward (also in a graphed run). For FP8 all batches run in one
    fp8train.autocast region: one delayed-scaling step, not one per batch."""
    model.eval()
    with torch.no_grad(), fp8_region(recipe):
        loss = torch.stack([forward_loss(model, x, y) for x, y in batches]).mean().item()
    model.train()
    return loss


def train_run(name: str, recipe: Optional[Recipe], base: GPT, corpus: ByteCorpus, val_batches: List[Batch],
              cfg: DemoConfig, device: torch.device, out: Path) -> RunResult:
    """Train a deep copy of `base`, so that every run starts from the same weights."""
    return train_model(copy.deepcopy(base), name, recipe, corpus, val_batches, cfg, device, out)


def train_model(model: GPT, name: str, recipe: Optional[Recipe], corpus: ByteCorpus, val_batches: List[Batch],
                cfg: DemoConfig, device: torch.device, out: Path, capture: Capture = capture_graphs) -> RunResult:
    """Train `model` in place for cfg.steps steps on the batches of a generator seeded with
    cfg.seed. capture: how a graphed run (cfg.graphed) captures its step (tests pass their own)."""
    opt = make_optimizer(model, cfg, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    slug = name.replace(" ", "_")
    inspector = Inspector(model, every=cfg.inspect_every, path=out / f"numerics_{slug}.jsonl") if recipe else None
    plan = StepPlan.make(cfg.steps, cfg.graphed, cfg.inspect_every if inspector is not None else None)
    train_step = TrainStep(model, recipe, capture)
    losses = torch.empty(cfg.steps, device=device)
    val: List[Tuple[int, float]] = []
    clock = Throughput(device)
    bar = tqdm(total=cfg.steps, desc=f"{name:>12}", dynamic_ncols=True, leave=True)
    postfix = {"loss": "-", "val": "-"}
    for step in range(cfg.steps):
        x, y = corpus.batch("train", cfg.batch_size, cfg.seq_len, gen)
        if step == plan.capture_at:
            clock.stop()
            train_step.capture(x, y)
        clock.segment(plan.timed(step))
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=True)
        with inspector.step(step) if inspector is not None else nullcontext():
            losses[step] = train_step(x, y, eager=not plan.replays(step))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if plan.timed(step):
            clock.count()
        last = step == cfg.steps - 1
        if (step + 1) % cfg.eval_every == 0 or last:
            clock.stop()
            val.append((step + 1, evaluate(model, val_batches, recipe)))
            postfix["val"] = f"{val[-1][1]:.4f}"
        if (step + 1) % cfg.log_every == 0 or last:
            postfix["loss"] = f"{losses[step].item():.4f}"  # the one host sync of log_every steps
            bar.set_postfix(postfix, refresh=False)
        bar.update()
    clock.stop()
    bar.close()
    if inspector is not None:
        inspector.close()
    tokens = clock.steps * cfg.batch_size * cfg.seq_len
    return RunResult(
        name=name, recipe=repr(recipe) if recipe is not None else None,
        train_loss=list(enumerate(losses.tolist(), start=1)), val_loss=val,
        tokens_per_s=tokens / clock.seconds if clock.seconds > 0 else float("nan"),
        timed_steps=clock.steps, timed_seconds=clock.seconds,
        numerics_log=str(inspector.path.name) if inspector is not None else None)


__all__ = ["RunResult", "Throughput", "train_run", "train_model", "evaluate", "make_optimizer"]
