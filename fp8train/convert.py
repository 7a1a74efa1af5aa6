"""`fp8train.convert`: swap a model's torch.nn.Linear layers for fp8train.Linear, in place."""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from . import gemm
from .modules.linear import Linear
from .recipe import Recipe, check_recipe

FilterFn = Callable[[str, nn.Module], bool]


def convert(model: nn.Module, recipe: Optional[Recipe] = None, filter_fn: Optional[FilterFn] = None) -> nn.Module:
    """Replace every torch.nn.Linear of `model` whose in/out features are multiples of 16
    (what FP8 GEMMs need) and that `filter_fn(qualified_name, module)` accepts by an
    fp8train.Linear holding the *same* Parameter objects (an optimizer built before the
    conversion keeps working), in place; returns `model`.

    Outside fp8train.autocast the converted model computes exactly what it computed before.
    recipe: when given, each new layer creates its quantizers for it now, so that a
    checkpoint taken before the first FP8 step already holds their (initial) state.
    Layers already converted, subclasses of nn.Linear with their own forward, and a `model`
    that is itself an nn.Linear are left alone (a root module cannot be replaced in place).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None:
        check_recipe(recipe)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"convert: filter_fn must be callable as filter_fn(name, module), got {filter_fn!r}")
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            qualified = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or not gemm.dims_ok(child.in_features, child.out_features):
                continue
            if filter_fn is not None and not filter_fn(qualified, child):
                continue
            setattr(parent, child_name, _from_linear(child, qualified, recipe))
    return model


def _from_linear(src: nn.Linear, name: str, recipe: Optional[Recipe]) -> Linear:
    if src._forward_hooks or src._forward_pre_hooks or src._backward_hooks:
        raise ValueError(f"convert: {name} has forward/backward hooks, which would be lost; remove them "
                         "first or exclude the layer with filter_fn")
    layer = Linear(src.in_features, src.out_features, bias=src.bias is not None, params_dtype=src.weight.dtype,
                   device="meta")  # parameters on meta: no allocation, replaced just below
    layer.weight = src.weight
    layer.bias = src.bias
    layer.train(src.training)
    layer.name = name
    if recipe is not None:
        layer.quantizers(recipe, src.weight.device)
    return layer


__all__ = ["convert"]
