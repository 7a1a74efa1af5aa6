"""fp8train.LayerNormLinear: LayerNorm/RMSNorm -> Linear, the norm writing the GEMM's FP8 input."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from .. import gemm
from ..distributed.parallel_fused import LayerNormLinearTPFn, layernorm_linear_high_precision
from ..distributed.parallel_linear import tp_plan
from ..distributed.tp_config import TPConfig
from ..distributed.tp_state import ShardSpec, TPLayout
from ..quantizer import Quantizer
from ..recipe import GemmConfig
from ..tensor import Float8Tensor
from . import high_node
from .base import FP8Module, in_dtype, mark_calibrated, unsafe_view
from .linear import _rows, block_scaled_gemm, init_linear_params, linear_parts, refuse_per_tensor_fp8
from .norm import check_norm_args, make_norm_params, norm_backward, norm_fp8, norm_high_precision, \
    norm_high_precision_in
from .tp_checkpoint import TPCheckpoints
from .weight_workspace import WeightWorkspace, high_precision_weight, weight_operands, weight_transposed


class LayerNormLinear(FP8Module, TPCheckpoints):
    """y = Linear(Norm(x)); with return_layernorm_output=True, forward returns (y, Norm(x)).

    Outside fp8train.autocast it computes exactly what torch.nn.LayerNorm (or RMSNorm)
    followed by torch.nn.Linear compute; inside, where it runs in high precision, the same
    bytes come from one C++ node on the GPU where it can (high_node.py). In FP8, one kernel normalizes x and writes the
    FP8 GEMM input, its transposed copy (for wgrad) and its amax (current scaling: a
    statistics pass that takes the amax first); the backward runs dgrad, wgrad and the
    norm backward. forward(x, is_first_microbatch): see WeightWorkspace.

    out_features=(q, k, v), a tuple (or list) of positive ints: several GEMMs that consume
    the same normalized input (separate Q, K, V projections) run as one. The layer holds one
    weight (q + k + v, in) = [W_q; W_k; W_v] and one bias [b_q; b_k; b_v] (the state dict of
    a layer with out_features=q + k + v); inside autocast it normalizes, casts and (under SP)
    gathers once, runs one FP8 GEMM with one weight scale and one grad-output scale for all
    parts, and returns the parts (y_q, y_k, y_v), views of the one output (autograd refuses
    in-place ops on them). Outside autocast: one F.linear per part, on the weight's and
    bias's row blocks (exactly separate nn.Linear layers). return_layernorm_output appends
    the norm output: (y_q, y_k, y_v, Norm(x)), a flat tuple so that module hooks see every
    output.

    Tensor parallelism (docs/distributed.md): parallel_mode="column" shards out_features over
    the W ranks of `tp_group` (weight (out/W, in), bias (out/W)); the norm's weight and bias
    stay whole on every rank. sequence_parallel=True: x is this rank's rows (s/W, b, in), the
    norm runs on them and its FP8 output is gathered (y (s, b, out/W)); the norm output
    returned with return_layernorm_output is this rank's rows. tp_overlap=True (with SP) runs
    the gather and the backward reduce-scatter as ring collective matmuls. "row" is refused: it
    would normalize over a hidden dim that is sharded. With out_features=(q, k, v) each part is
    sharded on its own: rank r holds [W_q,r; W_k,r; W_v,r] and returns (q/W, k/W, v/W) columns,
    every part must split into multiples of 16 per rank.
    """

    def __init__(self, in_features: int, out_features: Union[int, Tuple[int, ...]], bias: bool = True,
                 normalization: str = "LayerNorm", eps: float = 1e-5, params_dtype: Optional[torch.dtype] = None,
                 device=None,
                 return_layernorm_output: bool = False, *, tp_group=None, parallel_mode: Optional[str] = None,
                 sequence_parallel: bool = False, tp_overlap: bool = False,
                 tp_reduce_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"LayerNormLinear: in_features must be a positive int, got {in_features!r}")
        # None for an int out_features, else its parts; the GEMM has out_total outputs
        self.out_parts: Optional[Tuple[int, ...]] = _out_parts(out_features)
        out_total = out_features if self.out_parts is None else sum(self.out_parts)
        check_norm_args("LayerNormLinear", normalization, eps)
        if parallel_mode == "row":
            raise ValueError("LayerNormLinear: parallel_mode='row' would shard in_features, the dim the norm "
                             "normalizes over; use parallel_mode='column', or a LayerNorm followed by a "
                             "row-parallel fp8train.Linear")
        self.tp: Optional[TPConfig] = TPConfig.create(tp_group, parallel_mode, sequence_parallel, in_features,
                                                      out_total, tp_overlap, owner="LayerNormLinear",
                                                      reduce_dtype=tp_reduce_dtype, out_parts=self.out_parts or ())
        self.in_features, self._out_total = in_features, out_total
        self.out_features = out_features if self.out_parts is None else self.out_parts
        self.normalization, self.eps = normalization, float(eps)
        self.return_layernorm_output = bool(return_layernorm_output)
        local_out = out_total if self.tp is None else self.tp.local_out_features
        # this rank's columns of each part (None without parts): how the GEMM output splits
        self.local_out_parts: Optional[Tuple[int, ...]] = \
            self.out_parts if self.tp is None or self.out_parts is None else self.tp.local_out_parts
        factory = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        make_norm_params(self, in_features, normalization, factory)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(local_out, **factory)) if bias else None
        self.reset_parameters()
        self._workspace = WeightWorkspace()
        self._fp8_dims = gemm.dims_ok(in_features, local_out)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)
        layout = self.tp_layout()  # nn.Linear's initialisation (TP: shards of the unsharded layer's draws)
        init_linear_params(self.weight, self.bias, self.in_features, self._out_total,
                           None if layout is None else (layout.tp, layout.specs["weight"], layout.specs["bias"]))

    def tp_layout(self) -> Optional[TPLayout]:
        """Weight and bias sharded on dim 0 (out_features=(q, k, v): each part on its own,
        [W_q; W_k; W_v] -> [W_q,r; W_k,r; W_v,r]); norm parameters replicated."""
        if self.tp is None:
            return None
        replicated, column = ShardSpec(), ShardSpec(0, self.out_parts or 1)
        return TPLayout(self.tp, {"layer_norm_weight": replicated, "layer_norm_bias": replicated,
                                  "weight": column, "bias": column})

    def describe(self) -> str:
        name = f" '{self.name}'" if self.name else ""
        tp = "" if self.tp is None else f", column-parallel over {self.tp.world} ranks"
        return f"LayerNormLinear{name}(in={self.in_features}, out={self.out_features}{tp})"

    def extra_repr(self) -> str:
        tp = "" if self.tp is None else (f", parallel_mode='column', tp_size={self.tp.world}"
                                         f", sequence_parallel={self.tp.sequence_parallel}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"normalization={self.normalization}, eps={self.eps}{tp}")

    @property
    def weight_fp8(self):
        return self._workspace.fp8

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        tp = self.tp
        recipe, act_dtype = self.fp8_plan(x, self.in_features) if tp is None else tp_plan(self, x, self.in_features)
        if recipe is None:
            return self._high_precision(x, act_dtype)
        weight, ln_weight = self.weight, self.layer_norm_weight  # read once: parameters are Module.__getattr__ calls
        q_input, q_weight, q_grad = self.quantizers(recipe, weight.device)
        grad = torch.is_grad_enabled()
        if q_weight.blockwise:
            return _block_scaled_layernorm_linear(self, x, (q_input, q_weight, q_grad), recipe.gemm, act_dtype, grad,
                                                  is_first_microbatch, recipe.fp8_wgrad)
        need_dgrad = grad and (x.requires_grad or ln_weight.requires_grad)
        w_fp8 = self._workspace.get(weight, q_weight, is_first_microbatch, need_transpose=need_dgrad,
                                    skip=self.weight_cast_skip)
        args = (x, ln_weight, self.layer_norm_bias, weight, self.bias, w_fp8, q_input, q_grad,
                recipe.gemm, act_dtype, self.eps, self.normalization == "LayerNorm",
                grad and weight.requires_grad, self.return_layernorm_output)
        out = _LayerNormLinearFn.apply(*args) if tp is None else LayerNormLinearTPFn.apply(*args, tp)
        mark_calibrated(q_input, q_weight, q_grad)
        y, ln_out = out if self.return_layernorm_output else (out, None)
        if self.out_parts is not None:
            y = y.split(self.local_out_parts, -1)  # views of the one GEMM's output
        return layernorm_linear_outputs(y, ln_out, self.return_layernorm_output)

    def takes_block_scaling(self) -> bool:
        return self.tp is None

    def precision_dims(self) -> tuple:
        out = self.out_features if self.out_parts is None else "+".join(map(str, self.out_parts))
        return self.in_features, out, self.normalization, int(self.bias is not None)

    @property
    def precision_in_features(self) -> int:
        return self.in_features

    def make_twin(self) -> "LayerNormLinear":
        return LayerNormLinear(self.in_features, self.out_features, bias=self.bias is not None,
                               normalization=self.normalization, eps=self.eps, params_dtype=self.weight.dtype,
                               device=self.weight.device)

    def high_precision_forward(self, x, dtype):
        out = self._high_precision(x, dtype)
        if not self.return_layernorm_output:
            return out
        return out[:-1] if self.out_parts is not None else out[0]

    def _high_precision(self, x, dtype):
        if self.tp is not None:  # outside autocast (TP layers have no dims fallback or auto precision)
            y, ln = layernorm_linear_high_precision(x, self.layer_norm_weight, self.layer_norm_bias, self.weight,
                                                    self.bias, self.normalization, self.eps, self.tp,
                                                    self.local_out_parts)
            return layernorm_linear_outputs(y, ln, self.return_layernorm_output)
        weight = self.weight
        # inside autocast: one C++ node where it can take the call (not a weight FSDP2 gathered in FP8)
        if dtype is not None and not isinstance(weight, Float8Tensor):
            y = high_node.forward(self, x, dtype)
            if y is not None:
                return y
        norm = norm_high_precision if dtype is None else norm_high_precision_in
        ln = norm(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps)
        gemm_in, w, b = ln, high_precision_weight(self, weight), self.bias
        if dtype is not None:
            gemm_in, w, b = in_dtype(ln, dtype), in_dtype(w, dtype), in_dtype(b, dtype)
        y = linear_parts(gemm_in, w, b, self.out_parts)
        return layernorm_linear_outputs(y, ln, self.return_layernorm_output)


def _block_scaled_layernorm_linear(layer: LayerNormLinear, x, quantizers, config: GemmConfig, act_dtype: torch.dtype,
                                   grad: bool, is_first_microbatch: Optional[bool], fp8_wgrad: bool):
    """LayerNormLinear under BlockScaling: the norm in high precision (as the layer's
    high-precision path computes it), then one block-scaled GEMM with its own backward
    (linear.block_scaled_gemm), whose block cast reads the norm output. Not fused."""
    weight = layer.weight
    refuse_per_tensor_fp8(layer, x, weight)
    ln = norm_high_precision_in(x, layer.layer_norm_weight, layer.layer_norm_bias, layer.normalization, layer.eps)
    y = block_scaled_gemm(layer._workspace, ln, weight, layer.bias, *quantizers, config, act_dtype, grad,
                          is_first_microbatch, fp8_wgrad=fp8_wgrad)
    if layer.out_parts is not None:
        y = y.split(layer.local_out_parts, -1)
    return layernorm_linear_outputs(y, ln, layer.return_layernorm_output)


def layernorm_linear_outputs(y, ln_out, want_ln: bool):
    """LayerNormLinear's result: y (a tensor, or the tuple of the parts' outputs), with the
    norm output appended when want_ln ((y, ln_out), or a flat (y_q, y_k, y_v, ln_out))."""
    if not want_ln:
        return y
    return (*y, ln_out) if isinstance(y, tuple) else (y, ln_out)


def _out_parts(out_features) -> Optional[Tuple[int, ...]]:
    """None for an int out_features, else its parts as a tuple; checks either."""
    if not isinstance(out_features, (tuple, list)):
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features <= 0:
            raise ValueError(f"LayerNormLinear: out_features must be a positive int or a tuple of positive ints "
                             f"(such as (q, k, v)), got {out_features!r}")
        return None
    if not out_features:
        raise ValueError("LayerNormLinear: out_features=() has no parts; give a positive int, or a tuple of "
                         "positive ints such as (q, k, v)")
    for i, part in enumerate(out_features):
        if isinstance(part, bool) or not isinstance(part, int) or part <= 0:
            raise ValueError(f"LayerNormLinear: out_features part {i} must be a positive int, got {part!r} "
                             f"(out_features={out_features!r})")
    return tuple(out_features)


class _LayerNormLinearFn(torch.autograd.Function):
    """Forward: fused norm -> FP8 (+ X^T), fprop. Backward: cast of dY (+ dY^T), dgrad, wgrad,
    norm backward. Saved: x (for the norm backward), mean/rstd, X^T FP8 and its scale_inv."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, w_fp8, q_input: Quantizer, q_grad: Quantizer,
                config: GemmConfig, act_dtype, eps: float, layer: bool, need_wgrad: bool, want_ln: bool):
        x2 = _rows(x).contiguous()  # (M, K)
        xq, mean, rstd, ln_out = norm_fp8(x2, ln_weight, ln_bias, layer, eps, q_input, need_wgrad, want_ln)
        y = gemm.fprop(xq.data, xq.scale_inv, *weight_operands(w_fp8), config, act_dtype, bias)  # (M, N)
        ctx.save_for_backward(x2, ln_weight, ln_bias, mean, rstd, xq.data_t, xq.scale_inv)
        ctx.w_fp8, ctx.q_grad, ctx.config, ctx.act_dtype = w_fp8, q_grad, config, act_dtype
        ctx.in_shape, ctx.need_wgrad = x.shape, need_wgrad
        ctx.weight_dtype = weight.dtype
        y = unsafe_view(y, (*x.shape[:-1], y.shape[-1]))
        # Only outputs that exist: a None output would get a None gradient, which torch.compile's
        # tracing of the backward cannot handle.
        return y if ln_out is None else (y, unsafe_view(ln_out, x.shape))

    @staticmethod
    def backward(ctx, dy, d_ln_out=None):
        x2, ln_weight, ln_bias, mean, rstd, x_t, x_scale_inv = ctx.saved_tensors
        dy2 = _rows(dy)
        if dy2.dtype != ctx.act_dtype:
            dy2 = dy2.to(ctx.act_dtype)
        need_wgrad = ctx.needs_input_grad[3] and ctx.need_wgrad
        # (M, N), (N, Mp); db (N,) float32 from the same read of dY (autograd casts it to the bias dtype)
        dy_data, dy_t, dy_scale_inv, db = ctx.q_grad.cast(dy2, transpose=need_wgrad, dbias=ctx.needs_input_grad[4])
        dx = d_lnw = d_lnb = dw = None
        if any(ctx.needs_input_grad[:3]):
            d_ln = gemm.dgrad(dy_data, dy_scale_inv, *weight_transposed(ctx.w_fp8), ctx.config, ctx.act_dtype)
            if d_ln_out is not None:
                d_ln = d_ln + _rows(d_ln_out).to(d_ln.dtype)
            dx, d_lnw, d_lnb = norm_backward(d_ln, x2, ln_weight, ln_bias, mean, rstd, ctx.needs_input_grad[0])
        if need_wgrad:
            dw = gemm.wgrad(dy_t, dy_scale_inv, x_t, x_scale_inv, ctx.config, ctx.weight_dtype)
        if dx is not None:
            dx = dx.view(*ctx.in_shape)  # ints, not a torch.Size: parsed ~2 us faster
        return dx, d_lnw, d_lnb, dw, db, None, None, None, None, None, None, None, None, None
