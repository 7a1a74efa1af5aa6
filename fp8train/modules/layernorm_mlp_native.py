"""LayerNormMLP's C++ node (csrc/linear_node.cpp `mlp_forward`): which calls take it and the
plan it runs.

The node is `_LayerNormMLPFn` in C++ for one call signature under delayed scaling: the norm
and activation steps are the launch groups (kernels/replay.py) that the Python path used for
the same signature, the dY cast is the fc2 grad quantizer's cast plan (kernels/native.py),
the GEMMs are the same `_scaled_mm` calls. So a signature runs through Python until both
passes have run there with groups (its first steps: calibration, then recording); then
through the node. The Python Function stays the reference and the fallback (CPU, current
scaling, tensor parallelism, torch.compile, launch hooks, `native.ENABLED = False`).

A plan is only as good as the buffers its groups point into: each entry remembers the four
activation/gradient quantizers and their preparation dicts, which they replace whenever
their buffers may have moved (`Quantizer._forget_prepared`); a changed one makes the entry
start over.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..kernels import native
from ..quantizer import Quantizer
from ..tensor import Float8Tensor, padded_rows

_FP8_CODES = {torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}

# The node alone off (launch groups stay on; native.ENABLED turns off both): an A/B switch
# for benchmarks and tests.
ENABLED = True


class NodeEntry:
    """One call signature's launch groups, as the Python path last used them, and the C++
    plan made from them."""

    __slots__ = ("quantizers", "dicts", "fwd", "bwd", "plan")

    def __init__(self, quantizers: Tuple[Quantizer, ...]):
        self.quantizers = quantizers
        self.dicts = tuple(q._prepared for q in quantizers)
        self.fwd: Optional[tuple] = None  # (norm forward group, activation forward group)
        self.bwd: Optional[tuple] = None  # (activation backward group, norm backward group or None)
        self.plan = None

    def fresh(self, quantizers: Sequence[Quantizer]) -> bool:
        return all(a is b and a._prepared is d for a, b, d in zip(self.quantizers, quantizers, self.dicts))

    def set_fwd(self, groups: tuple) -> None:
        if groups != self.fwd:
            self.fwd, self.plan = groups, None

    def set_bwd(self, groups: tuple) -> None:
        if groups != self.bwd:
            self.bwd, self.plan = groups, None


class NodePlans:
    """Per LayerNormMLP: an entry per call signature (a few per model: one per token count)."""

    def __init__(self):
        self._entries: dict = {}

    def __getstate__(self):  # copies and pickles start empty: groups and plans are this process's
        return {"_entries": {}}

    def entry(self, key, quantizers: Tuple[Quantizer, ...]) -> NodeEntry:
        e = self._entries.get(key)
        if e is None or not e.fresh(quantizers):
            if len(self._entries) >= 16:  # many token counts (variable lengths): start over
                self._entries.clear()
            e = self._entries[key] = NodeEntry(quantizers)
        return e


def needs_of(x, ln_weight, ln_bias, w1, b1, w2, b2) -> Tuple[bool, ...]:
    """Which of the node's seven inputs get a gradient (as the Function's needs_input_grad)."""
    if not torch.is_grad_enabled():
        return (False,) * 7
    return tuple(t is not None and t.requires_grad for t in (x, ln_weight, ln_bias, w1, b1, w2, b2))


def signature(layer, x: torch.Tensor, act_dtype: torch.dtype, needs: Tuple[bool, ...], config) -> tuple:
    """What the node's launches depend on beyond the module's fixed configuration."""
    params = (layer.layer_norm_weight, layer.layer_norm_bias, layer.fc1_weight, layer.fc1_bias, layer.fc2_weight,
              layer.fc2_bias)
    return (x.shape, x.dtype, x.device.index, act_dtype, torch.is_grad_enabled(), needs, config,
            tuple(None if p is None else p.dtype for p in params))


def eligible(x: torch.Tensor, quantizers: Sequence[Quantizer]) -> bool:
    """Whether this call may take the node (else the Python Function, which also records)."""
    if (not ENABLED or not native.ENABLED or not x.is_cuda or isinstance(x, Float8Tensor) or torch.compiler.is_compiling()
            or x.get_device() != torch._C._cuda_getDevice() or x.dtype not in native.DTYPE_CODES):
        return False
    if native.hooks_installed() or native.extension() is None:
        return False
    return all(q.replay_fixed() is not None for q in quantizers)


def plan_for(layer, entry: NodeEntry, x: torch.Tensor, act_dtype: torch.dtype, needs: Tuple[bool, ...], config,
             q_act_in: Quantizer, q_x: Quantizer, q_dh: Quantizer, q_dy: Quantizer):
    """The entry's C++ MlpPlan, made now if its groups are complete; None while they are not."""
    if entry.plan is not None:
        return entry.plan
    grad = torch.is_grad_enabled()
    fwd, bwd = entry.fwd, entry.bwd
    if fwd is None or any(g is None for g in fwd):
        return None
    any_need = any(needs)
    dy_plan = None
    if grad and any_need:
        if bwd is None or bwd[0] is None or (any(needs[:3]) and bwd[1] is None):
            return None
        m, k = x.numel() // x.shape[-1], x.shape[-1]
        dy_plan = q_dy.native_plan((m, k), act_dtype, True, layer.fc2_bias.dtype if needs[6] else None)
        if dy_plan is None:
            return None
    ext = native.extension()
    k = layer.hidden_size
    m = x.numel() // k
    fc1_cols = layer.fc1_weight.shape[0]
    act_cols = fc1_cols // 2 if layer.activation == "swiglu" else fc1_cols
    b1 = layer.fc1_bias
    codes = [native.DTYPE_CODES[act_dtype], _FP8_CODES[q_x.dtype], _FP8_CODES[q_act_in.dtype], _FP8_CODES[q_dh.dtype],
             native.DTYPE_CODES[b1.dtype] if b1 is not None else 0]
    group = lambda g: None if g is None else g._group  # noqa: E731
    act_bwd, norm_bwd = (None, None) if bwd is None or not (grad and any_need) else bwd
    entry.plan = ext.MlpPlan(
        x.device.index, [m, k, act_cols, fc1_cols, padded_rows(m)], layer.normalization == "LayerNorm", grad,
        list(needs), codes, [config.fprop_fast_accum, config.dgrad_fast_accum, config.wgrad_fast_accum],
        group(fwd[0]), group(fwd[1]), group(act_bwd), group(norm_bwd), dy_plan)
    return entry.plan


def forward(plan, x, ln_weight, ln_bias, w1, b1, w2, b2, w1_fp8: Float8Tensor, w2_fp8: Float8Tensor,
            needs: Tuple[bool, ...], w1_cast=None, w2_cast=None) -> torch.Tensor:
    """The node's forward: y, with the node as its grad_fn where anything needs a gradient.
    w1_cast / w2_cast: the weights' re-cast plans into their workspaces
    (WeightWorkspace.for_native), which the node runs before its GEMMs, or None (the
    workspace holds what Python cast or kept)."""
    grad = any(needs)
    w1_t = w1_fp8.transpose_data() if any(needs[:3]) else None
    w2_t = w2_fp8.transpose_data() if grad else None
    return native.extension().mlp_forward(plan, x, ln_weight, ln_bias, w1, b1, w2, b2, w1_fp8._data,
                                          w1_fp8._scale_inv, w1_t, w2_fp8._data, w2_fp8._scale_inv, w2_t,
                                          w1_cast, w2_cast)


__all__ = ["NodeEntry", "NodePlans", "eligible", "forward", "needs_of", "plan_for", "signature"]
