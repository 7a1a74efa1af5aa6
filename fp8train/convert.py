"""`fp8train.convert`: swap a model's torch.nn.Linear layers for fp8train.Linear, in place."""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import nn

from . import gemm
from .coverage import not_linear_summary
from .autocast import active_recipe
from .modules.linear import Linear
from .modules.gated_mlp import GatedMLP
from .modules.rms_norm import RMSNorm
from .recipe import Recipe, check_recipe

FilterFn = Callable[[str, nn.Module], bool]


def convert(model: nn.Module, recipe: Optional[Recipe] = None, filter_fn: Optional[FilterFn] = None, *,
            fuse_norms: bool = True, fuse_mlps: bool = True) -> nn.Module:
    """Replace every torch.nn.Linear of `model` whose in/out features are multiples of 16
    (what FP8 GEMMs need) and that `filter_fn(qualified_name, module)` accepts by an
    fp8train.Linear holding the *same* Parameter objects (an optimizer built before the
    conversion keeps working), in place; returns `model`.

    Outside fp8train.autocast the converted model computes exactly what it computed before.
    recipe: when given, each new layer creates its quantizers for it now, so that a
    checkpoint taken before the first FP8 step already holds their (initial) state.
    Layers already converted, subclasses of nn.Linear with their own forward, and a `model`
    that is itself an nn.Linear are left alone (a root module cannot be replaced in place).
    Modules that are not nn.Linear but hold matrices (an MoE's experts, GPT-2's Conv1D) stay
    in high precision: a warning says so (fp8train.inspect.coverage lists every module).

    fuse_norms: also replace each RMSNorm of the Hugging Face Llama form (Llama, Mistral,
    Qwen2 and their copies; checked on random inputs, bit for bit) by an fp8train.RMSNorm
    holding the same weight Parameter. Outside fp8train.autocast and compiled, it computes what
    the module did. Eagerly inside, where sibling FP8 Linears read its output (q/k/v,
    gate/up), one fused kernel normalizes and casts for them (modules/rms_norm.py).
    `filter_fn` is not asked about norms.

    fuse_mlps: also replace each MLP of the Hugging Face Llama form, down(act(gate(x)) *
    up(x)) with act silu (Llama, Mistral, Qwen2) or gelu's tanh form (Gemma) (checked
    likewise, with small random projections), by an fp8train.GatedMLP holding the same three
    projections (converted or not, as filter_fn decided) and activation module. Outside
    fp8train.autocast and compiled it computes what the module did; eagerly inside,
    act(gate) * up runs as one fused kernel each way (modules/gated_mlp.py).

    `torch.compile(model)` needs no eager step first: the first compiled call inside
    fp8train.autocast runs the model's forward once eagerly without gradients before it
    compiles (`_first_compiled_call`), which makes the quantizers and ties sibling layers'
    input quantizers (shared input casts), as an eager step would.
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
    if fuse_norms:
        _replace(model, RMSNorm)
    if fuse_mlps:
        _replace(model, GatedMLP)
    summary = not_linear_summary(model)
    if summary:
        warnings.warn(f"convert: {summary}", stacklevel=2)
    if any(isinstance(m, Linear) for m in model.modules()) and not isinstance(model, Linear):
        # torch.compile's protocol for lazy modules (torch/_dynamo/eval_frame.py, OptimizedModule):
        # a module with both attributes when torch.compile wraps it has
        # _infer_parameters(module, args, kwargs) called eagerly before every compiled call
        model._initialize_hook = None
        model._infer_parameters = _first_compiled_call
    return model


def _first_compiled_call(model: nn.Module, args: tuple, kwargs: Optional[dict] = None) -> None:
    """Before `torch.compile(model)`'s first call inside fp8train.autocast: the model's
    forward once, eagerly, without gradients, on the call's inputs and with its RNG state put
    back after. Layers make their quantizers there (a trace cannot: its buffers would be the
    graph's temporaries) and siblings that read one tensor tie their input quantizers (ties
    form in eager calls only). Delayed scaling's quantizers calibrate on these inputs, as the
    compiled step's own casts would, and record their amaxes, which the step records again
    (a max). Calls outside fp8train.autocast wait for one inside; after it the attributes go,
    and torch.compile's check finds nothing to call."""
    if active_recipe() is None:
        return
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        model(*args, **(kwargs or {}))
    del model._initialize_hook, model._infer_parameters


def _replace(model: nn.Module, kind) -> None:
    """Put a `kind` (RMSNorm, GatedMLP) in place of every child module that kind.from_module accepts."""
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            fused = kind.from_module(child)
            if fused is not None:
                fused.name = f"{name}.{child_name}" if name else child_name
                setattr(parent, child_name, fused)


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
