"""fp8train.RMSNorm: a model's RMSNorm that fp8train.convert checked and replaced. Its eager
FP8 forward is one fused kernel that also casts its output for the Linears reading it."""
from __future__ import annotations

import copy
import math
import weakref
from typing import Optional

import torch
from torch import nn

from ..autocast import active_recipe, call_recipe
from ..quantizer import Quantizer
from ..roles import TensorRole
from ..tensor import version_of
from . import stacked
from .norm import norm_backward, norm_forward, norm_fp8

# The output of the last RMSNorm forward inside fp8train.autocast that cast nothing for
# readers: (weakref to y, y's version, weakref to the norm). The first FP8 Linear that checks its
# quantizers on that same y (FP8Module._share_input) becomes the norm's reader (note_reader).
_last_output: list = [None]

# How an eager forward inside fp8train.autocast ran (RMSNorm._path, fp8train.inspect.norm_paths)
FUSED = "kernel: normalizes and casts its output for its readers"
_NO_READER = "kernel: normalizes; no sibling FP8 Linears read its output through one shared input quantizer (yet)"
# A cast that a launch group cannot replay (current scaling: an amax pass, then the cast; delayed
# scaling's calibration) would be Python launches, more host time than the readers' own cast
# (one launch from C++): measured on HF Llama h1024 eager, 2026-12-04.
_READERS_CAST = "kernel: normalizes; its readers cast its output (their cast is one launch, the norm's would not be)"


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float, with_rstd: bool = False):
    """Hugging Face's LlamaRMSNorm, op for op (Mistral's, Qwen2's and others are copies of it):
    float32 statistics, the normalized x rounded back to x's dtype, then times weight.
    with_rstd: (y, rstd), rstd the float32 rsqrt(mean(x^2) + eps), x's shape with a last dim 1."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    y = weight * (h * rstd).to(dtype)
    return (y, rstd) if with_rstd else y


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2 over the last dim) + eps)), as `rms_norm_formula`.

    fp8train.convert puts one in place of a model's RMSNorm after checking that the two give
    the same bits on random inputs (`from_module`). It holds the same weight Parameter.

    The formula runs outside fp8train.autocast, in traced code (torch.compile: Inductor fuses
    it), and wherever the fused path below does not apply.

    Eagerly inside fp8train.autocast it runs fp8train's norm kernels, replayed from C++: one
    launch forward, one backward (and the weight gradient's column sum). Where sibling FP8
    Linears read its output through one shared input quantizer (attention's q, k, v; an
    MLP's gate and up; noted on their first FP8 call) and that quantizer's cast is one
    replayable launch (delayed scaling, calibrated), the forward kernel also writes y's FP8
    cast and its transposed copy (for the wgrad GEMMs) and hands it to the quantizer
    (Quantizer.offer_shared): the Linears cast nothing. Under current scaling the readers
    cast y themselves (one launch; the norm's would be an amax pass and a cast, from Python).

    The fused y is computed in float32 and rounded once to x's dtype. With float32 inputs
    that is the formula's arithmetic, with rstd summed in another order. With bf16 / fp16
    inputs the formula rounds twice, so the two can differ in the last bit. It takes x and
    weight of one dtype; other mixes run the formula.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"RMSNorm: hidden_size must be a positive int, got {hidden_size!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"RMSNorm: eps must be a finite number >= 0, got {eps!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype(),
                                              device=device))
        self.eps = float(eps)
        self.name: Optional[str] = None  # set by fp8train.convert for messages
        # Lists: an item store is cheaper than a Module attribute store on this per-call path.
        # The readers' shared input quantizer itself, not a weak reference: copy.deepcopy of the
        # model then maps it to the copy's quantizer (a weakref would be shared with the original).
        self._reader = [None]
        self._forward_reader = [None]  # what the last forward outside a backward pass cast for
        self._path = [None]
        self._forward_recipe = None

    @property
    def variance_epsilon(self) -> float:
        """eps under Hugging Face's name (code that reads the replaced module's attribute)."""
        return self.eps

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    @classmethod
    def from_module(cls, module: nn.Module) -> Optional["RMSNorm"]:
        """An RMSNorm holding `module`'s weight Parameter, or None, when `module` is not an
        RMSNorm of this formula.

        It must be named like one (its class name ends in "RMSNorm") and have one 1-D
        parameter `weight`, no buffers, submodules or hooks, and eps as `variance_epsilon` or
        `eps`. A copy of it on the CPU, with random weights, must give `rms_norm_formula`'s
        bits and dtype on random inputs, for float32 and bf16 inputs and weights. This turns
        away variants such as Gemma's weight offset, y * (1 + weight)."""
        if type(module) is cls or not type(module).__name__.endswith("RMSNorm"):
            return None
        params = dict(module.named_parameters(recurse=False))
        weight = params.get("weight")
        if (len(params) != 1 or weight is None or weight.dim() != 1 or next(module.children(), None) is not None
                or next(module.buffers(recurse=False), None) is not None or module._forward_hooks
                or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks):
            return None
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            return None
        if not _computes_formula(module, float(eps)):
            return None
        norm = cls(weight.shape[0], float(eps), device="meta")  # its parameter replaced just below
        norm.weight = weight
        norm.train(module.training)
        return norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # read once: each read of a parameter is a Module.__getattr__ call
        if torch.compiler.is_compiling():
            return self._traced_forward(x, weight)
        recipe = call_recipe(self)
        if recipe is None:
            return rms_norm_formula(x, weight, self.eps)
        why = _kernel_refusal(x, weight)
        if why is not None:
            self._path[0] = why
            y = rms_norm_formula(x, weight, self.eps)
        else:
            if torch._C._current_graph_task_id() == -1:
                q = self._forward_reader[0] = self._reader_for(recipe)
            else:  # a recomputation (checkpointing) casts as its forward did, also on the step readers were noted
                q = self._forward_reader[0]
            found = []
            y = _FusedRMSNormFn.apply(x, weight, self.eps, q, torch.is_grad_enabled(), found)
            if q is not None:
                q.offer_shared(y, found[0])
                return y
        _last_output[0] = (weakref.ref(y), version_of(y), weakref.ref(self))
        return y

    def _traced_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The formula; under BlockScaling with a stacked tie reading the output (its input
        quantizer the noted reader), also the output's two-way cast for that tie, made in one
        kernel from x and the formula's rstd (BlockScalingQuantizer.cast_norm) and offered to
        the tie's stacked GEMM (stacked.offer), which takes it instead of casting y. y is then
        read by nothing in the forward and Inductor does not compute it; the backward is the
        formula's. The same bytes as the tie's own cast of y (rstd is the formula's). Under
        BlockScaling(fp8_wgrad=False) the cast is one-way and keeps y in the tie's activation
        dtype, which the tie saves for its bf16 wgrad instead of y."""
        q = self._reader[0]
        recipe = active_recipe()
        if (not stacked.NORMS or q is None or not q.blockwise or q.sharing < 2 or recipe is None
                or not getattr(recipe, "stack_siblings", False) or _kernel_refusal(x, weight) is not None
                or stacked.parts(q.members[0], q) is None):
            return rms_norm_formula(x, weight, self.eps)
        y, rstd = rms_norm_formula(x, weight, self.eps, with_rstd=True)
        if not recipe.fp8_wgrad:  # one-way, y kept in the activations' dtype for the tie's bf16 wgrad
            kind = y.device.type  # the dtype the tie computes in (base.activation_dtype's)
            act = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else y.dtype
            cast, kept = q.cast_norm_kept(x, weight, rstd, y.dtype, act)
            stacked.offer(q, y, (cast.data, None, cast.scale_inv, None, kept))
            return y
        cast = q.cast_norm(x, weight, rstd, y.dtype)
        stacked.offer(q, y, (cast.data, cast.data_t, cast.scale_inv, cast.scale_inv_t, None))
        return y

    def _reader_for(self, recipe) -> Optional[Quantizer]:
        """The readers' shared input quantizer where the kernel casts for them, else None
        (noting which in _path)."""
        q = self._reader[0]
        if q is None or q.sharing < 2:
            self._path[0] = _NO_READER
            return None
        if q.blockwise or not q.matches(recipe, TensorRole.INPUT):
            self._path[0] = f"kernel: its readers' quantizer does not cast per tensor for {type(recipe).__name__}"
            return None
        if q.replay_fixed() is None:
            self._path[0] = _READERS_CAST
            return None
        self._path[0] = FUSED
        return q


def _kernel_refusal(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why the norm kernels cannot take this call (the formula runs), or None."""
    if x.dtype != weight.dtype:
        return f"formula: a {x.dtype} input with a {weight.dtype} weight (the kernels take one dtype)"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() == 0 or x.numel() == 0:
        return f"formula: a {x.dtype} input of shape {tuple(x.shape)}"
    if type(weight) not in (nn.Parameter, torch.Tensor) or x.get_device() != weight.get_device():
        return "formula: the weight is a tensor subclass (DTensor) or on another device than x"
    return None


def note_reader(x: torch.Tensor, q: Quantizer) -> None:
    """A Linear's first FP8 call checks its quantizers on x with input quantizer q: if x is
    the output of the last RMSNorm forward (the same tensor, unchanged), q becomes that
    norm's reader (the quantizer its fused path casts for)."""
    last = _last_output[0]
    if last is None:
        return
    ref, version, norm_ref = last
    if ref() is x and version == version_of(x):
        norm = norm_ref()
        if norm is not None:
            norm._reader[0] = q
        _last_output[0] = None


def _computes_formula(module: nn.Module, eps: float) -> bool:
    """Whether a CPU copy of `module` gives rms_norm_formula's bits and dtype (see from_module)."""
    probe = copy.deepcopy(module)
    if any(p.is_meta for p in probe.parameters()):
        probe = probe.to_empty(device="cpu")
    probe = probe.cpu()
    size = probe.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for w_dtype in (torch.float32, torch.bfloat16):
                probe.to(w_dtype)
                probe.weight.copy_(torch.randn(size, generator=g) * 2)
                for x_dtype in (torch.float32, torch.bfloat16):
                    x = (torch.randn(2, 3, size, generator=g) * 5).to(x_dtype)
                    got, want = probe(x), rms_norm_formula(x, probe.weight, eps)
                    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
                        return False
    except Exception:  # a module that cannot run this way is not one to replace
        return False
    return True


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


class _FusedRMSNormFn(torch.autograd.Function):
    """Forward: the norm kernel into y, and with a reader quantizer q y's FP8 cast too
    (found[0]). Backward: the norm's backward kernel. Saved: x (as rows), weight, rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, q: Optional[Quantizer], transpose: bool, found: list):
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if q is None:  # no reader: the same statistics and y, no cast
            rstd, y = norm_forward(x2, weight, eps)
        else:
            cast, _, rstd, y = norm_fp8(x2, weight, None, False, eps, q, transpose, want_y=True)
            found.append(cast)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.in_shape = x.shape
        # not a view: an output of an autograd.Function that is a view cannot be modified in place
        return y if x.dim() == 2 else _UNSAFE_VIEW(y, x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape)
        if dy2.dtype != x2.dtype:
            dy2 = dy2.to(x2.dtype)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        dx, dweight, _ = norm_backward(dy2, x2, weight, None, None, rstd, ctx.needs_input_grad[0])
        if dx is not None:
            dx = dx.view(ctx.in_shape)
        return dx, dweight if ctx.needs_input_grad[1] else None, None, None, None, None


__all__ = ["RMSNorm", "rms_norm_formula", "note_reader"]
