"""fp8train.GatedMLP: a model's gated MLP (SwiGLU or GeGLU) that fp8train.convert checked and
replaced. Its eager forward inside fp8train.autocast runs act(g) * u as one fused kernel each way."""
from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..autocast import active_recipe, call_recipe
from ..kernels import replay
from .linear import Linear, gated_stacked_forward

# How an eager forward inside fp8train.autocast ran (GatedMLP._path, fp8train.inspect.mlp_paths)
FUSED = "kernel: act(gate) * up in one launch, its backward in one"
GATED_NODE = ("stacked gate/up node: act(gate) * up computed in the down projection's input cast, dg | du in "
              "the node's gradient cast (BlockScaling, modules/stacked.py GATED)")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# The gate's activations (gated_reference.GATED_ACTIVATIONS) as torch computes them: silu
# (SwiGLU: Llama, Mistral, Qwen2) and the tanh approximation of gelu (GeGLU: Gemma's
# gelu_pytorch_tanh), and a module computing each (the act_fn a GatedMLP built without one holds)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
_ACT_MODULES = {"silu": nn.SiLU, "gelu_tanh": functools.partial(nn.GELU, approximate="tanh")}
# Plain attributes of Hugging Face's MLPs that code may read from the replaced module.
_KEPT_ATTRIBUTES = ("config", "hidden_size", "intermediate_size")


def gated_mlp_formula(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
                      activation: str = "silu") -> torch.Tensor:
    """Hugging Face's LlamaMLP (hidden_act "silu") and GemmaMLP ("gelu_pytorch_tanh"), op for
    op: down(act(gate(x)) * up(x)), act one of ACTIVATIONS."""
    return down_proj(ACTIVATIONS[activation](gate_proj(x)) * up_proj(x))


class GatedMLP(nn.Module):
    """y = down_proj(act(gate_proj(x)) * up_proj(x)), as `gated_mlp_formula`: act is silu
    (SwiGLU) or gelu_tanh (GeGLU), the `activation`.

    fp8train.convert puts one in place of a model's MLP of this form (Llama, Mistral, Qwen2,
    Gemma and their copies) after checking that the two give the same bits on random inputs
    (`from_module`). It holds the same three projection modules (fp8train.Linear once
    converted) and the same activation module, so parameter and state_dict names do not change.

    The formula runs outside fp8train.autocast and where the kernels do not take the inputs.
    Traced inside fp8train.autocast (torch.compile), it runs as torch ops in float32 rounded
    once, the kernels' arithmetic, which Inductor fuses into one kernel. Eagerly inside
    fp8train.autocast, act(g) * u is one kernel launch (replayed from C++), computed in
    float32 and rounded once; its backward is one launch writing both gradients, and it saves
    g and u only (the formula also keeps act(g) for the product's backward). With bf16
    activations the formula rounds act(g) to bf16 before the product, so the two differ in
    the last bit of some elements (kernels/gated_reference.py).

    act_fn: the module the replaced MLP held (kept for its state_dict and for code that reads
    it; the forward computes `activation` itself); by default one computing `activation`.
    activation: "silu" or "gelu_tanh" (ACTIVATIONS); by default the one act_fn computes (its
    bits on a probe), silu without an act_fn. An act_fn that computes neither, or another
    than `activation`, is an error: the forward would not compute what it holds.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module,
                 act_fn: Optional[nn.Module] = None, activation: Optional[str] = None):
        super().__init__()
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"GatedMLP: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        if act_fn is not None:
            computed = _activation_of(act_fn)
            if computed is None or activation not in (None, computed):
                raise ValueError(f"GatedMLP: act_fn {act_fn!r} computes {computed or 'none of ' + str(tuple(ACTIVATIONS))}"
                                 + (f", not activation={activation!r}" if computed else ""))
            activation = computed
        activation = activation or "silu"
        for what, m in zip(_PROJECTIONS, (gate_proj, up_proj, down_proj)):
            if not isinstance(m, (nn.Linear, Linear)):
                raise TypeError(f"GatedMLP: {what} must be a torch.nn.Linear or fp8train.Linear, got {type(m).__name__}")
        if not (gate_proj.in_features == up_proj.in_features and gate_proj.out_features == up_proj.out_features
                == down_proj.in_features):
            raise ValueError(f"GatedMLP: gate_proj ({gate_proj.in_features} -> {gate_proj.out_features}), up_proj "
                             f"({up_proj.in_features} -> {up_proj.out_features}) and down_proj "
                             f"({down_proj.in_features} -> {down_proj.out_features}) do not chain")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.activation = activation
        self.act_fn = act_fn if act_fn is not None else _ACT_MODULES[activation]()
        self.name: Optional[str] = None  # set by fp8train.convert for messages
        self._path = [None]  # a list: an item store is cheaper than a Module attribute store per call
        self._forward_recipe = None

    @classmethod
    def from_module(cls, module: nn.Module) -> Optional["GatedMLP"]:
        """A GatedMLP holding `module`'s projections and activation, or None, when `module`
        is not an MLP of this formula.

        It must be named like one (its class name ends in "MLP"), have exactly the children
        gate_proj, up_proj, down_proj (torch.nn.Linear or fp8train.Linear, of chaining
        dims) and act_fn, and no parameters, buffers or hooks of its own. A copy of it with
        small random projections must give `gated_mlp_formula`'s bits and dtype on random
        CPU inputs, for float32 and bf16, with one of ACTIVATIONS (tried in turn: the first
        that matches is the MLP's `activation`): this turns away other activations (gelu's
        erf form, relu) and other compositions. The check does not touch the model's weights."""
        if type(module) is cls or not type(module).__name__.endswith("MLP"):
            return None
        children = dict(module.named_children())
        if set(children) != {*_PROJECTIONS, "act_fn"}:
            return None
        if (next(module.parameters(recurse=False), None) is not None
                or next(module.buffers(recurse=False), None) is not None or module._forward_hooks
                or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks):
            return None
        projections = [children[name] for name in _PROJECTIONS]
        act_fn = children["act_fn"]
        if (any(not isinstance(m, (nn.Linear, Linear)) or _has_hooks(m) for m in projections) or _has_hooks(act_fn)
                or next(act_fn.parameters(), None) is not None or next(act_fn.buffers(), None) is not None):
            return None
        gate, up, down = projections
        if not (gate.in_features == up.in_features and gate.out_features == up.out_features == down.in_features):
            return None
        biases = [m.bias is not None for m in projections]
        activation = next((act for act in ACTIVATIONS if _computes_formula(module, biases, act)), None)
        if activation is None or _activation_of(act_fn) != activation:  # an act_fn its forward does not use
            return None
        mlp = cls(gate, up, down, act_fn, activation)
        for attr in _KEPT_ATTRIBUTES:
            if attr in module.__dict__:
                setattr(mlp, attr, module.__dict__[attr])
        mlp.train(module.training)
        return mlp

    def extra_repr(self) -> str:
        return (f"{self.gate_proj.in_features} -> {self.gate_proj.out_features} -> {self.down_proj.out_features}, "
                f"activation={self.activation}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BlockScaling with gate/up stacked: the product cast inside their node (stacked.GATED)
        y = gated_stacked_forward(self.gate_proj, self.up_proj, self.down_proj, x, self.activation)
        if y is not None:
            if not torch.compiler.is_compiling():
                self._path[0] = GATED_NODE
            return y
        g = self.gate_proj(x)
        u = self.up_proj(x)
        act = ACTIVATIONS[self.activation]
        if torch.compiler.is_compiling():
            # Inside fp8train.autocast, the eager kernel's arithmetic (float32, one rounding),
            # which Inductor fuses into one kernel likewise: compiled and eager steps then
            # differ by float32 rounding only, not by a bf16 rounding of act(g).
            if active_recipe() is None or _kernel_refusal(g, u) is not None:
                return self.down_proj(act(g) * u)
            return self.down_proj((act(g.float()) * u.float()).to(g.dtype))
        if call_recipe(self) is None:
            return self.down_proj(act(g) * u)
        why = _kernel_refusal(g, u)
        if why is not None:
            self._path[0] = why
            return self.down_proj(act(g) * u)
        self._path[0] = FUSED
        return self.down_proj(_GatedFn.apply(g, u, self.activation))

def _activation_of(act_fn: nn.Module) -> Optional[str]:
    """The one of ACTIVATIONS whose bits act_fn gives on float32 and bf16 probes (both signs,
    the tails, zeros), or None."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(64, generator=g) * 4, torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-3, -1e-3])])
    probes = (x, x.bfloat16())
    try:
        with torch.no_grad():
            outs = [act_fn(p) for p in probes]
    except Exception:
        return None
    for name, fn in ACTIVATIONS.items():
        if all(isinstance(o, torch.Tensor) and o.dtype == p.dtype and torch.equal(o, fn(p))
               for o, p in zip(outs, probes)):
            return name
    return None


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _kernel_refusal(g: torch.Tensor, u: torch.Tensor) -> Optional[str]:
    """Why the kernels cannot take this call (the formula runs), or None."""
    if type(g) is not torch.Tensor or type(u) is not torch.Tensor:
        return "formula: a projection's output is a tensor subclass"
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        return (f"formula: gate {g.dtype} {tuple(g.shape)} and up {u.dtype} {tuple(u.shape)} differ "
                "(the kernels take one dtype and shape)")
    if g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"formula: a {g.dtype} activation"
    return None


def _computes_formula(module: nn.Module, biases, activation: str) -> bool:
    """Whether a shallow copy of `module` whose projections are small random CPU Linears gives
    gated_mlp_formula's bits and dtype with `activation` (see from_module)."""
    probe = copy.copy(module)
    probe._modules = dict(module._modules)  # the copy's own child table: the original keeps its children
    g = torch.Generator().manual_seed(0)
    hidden, inner = 24, 40
    try:
        with torch.no_grad():
            for dtype in (torch.float32, torch.bfloat16):
                dims = ((hidden, inner), (hidden, inner), (inner, hidden))
                for name, (fan_in, fan_out), bias in zip(_PROJECTIONS, dims, biases):
                    lin = nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype)
                    lin.weight.copy_(torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5)
                    if bias:
                        lin.bias.copy_(torch.randn(fan_out, generator=g))
                    probe._modules[name] = lin
                x = (torch.randn(2, 3, hidden, generator=g) * 3).to(dtype)
                got = probe(x)
                want = gated_mlp_formula(x, *(probe._modules[name] for name in _PROJECTIONS), activation)
                if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
                    return False
    except Exception:  # a module that cannot run this way is not one to replace
        return False
    return True


def gated_forward(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    """act(g) * u (kernels.gated_fwd), replayed from C++ in the steady state."""
    out = torch.empty_like(g)
    key = ("gated_fwd", act, g.shape, g.dtype, u.dtype, g.device.index)
    replay.run(_FWD_GROUPS, key, (g, u, out), (), lambda: kernels.gated_fwd(g, u, act, out))
    return out


def gated_backward(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str):
    """(dg, du) of act(g) * u (kernels.gated_bwd), replayed from C++ in the steady state."""
    dg, du = torch.empty_like(g), torch.empty_like(u)
    key = ("gated_bwd", act, g.shape, da.dtype, g.dtype, u.dtype, g.device.index)
    replay.run(_BWD_GROUPS, key, (da, g, u, dg, du), (), lambda: kernels.gated_bwd(da, g, u, act, dg, du))
    return dg, du


# Launch groups (kernels/replay.py) of the two kernels; they point at no fixed buffer, so they
# outlive any module. One entry per activation, shape and dtype combination.
_FWD_GROUPS: dict = {}
_BWD_GROUPS: dict = {}


class _GatedFn(torch.autograd.Function):
    """Forward: act(g) * u. Backward: dg and du in one launch. Saved: g and u."""

    @staticmethod
    def forward(ctx, g, u, act: str):
        g = g if g.is_contiguous() else g.contiguous()
        u = u if u.is_contiguous() else u.contiguous()
        ctx.save_for_backward(g, u)
        ctx.act = act
        return gated_forward(g, u, act)

    @staticmethod
    def backward(ctx, da):
        g, u = ctx.saved_tensors
        if da.dtype != g.dtype:
            da = da.to(g.dtype)
        if not da.is_contiguous():
            da = da.contiguous()
        dg, du = gated_backward(da, g, u, ctx.act)
        return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None), None


__all__ = ["GatedMLP", "ACTIVATIONS", "gated_mlp_formula", "gated_forward", "gated_backward"]
