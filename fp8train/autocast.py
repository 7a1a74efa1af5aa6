"""`fp8train.autocast`: which recipe is active, and when delayed scales update.

One enabled autocast region is one step (or one microbatch): entering the outermost
enabled region first runs the per-step update of every delayed-scaling quantizer (one
launch), so the casts inside use scales from every amax recorded before, forward and
backward alike. The backward pass may run after the region has exited: each layer's
autograd function keeps the recipe and quantizers it was called with.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

from .quantizer import _REGISTRY, update_delayed_scales
from .recipe import Recipe, check_recipe, default_recipe

_local = threading.local()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class autocast:
    """Run fp8train modules in FP8 inside this context.

        with fp8train.autocast(recipe=fp8train.DelayedScaling()):
            loss = loss_fn(model(x), y)
        loss.backward()

    recipe: default `recipe.default_recipe()`, CurrentScaling.
    enabled=False turns FP8 off inside (nested regions restore the outer state on exit).

    amax_reduction: with tensor (or data) parallelism, a process group or a
    `fp8train.distributed.AmaxReduction`: on entry, before the delayed-scaling update, the
    pending amax of every live delayed-scaling quantizer becomes its maximum over the groups
    (one all-reduce per group for all of them: distributed.reduce_delayed_amaxes), so every
    rank computes the same scales. Every rank must enter with the same groups and hold the
    same FP8 layers, created in the same order (quantizers are matched by creation order).
    """

    def __init__(self, enabled: bool = True, recipe: Optional[Recipe] = None, amax_reduction=None):
        if not isinstance(enabled, bool):
            raise ValueError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
        self.enabled = enabled
        self.recipe = check_recipe(recipe) if recipe is not None else default_recipe()
        self.amax_reduction = amax_reduction

    def __enter__(self):
        stack = _stack()
        outer_enabled = any(enabled for enabled, _ in stack)
        stack.append((self.enabled, self.recipe))
        if self.enabled and not outer_enabled:
            _local.regions = region() + 1
            if self.amax_reduction is not None:
                from .distributed.amax_sync import reduce_delayed_amaxes  # torch.distributed only when asked
                reduce_delayed_amaxes(_REGISTRY.live(), self.amax_reduction)
            update_delayed_scales()
        return self

    def __exit__(self, *exc):
        _stack().pop()
        return False


@contextlib.contextmanager
def recipe_without_step(recipe: Recipe) -> Iterator[None]:
    """FP8 on with `recipe` for work that is not a training step (auto-precision
    measurements): unlike `autocast`, entering it never runs the delayed-scaling update."""
    stack = _stack()
    stack.append((True, recipe))
    try:
        yield
    finally:
        stack.pop()


def region() -> int:
    """How many outermost enabled autocast regions this thread has entered: what tells two
    calls of one step (one region) from calls of different steps."""
    return getattr(_local, "regions", 0)


def active_recipe() -> Optional[Recipe]:
    """The recipe of the innermost autocast region, or None where FP8 is off."""
    stack = _stack()
    if not stack:
        return None
    enabled, recipe = stack[-1]
    return recipe if enabled else None


def call_recipe(module) -> Optional[Recipe]:
    """The recipe `module`'s forward runs by (None: high precision): the active one, noted in
    module._forward_recipe; in a forward that runs inside a backward pass, the one noted by
    the module's last forward outside it. Such a forward is activation checkpointing's
    recomputation (torch.utils.checkpoint, reentrant or not; HF's
    gradient_checkpointing_enable): it runs after fp8train.autocast has exited, and on the GPU
    in the autograd engine's thread, which sees no region, so the active recipe would be none
    and the recomputation would run in high precision where the forward ran in FP8
    (non-reentrant checkpointing then refuses the saved tensors; reentrant would silently run
    the backward in high precision). The recomputation casts what the forward cast with the
    same scales: delayed scales update on the next autocast entry only, current ones follow
    from x. Traced code: the active recipe."""
    if torch.compiler.is_compiling():
        return active_recipe()
    if torch._C._current_graph_task_id() != -1:
        return module._forward_recipe
    recipe = active_recipe()
    if recipe is not module._forward_recipe:  # nn.Module.__setattr__ costs host time: only on a change
        module._forward_recipe = recipe
    return recipe
