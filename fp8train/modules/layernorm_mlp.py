"""fp8train.LayerNormMLP: Norm -> fc1 -> activation -> fc2, every memory-bound step fused into
the FP8 cast that follows it."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import gemm
from ..distributed.parallel_fused import LayerNormMLPTPFn, layernorm_mlp_high_precision
from ..distributed.parallel_linear import tp_plan
from ..distributed.tp_config import ParallelMode, TPConfig
from ..distributed.tp_state import ShardSpec, TPLayout
from ..quantizer import Quantizer
from ..recipe import GemmConfig
from ..tensor import Float8Tensor
from . import high_node
from . import layernorm_mlp_native as mlp_native
from .activation import ACTIVATIONS, activation_backward_fp8, activation_fp8, activation_high_precision
from .base import FP8Module, in_dtype, mark_calibrated, unsafe_view
from .linear import _rows, block_scaled_gemm, init_linear_params, refuse_per_tensor_fp8
from .norm import check_norm_args, make_norm_params, norm_backward, norm_fp8, norm_high_precision, \
    norm_high_precision_in
from .tp_checkpoint import TPCheckpoints
from .weight_workspace import WeightWorkspace, high_precision_weight, weight_operands, weight_transposed

# Re-exported: these lived here before modules/activation.py (export/twins.py, inspect.py, tests).
__all__ = ["LayerNormMLP", "ACTIVATIONS", "activation_high_precision", "activation_fp8", "activation_backward_fp8"]


class LayerNormMLP(FP8Module, TPCheckpoints):
    """y = fc2(act(fc1(Norm(x)))), the transformer MLP.

    Outside fp8train.autocast it computes exactly the torch composition (norm, F.linear,
    the activation of `activation_high_precision`, F.linear); inside, where it runs in high
    precision (auto precision, dims FP8 cannot take), the same bytes come from one C++ node
    on the GPU (high_node.py). In FP8, the norm writes fc1's
    FP8 input, the activation kernel writes fc2's FP8 input (each with the transposed copy
    wgrad needs and the amax), and in the backward the activation-gradient kernel writes
    fc1's FP8 grad-output with its transpose and fc1's bias gradient. swiglu's fc1 has
    2 * ffn_hidden_size outputs (gate, then up).

    Tensor parallelism (docs/distributed.md): with `tp_group` fc1 is column-parallel and fc2
    row-parallel over its W ranks: fc1 weight (F1/W, hidden) (swiglu: rank r holds the rows
    [gate_r; up_r], so its activation pairs matching gate and up columns), fc2 weight
    (hidden, ffn/W), fc2 bias whole, added once after the reduction; norm parameters whole.
    sequence_parallel=True: x and y are this rank's rows (s/W, b, hidden); the norm output is
    gathered once, in FP8. tp_overlap=True (with SP) runs the gathers and reduce-scatters as
    ring collective matmuls. `hidden_size` / `ffn_hidden_size` stay the full dims.
    """

    GEMMS = ("fc1_", "fc2_")

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, normalization: str = "LayerNorm",
                 activation: str = "gelu", eps: float = 1e-5, params_dtype: Optional[torch.dtype] = None,
                 device=None, *, tp_group=None, sequence_parallel: bool = False, tp_overlap: bool = False,
                 tp_reduce_dtype: Optional[torch.dtype] = None):
        super().__init__()
        for what, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LayerNormMLP: {what} must be a positive int, got {v!r}")
        check_norm_args("LayerNormMLP", normalization, eps)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.normalization, self.activation, self.eps = normalization, activation, float(eps)
        self.fc1_out = fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.fc1_tp, self.fc2_tp = _tp_configs(tp_group, sequence_parallel, tp_overlap, tp_reduce_dtype, hidden_size,
                                               ffn_hidden_size, fc1_out)
        world = 1 if self.fc1_tp is None else self.fc1_tp.world
        factory = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        make_norm_params(self, hidden_size, normalization, factory)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out // world, hidden_size, **factory))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out // world, **factory)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size // world, **factory))
        self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        self.reset_parameters()
        self._fc1_workspace, self._fc2_workspace = WeightWorkspace(), WeightWorkspace()
        self._node_plans = mlp_native.NodePlans()  # the C++ node's plans (modules/layernorm_mlp_native.py)
        self._fp8_dims = gemm.dims_ok(hidden_size, fc1_out // world, ffn_hidden_size // world)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)
        # nn.Linear's initialisation of fc1 then fc2 (TP: shards of the unsharded layer's draws)
        layout = self.tp_layout()
        specs = None if layout is None else layout.specs
        for gemm_name, fan_in, fan_out in (("fc1", self.hidden_size, self.fc1_out),
                                           ("fc2", self.ffn_hidden_size, self.hidden_size)):
            w, b = getattr(self, gemm_name + "_weight"), getattr(self, gemm_name + "_bias")
            sharding = None if specs is None else (layout.tp, specs[gemm_name + "_weight"], specs[gemm_name + "_bias"])
            init_linear_params(w, b, fan_in, fan_out, sharding)

    def tp_layout(self) -> Optional[TPLayout]:
        """fc1 weight / bias sharded on dim 0 in `parts` blocks (swiglu: [gate; up], 2 blocks),
        fc2 weight on dim 1; norm parameters and fc2's bias replicated."""
        if self.fc1_tp is None:
            return None
        fc1, replicated = ShardSpec(0, 2 if self.activation == "swiglu" else 1), ShardSpec()
        return TPLayout(self.fc1_tp, {"layer_norm_weight": replicated, "layer_norm_bias": replicated,
                                      "fc1_weight": fc1, "fc1_bias": fc1, "fc2_weight": ShardSpec(1),
                                      "fc2_bias": replicated})

    def describe(self) -> str:
        name = f" '{self.name}'" if self.name else ""
        tp = "" if self.fc1_tp is None else f", tensor-parallel over {self.fc1_tp.world} ranks"
        return f"LayerNormMLP{name}(hidden={self.hidden_size}, ffn={self.ffn_hidden_size}{tp})"

    def extra_repr(self) -> str:
        tp = "" if self.fc1_tp is None else (f", tp_size={self.fc1_tp.world}"
                                             f", sequence_parallel={self.fc1_tp.sequence_parallel}")
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"bias={self.fc1_bias is not None}, normalization={self.normalization}, "
                f"activation={self.activation}, eps={self.eps}{tp}")

    def takes_block_scaling(self) -> bool:
        return self.fc1_tp is None

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        tp1 = self.fc1_tp
        recipe, act_dtype = self.fp8_plan(x, self.hidden_size) if tp1 is None else tp_plan(self, x, self.hidden_size)
        if recipe is None:
            return self._high_precision(x, act_dtype)
        # Read once: each read of a parameter is a Module.__getattr__ call.
        fc1_weight, fc2_weight, ln_weight = self.fc1_weight, self.fc2_weight, self.layer_norm_weight
        q1 = self.quantizers(recipe, fc1_weight.device, "fc1_")
        q2 = self.quantizers(recipe, fc2_weight.device, "fc2_")
        grad = torch.is_grad_enabled()
        if q1[1].blockwise:
            return _block_scaled_mlp(self, x, q1, q2, recipe.gemm, act_dtype, grad, is_first_microbatch,
                                     recipe.fp8_wgrad)
        need_dgrad1 = grad and (x.requires_grad or ln_weight.requires_grad)
        skip = self.weight_cast_skip
        ln_bias, fc1_bias, fc2_bias = self.layer_norm_bias, self.fc1_bias, self.fc2_bias
        entry = None
        # the C++ node where its plan is ready (it re-casts the weights too, where their
        # steady-state launch is prepared; weights FSDP2 gathered in FP8 are taken as they are),
        # else the Python Function, which records for it (traced code never gets here with a
        # plan: compile takes the Function, untouched)
        if tp1 is None and x.is_cuda and not torch.compiler.is_compiling():
            needs = mlp_native.needs_of(x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
            activations = (q2[0], q1[0], q1[2], q2[2])  # a, x, dh, dy: the quantizers the groups point into
            if mlp_native.eligible(x, activations):
                entry = self._node_plans.entry(mlp_native.signature(self, x, act_dtype, needs, recipe.gemm),
                                               activations)
                plan = mlp_native.plan_for(self, entry, x, act_dtype, needs, recipe.gemm, *activations)
                if plan is not None:
                    w1, w1_cast = self._fc1_workspace.for_native(fc1_weight, q1[1], is_first_microbatch,
                                                                 need_dgrad1, skip)
                    w2, w2_cast = self._fc2_workspace.for_native(fc2_weight, q2[1], is_first_microbatch, grad, skip)
                    return mlp_native.forward(plan, x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight,
                                              fc2_bias, w1, w2, needs, w1_cast, w2_cast)
        w1 = self._fc1_workspace.get(fc1_weight, q1[1], is_first_microbatch, need_transpose=need_dgrad1, skip=skip)
        w2 = self._fc2_workspace.get(fc2_weight, q2[1], is_first_microbatch, need_transpose=grad, skip=skip)
        args = (x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, w1, w2, q1[0], q1[2], q2[0], q2[2],
                recipe.gemm, act_dtype, self.eps, self.normalization == "LayerNorm", self.activation, grad)
        if tp1 is not None:
            y = LayerNormMLPTPFn.apply(*args, tp1, self.fc2_tp)
            mark_calibrated(*q1, *q2)
            return y
        y = _LayerNormMLPFn.apply(*args, entry)
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
        if self.fc1_tp is not None:  # outside autocast (TP layers have no dims fallback or auto precision)
            return layernorm_mlp_high_precision(x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                                                self.fc1_bias, self.fc2_weight, self.fc2_bias, self.normalization,
                                                self.activation, self.eps, self.fc1_tp, self.fc2_tp)
        fc1_weight, fc2_weight = self.fc1_weight, self.fc2_weight
        gathered = isinstance(fc1_weight, Float8Tensor) or isinstance(fc2_weight, Float8Tensor)
        # inside autocast: one C++ node where it can take the call (not weights FSDP2 gathered in FP8)
        if dtype is not None and not gathered:
            y = high_node.forward(self, x, dtype)
            if y is not None:
                return y
        norm = norm_high_precision if dtype is None else norm_high_precision_in
        ln = norm(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps)
        params = (high_precision_weight(self, fc1_weight), self.fc1_bias, high_precision_weight(self, fc2_weight),
                  self.fc2_bias)
        if dtype is not None:
            ln = in_dtype(ln, dtype)
            params = tuple(in_dtype(p, dtype) for p in params)
        h = F.linear(ln, params[0], params[1])
        return F.linear(activation_high_precision(h, self.activation), params[2], params[3])


def _tp_configs(tp_group, sequence_parallel, tp_overlap, reduce_dtype, hidden: int, ffn: int, fc1_out: int):
    """(fc1 column config, fc2 row config), or (None, None) without a tp_group."""
    if tp_group is None:
        if sequence_parallel or tp_overlap or reduce_dtype is not None:
            flag = ("sequence_parallel=True" if sequence_parallel else "tp_overlap=True" if tp_overlap
                    else "tp_reduce_dtype")
            raise ValueError(f"LayerNormMLP: {flag} needs tp_group (a torch.distributed ProcessGroup; "
                             "torch.distributed.group.WORLD for all ranks)")
        return None, None
    # fc2 first: its in_features = ffn must split into shards of multiples of 16, which also
    # makes swiglu's [gate_r; up_r] rows line up
    fc2 = TPConfig(tp_group, ParallelMode.ROW, ffn, hidden, sequence_parallel, tp_overlap, "LayerNormMLP fc2",
                   reduce_dtype)
    fc1 = TPConfig(tp_group, ParallelMode.COLUMN, hidden, fc1_out, sequence_parallel, tp_overlap, "LayerNormMLP fc1",
                   reduce_dtype)
    return fc1, fc2



def _block_scaled_mlp(layer: LayerNormMLP, x, q1, q2, config: GemmConfig, act_dtype: torch.dtype, grad: bool,
                      is_first_microbatch: Optional[bool], fp8_wgrad: bool) -> torch.Tensor:
    """LayerNormMLP under BlockScaling: the norm and the activation in high precision (as the
    layer's high-precision path computes them), fc1 and fc2 as block-scaled GEMMs with their
    own backward (linear.block_scaled_gemm). Not fused: the norm and activation outputs are
    cast by the GEMMs' block casts."""
    w1, w2 = layer.fc1_weight, layer.fc2_weight
    refuse_per_tensor_fp8(layer, x, w1, w2)
    ln = norm_high_precision_in(x, layer.layer_norm_weight, layer.layer_norm_bias, layer.normalization, layer.eps)
    h = block_scaled_gemm(layer._fc1_workspace, ln, w1, layer.fc1_bias, *q1, config, act_dtype, grad,
                          is_first_microbatch, fp8_wgrad=fp8_wgrad)
    a = activation_high_precision(h, layer.activation)
    return block_scaled_gemm(layer._fc2_workspace, a, w2, layer.fc2_bias, *q2, config, act_dtype, grad,
                             is_first_microbatch, fp8_wgrad=fp8_wgrad)


class _LayerNormMLPFn(torch.autograd.Function):
    """Forward: norm -> FP8 X (+X^T); fc1; act -> FP8 A (+A^T); fc2.
    Backward: cast dY (+dY^T); fc2 dgrad -> dA; fc2 wgrad; act backward -> FP8 dH (+dH^T,
    fc1 bias grad); fc1 dgrad -> d(norm out); fc1 wgrad; norm backward.
    Saved: x, mean/rstd, X^T and A^T in FP8 with their scale_inv, and H (fc1's output, the
    activation backward needs it)."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, w1, b1, w2, b2, w1_fp8, w2_fp8, q1_input: Quantizer,
                q1_grad: Quantizer, q2_input: Quantizer, q2_grad: Quantizer, config: GemmConfig, act_dtype,
                eps: float, layer: bool, activation: str, grad: bool, entry=None):
        # entry: the C++ node's NodeEntry for this call, which collects the launch groups used
        found = [] if entry is not None else None
        x2 = _rows(x).contiguous()  # (M, K)
        xq, mean, rstd, _ = norm_fp8(x2, ln_weight, ln_bias, layer, eps, q1_input, grad, False, found=found)
        h = gemm.fprop(xq.data, xq.scale_inv, *weight_operands(w1_fp8), config, act_dtype, b1)  # (M, F1)
        aq = activation_fp8(h, activation, q2_input, grad, found=found)  # (M, F), (F, Mp)
        if entry is not None:
            entry.set_fwd(tuple(found))
        ctx.entry = entry
        y = gemm.fprop(aq.data, aq.scale_inv, *weight_operands(w2_fp8), config, act_dtype, b2)  # (M, K)
        ctx.save_for_backward(x2, ln_weight, ln_bias, mean, rstd, xq.data_t, xq.scale_inv, h, aq.data_t,
                              aq.scale_inv)
        ctx.w_fp8 = (w1_fp8, w2_fp8)
        ctx.q_grad = (q1_grad, q2_grad)
        ctx.config, ctx.act_dtype, ctx.activation, ctx.in_shape = config, act_dtype, activation, x.shape
        ctx.dtypes = (w1.dtype, b1.dtype if b1 is not None else None, w2.dtype)
        return unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

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
        found = [] if ctx.entry is not None else None
        dhq = activation_backward_fp8(da, h, ctx.activation, q1_grad, b1_dtype if needs[4] else None, found=found)
        db1 = dhq.dbias
        dw1 = gemm.wgrad(dhq.data_t, dhq.scale_inv, x_t, x_si, config, w1_dtype) if needs[3] else None
        dx = d_lnw = d_lnb = None
        if any(needs[:3]):
            d_ln = gemm.dgrad(dhq.data, dhq.scale_inv, *weight_transposed(w1_fp8), config, act_dtype)  # (M, K)
            dx, d_lnw, d_lnb = norm_backward(d_ln, x2, ln_weight, ln_bias, mean, rstd, needs[0], found=found)
            if dx is not None:
                dx = dx.view(*ctx.in_shape)
        if found is not None:
            ctx.entry.set_bwd((found[0], found[1] if len(found) > 1 else None))
        return (dx, d_lnw, d_lnb, dw1, db1, dw2, db2) + (None,) * 13
