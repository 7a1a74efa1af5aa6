"""fp8train.LayerNormMLP: Norm -> fc1 -> activation -> fc2, every memory-bound step fused into
the FP8 cast that follows it."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import gemm
from ..quantizer import Quantizer
from ..recipe import GemmConfig
from .activation import ACTIVATIONS, activation_backward_fp8, activation_fp8, activation_high_precision
from .base import FP8Module, mark_calibrated
from .linear import _rows
from .norm import check_norm_args, make_norm_params, norm_backward, norm_fp8, norm_high_precision
from .weight_workspace import WeightWorkspace, weight_operands, weight_transposed

# Re-exported: these lived here before modules/activation.py (export/twins.py, inspect.py, tests).
__all__ = ["LayerNormMLP", "ACTIVATIONS", "activation_high_precision", "activation_fp8", "activation_backward_fp8"]


class LayerNormMLP(FP8Module):
    """y = fc2(act(fc1(Norm(x)))), the transformer MLP.

    Outside fp8train.autocast it computes exactly the torch composition (norm, F.linear,
    the activation of `activation_high_precision`, F.linear). Inside, the norm writes fc1's
    FP8 input, the activation kernel writes fc2's FP8 input (each with the transposed copy
    wgrad needs and the amax), and in the backward the activation-gradient kernel writes
    fc1's FP8 grad-output with its transpose and fc1's bias gradient. swiglu's fc1 has
    2 * ffn_hidden_size outputs (gate, then up).
    """

    GEMMS = ("fc1_", "fc2_")

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, normalization: str = "LayerNorm",
                 activation: str = "gelu", eps: float = 1e-5, params_dtype: Optional[torch.dtype] = None,
                 device=None):
        super().__init__()
        for what, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LayerNormMLP: {what} must be a positive int, got {v!r}")
        check_norm_args("LayerNormMLP", normalization, eps)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.normalization, self.activation, self.eps = normalization, activation, float(eps)
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        factory = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        make_norm_params(self, hidden_size, normalization, factory)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **factory))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **factory)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **factory))
        self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        self.reset_parameters()
        self._fc1_workspace, self._fc2_workspace = WeightWorkspace(), WeightWorkspace()
        self._fp8_dims = gemm.dims_ok(hidden_size, fc1_out, ffn_hidden_size)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)
        for w, b in ((self.fc1_weight, self.fc1_bias), (self.fc2_weight, self.fc2_bias)):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's initialisation
            if b is not None:
                bound = 1 / math.sqrt(w.shape[1])
                nn.init.uniform_(b, -bound, bound)

    def describe(self) -> str:
        name = f" '{self.name}'" if self.name else ""
        return f"LayerNormMLP{name}(hidden={self.hidden_size}, ffn={self.ffn_hidden_size})"

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"bias={self.fc1_bias is not None}, normalization={self.normalization}, "
                f"activation={self.activation}, eps={self.eps}")

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        recipe, act_dtype = self.fp8_plan(x, self.hidden_size)
        if recipe is None:
            return self._high_precision(x, act_dtype)
        q1 = self.quantizers(recipe, self.fc1_weight.device, "fc1_")
        q2 = self.quantizers(recipe, self.fc2_weight.device, "fc2_")
        grad = torch.is_grad_enabled()
        need_dgrad1 = grad and (x.requires_grad or self.layer_norm_weight.requires_grad)
        skip = self.weight_cast_skip
        w1 = self._fc1_workspace.get(self.fc1_weight, q1[1], is_first_microbatch, need_transpose=need_dgrad1, skip=skip)
        w2 = self._fc2_workspace.get(self.fc2_weight, q2[1], is_first_microbatch, need_transpose=grad, skip=skip)
        y = _LayerNormMLPFn.apply(
            x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight, self.fc1_bias, self.fc2_weight,
            self.fc2_bias, w1, w2, q1[0], q1[2], q2[0], q2[2], recipe.gemm, act_dtype, self.eps,
            self.normalization == "LayerNorm", self.activation, grad)
        mark_calibrated(*q1, *q2)
        return y

    def precision_dims(self) -> tuple:
        return self.hidden_size, self.ffn_hidden_size, self.normalization, self.activation, \
            int(self.fc1_bias is not None)

    @property
    def precision_in_features(self) -> int:
        return self.hidden_size

    def make_twin(self) -> "LayerNormMLP":
        return LayerNormMLP(self.hidden_size, self.ffn_hidden_size, bias=self.fc1_bias is not None,
                            normalization=self.normalization, activation=self.activation, eps=self.eps,
                            params_dtype=self.fc1_weight.dtype, device=self.fc1_weight.device)

    def high_precision_forward(self, x, dtype):
        return self._high_precision(x, dtype)

    def _high_precision(self, x, dtype):
        ln = norm_high_precision(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps)
        params = (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)
        if dtype is not None:
            ln = ln.to(dtype)
            params = tuple(p.to(dtype) if p is not None else None for p in params)
        h = F.linear(ln, params[0], params[1])
        return F.linear(activation_high_precision(h, self.activation), params[2], params[3])


class _LayerNormMLPFn(torch.autograd.Function):
    """Forward: norm -> FP8 X (+X^T); fc1; act -> FP8 A (+A^T); fc2.
    Backward: cast dY (+dY^T); fc2 dgrad -> dA; fc2 wgrad; act backward -> FP8 dH (+dH^T,
    fc1 bias grad); fc1 dgrad -> d(norm out); fc1 wgrad; norm backward.
    Saved: x, mean/rstd, X^T and A^T in FP8 with their scale_inv, and H (fc1's output, the
    activation backward needs it)."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, w1, b1, w2, b2, w1_fp8, w2_fp8, q1_input: Quantizer,
                q1_grad: Quantizer, q2_input: Quantizer, q2_grad: Quantizer, config: GemmConfig, act_dtype,
                eps: float, layer: bool, activation: str, grad: bool):
        x2 = _rows(x).contiguous()  # (M, K)
        xq, mean, rstd, _ = norm_fp8(x2, ln_weight, ln_bias, layer, eps, q1_input, grad, False)
        h = gemm.fprop(xq.data, xq.scale_inv, *weight_operands(w1_fp8), config, act_dtype, b1)  # (M, F1)
        aq = activation_fp8(h, activation, q2_input, grad)  # (M, F), (F, Mp)
        y = gemm.fprop(aq.data, aq.scale_inv, *weight_operands(w2_fp8), config, act_dtype, b2)  # (M, K)
        ctx.save_for_backward(x2, ln_weight, ln_bias, mean, rstd, xq.data_t, xq.scale_inv, h, aq.data_t,
                              aq.scale_inv)
        ctx.w_fp8 = (w1_fp8, w2_fp8)
        ctx.q_grad = (q1_grad, q2_grad)
        ctx.config, ctx.act_dtype, ctx.activation, ctx.in_shape = config, act_dtype, activation, x.shape
        ctx.dtypes = (w1.dtype, b1.dtype if b1 is not None else None, w2.dtype)
        return y.view(x.shape[:-1] + (y.shape[-1],))

    @staticmethod
    def backward(ctx, dy):
        x2, ln_weight, ln_bias, mean, rstd, x_t, x_si, h, a_t, a_si = ctx.saved_tensors
        (w1_fp8, w2_fp8), (q1_grad, q2_grad) = ctx.w_fp8, ctx.q_grad
        w1_dtype, b1_dtype, w2_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        config, act_dtype = ctx.config, ctx.act_dtype
        dy2 = _rows(dy)
        if dy2.dtype != act_dtype:
            dy2 = dy2.to(act_dtype)
        # (M, K), (K, Mp); db2 (K,) float32 from the same read of dY (autograd casts it to b2's dtype)
        dy_data, dy_t, dy_si, db2 = q2_grad.cast(dy2, transpose=True, dbias=needs[6])
        da = gemm.dgrad(dy_data, dy_si, *weight_transposed(w2_fp8), config, act_dtype)  # (M, F)
        dw2 = gemm.wgrad(dy_t, dy_si, a_t, a_si, config, w2_dtype) if needs[5] else None
        # (M, F1), (F1, Mp); db1 (F1,) in b1's dtype from the same pass
        dhq = activation_backward_fp8(da, h, ctx.activation, q1_grad, b1_dtype if needs[4] else None)
        db1 = dhq.dbias
        dw1 = gemm.wgrad(dhq.data_t, dhq.scale_inv, x_t, x_si, config, w1_dtype) if needs[3] else None
        dx = d_lnw = d_lnb = None
        if any(needs[:3]):
            d_ln = gemm.dgrad(dhq.data, dhq.scale_inv, *weight_transposed(w1_fp8), config, act_dtype)  # (M, K)
            dx, d_lnw, d_lnb = norm_backward(d_ln, x2, ln_weight, ln_bias, mean, rstd, needs[0])
            if dx is not None:
                dx = dx.view(ctx.in_shape)
        return (dx, d_lnw, d_lnb, dw1, db1, dw2, db2) + (None,) * 12
