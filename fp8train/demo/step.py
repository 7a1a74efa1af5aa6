"""One training step of the demo, eager or replayed from CUDA graphs, and which steps are which.

A graphed run captures the training forward and backward (the loss included) once, after a
few eager steps: BF16 through torch.cuda.make_graphed_callables, FP8 through
fp8train.make_graphed_callables, whose graph holds the FP8 region (amax recording, the
delayed-scaling update). Each later step copies its batch into the graphs' static input
buffers and replays; the optimizer step (clipping, AdamW, the learning-rate schedule) stays
eager.

The graphs capture a wrapper module (`_LossModule`) whose forward they replace; the GPT's own
forward is untouched, so evaluations and inspection steps call it eagerly, on the same
parameters and quantizers as the graphs.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from ..autocast import autocast
from ..graphs import make_graphed_callables
from ..recipe import Recipe

Batch = Tuple[torch.Tensor, torch.Tensor]


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """model's mean cross-entropy on (x, y) with bf16 activations. torch.autocast runs without
    its weight-cast cache: graph capture refuses the cache, and it changes no value."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, cache_enabled=False):
        return model(x, y)[1]


def fp8_region(recipe: Optional[Recipe]):
    """fp8train.autocast(recipe) for an FP8 run; nothing for the BF16 run (recipe None)."""
    return autocast(recipe=recipe) if recipe is not None else nullcontext()


class _LossModule(nn.Module):
    """forward_loss as a module: what the graphs capture and whose forward they replace."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return forward_loss(self.model, x, y)


def capture_graphs(module: nn.Module, static: Batch, recipe: Optional[Recipe]) -> None:
    """Capture module's forward and backward on the static inputs (module.forward becomes the
    replay). FP8: the first region of the graph is the step's fp8train.autocast entry."""
    if recipe is None:
        torch.cuda.make_graphed_callables(module, static)
    else:
        make_graphed_callables(module, static, recipe=recipe)


Capture = Callable[[nn.Module, Batch, Optional[Recipe]], None]


class TrainStep:
    """Forward and backward of one training step (gradients land in the parameters' .grad),
    eagerly or from the graphs once `capture` has run."""

    def __init__(self, model: nn.Module, recipe: Optional[Recipe], capture: Capture = capture_graphs):
        self.model, self.recipe = model, recipe
        self._loss = _LossModule(model)
        self._capture = capture
        self.static: Optional[Batch] = None  # the graphs' input buffers (B, T) int64, once captured

    @property
    def graphed(self) -> bool:
        return self.static is not None

    def capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Capture on copies of (x, y), which stay the graphs' static input buffers. An FP8
        run must have run one eager step first (its quantizers exist and are calibrated)."""
        if self.graphed:
            raise RuntimeError("TrainStep.capture: the graphs are captured already")
        static = (x.clone(), y.clone())
        self._capture(self._loss, static, self.recipe)
        self.static = static

    def __call__(self, x: torch.Tensor, y: torch.Tensor, eager: bool = False) -> torch.Tensor:
        """The step's loss (detached). Eager (or not captured yet): the GPT's own forward inside
        the run's FP8 region. Graphed: the batch is copied into the static buffers and the
        graphs replay (no region around them: it is inside the graph)."""
        if self.graphed and not eager:
            sx, sy = self.static
            sx.copy_(x)
            sy.copy_(y)
            loss = self._loss(sx, sy)
        else:
            with fp8_region(self.recipe):
                loss = forward_loss(self.model, x, y)
        loss.backward()
        return loss.detach()


@dataclass(frozen=True)
class StepPlan:
    """Which steps of a run are eager, which replay the graphs, which count for tokens/s.

    untimed        the first steps, left out of tokens/s (first calls; in a graphed run also
                   the capture, which runs before step capture_at, and the first replays)
    capture_at     the graphs are captured before this step; None: the run is eager. Steps
                   before it run eagerly (FP8 capture needs an eager, calibrated step first)
    inspect_every  FP8 runs: every this many steps is an inspection step, eager (the
                   inspector's hooks do not fire in a replay) and untimed; None: no inspection
    """

    steps: int
    untimed: int
    capture_at: Optional[int]
    inspect_every: Optional[int]

    def __post_init__(self):
        if self.capture_at is not None and not 1 <= self.capture_at < self.steps:
            raise ValueError(f"StepPlan: capture_at must be in [1, steps={self.steps}), got {self.capture_at}")

    @classmethod
    def make(cls, steps: int, graphed: bool, inspect_every: Optional[int] = None) -> "StepPlan":
        """min(10, steps/5) untimed steps; a graphed run captures halfway through them (after
        at least one eager step), so the capture and the first replays stay untimed."""
        untimed = min(10, steps // 5)
        capture_at = max(1, untimed // 2) if graphed and steps > 1 else None
        return cls(steps, untimed, capture_at, inspect_every)

    def inspecting(self, step: int) -> bool:
        return self.inspect_every is not None and step % self.inspect_every == 0

    def replays(self, step: int) -> bool:
        return self.capture_at is not None and step >= self.capture_at and not self.inspecting(step)

    def timed(self, step: int) -> bool:
        return step >= self.untimed and not self.inspecting(step)


__all__ = ["TrainStep", "StepPlan", "forward_loss", "fp8_region", "capture_graphs"]
