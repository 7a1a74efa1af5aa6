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

from .quantizer import update_delayed_scales
from .recipe import DelayedScaling, Recipe, check_recipe

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

    enabled=False turns FP8 off inside (nested regions restore the outer state on exit).
    """

    def __init__(self, enabled: bool = True, recipe: Optional[Recipe] = None):
        if not isinstance(enabled, bool):
            raise ValueError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
        self.enabled = enabled
        self.recipe = check_recipe(recipe) if recipe is not None else DelayedScaling()

    def __enter__(self):
        stack = _stack()
        outer_enabled = any(enabled for enabled, _ in stack)
        stack.append((self.enabled, self.recipe))
        if self.enabled and not outer_enabled:
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


def active_recipe() -> Optional[Recipe]:
    """The recipe of the innermost autocast region, or None where FP8 is off."""
    stack = _stack()
    if not stack:
        return None
    enabled, recipe = stack[-1]
    return recipe if enabled else None
