"""A diagnostic recipe for benchmarks/numerics.py: delayed scaling with current scaling for
the tensor roles named (its `curinput`, `curweight` and `curgrad` words), to find which
role's delayed scale costs loss. Not a library recipe: fp8train's layers make their
quantizers through `fp8train.modules.base.make_quantizer`, which `installed()` wraps for a run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Tuple

from fp8train import DelayedScaling
from fp8train.modules import base
from fp8train.quantizer import CurrentScalingQuantizer
from fp8train.roles import TensorRole


@dataclass(frozen=True)
class MixedScaling(DelayedScaling):
    """DelayedScaling, except that the roles in `current_roles` are cast with current scaling."""

    current_roles: Tuple[TensorRole, ...] = ()


class CurrentInMixed(CurrentScalingQuantizer):
    """A current-scaling quantizer that a MixedScaling recipe keeps for one of its current roles
    (CurrentScalingQuantizer.matches takes CurrentScaling recipes only)."""

    def matches(self, recipe, role: TensorRole) -> bool:
        return (isinstance(recipe, MixedScaling) and role in recipe.current_roles
                and self.dtype == recipe.fp8_format.dtype(role))


_original = base.make_quantizer


def is_installed() -> bool:
    return base.make_quantizer is not _original


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Layers make CurrentInMixed quantizers for a MixedScaling recipe's current roles while
    inside. Convert the model inside too: a quantizer made before is delayed for every role
    (DelayedScalingQuantizer matches any DelayedScaling) and stays."""
    original = base.make_quantizer

    def make_quantizer(recipe, role: TensorRole, device=None):
        if isinstance(recipe, MixedScaling) and role in recipe.current_roles:
            return CurrentInMixed(role, recipe.fp8_format.dtype(role), device=device,
                                  power_of_two=recipe.power_of_two_scales)
        return original(recipe, role, device=device)

    base.make_quantizer = make_quantizer
    try:
        yield
    finally:
        base.make_quantizer = original
