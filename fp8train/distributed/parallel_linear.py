"""Tensor-parallel fp8train.Linear: the sharded FP8 forward/backward (column / row, optionally
sequence-parallel) and the shared prologue of every TP layer's forward.

Notation as in docs/distributed.md: a TP group of W ranks; M rows (tokens) of the full
activation, m = M / W per rank under sequence parallelism (SP).

  column  y_local (M, n/W) = x (M, k) @ W_local^T + b_local      dX = sum over ranks
  column + SP  x is this rank's rows (m, k): FP8 all-gather (group-consistent scale), fprop
          on the gathered rows; backward dgrad, then reduce-scatter dX over rows
  row     y (M, n) = sum over ranks of x_local (M, k/W) @ W_local^T, then + b (once)
  row + SP  this rank's rows of the reduce-scatter, + b; backward: FP8 all-gather of dY
          (group-consistent scale), then dgrad and wgrad on the gathered rows

The column backward issues dX's reduction (all-reduce or reduce-scatter) right after the
dgrad GEMM and waits for it after the wgrad GEMM, so the two overlap. The GEMMs with their
communication are tp_comm.py's (shared with the fused modules); the high-precision path
outside fp8train.autocast is tp_mappings.py's.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import gemm
from ..modules.base import activation_dtype, mark_calibrated
from ..quantizer import Quantizer
from ..recipe import GemmConfig, Recipe
from ..tensor import Float8Tensor
from .fp8_comm import cast_consistent
from .tp_comm import column_dgrad, column_fprop, row_fprop, row_grad_output, rows
from .tp_config import TPConfig
from .tp_mappings import high_precision_forward
from .tp_state import ShardSpec, TPLayout


class _ColumnParallelFn(torch.autograd.Function):
    """Column-parallel FP8 Linear. Saved for backward: the (gathered, under SP) input's
    transposed FP8 copy (K, Mp) and its scale_inv."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_fp8, q_input: Quantizer, q_grad: Quantizer, config: GemmConfig,
                act_dtype: torch.dtype, need_wgrad: bool, tp: TPConfig):
        in_shape = x.shape
        if tp.sequence_parallel:  # this rank's rows, cast with the group's scale, then gathered
            xq = cast_consistent(rows(x), q_input, tp.group)  # (m, K)
            out_shape = (tp.world * in_shape[0], *in_shape[1:-1])
        else:  # x is the same on every rank, so is this cast's scale
            xq = q_input.cast(rows(x), transpose=need_wgrad)  # (M, K), (K, Mp)
            out_shape = tuple(in_shape[:-1])
        y, x_t, x_scale_inv = column_fprop(xq, w_fp8, config, act_dtype, bias, need_wgrad, tp)  # (M, N/W)
        _keep(ctx, x_t, x_scale_inv, w_fp8, q_grad, config, tp, in_shape, act_dtype, need_wgrad, weight.dtype)
        return y.view(*out_shape, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dy2 = rows(dy).to(ctx.act_dtype)
        need_wgrad = ctx.needs_input_grad[1] and ctx.need_wgrad
        # dY (M, N/W) is this rank's own columns: a local cast (no other rank reads it)
        dy_data, dy_t, dy_scale_inv, db = ctx.q_grad.cast(dy2, transpose=need_wgrad, dbias=ctx.needs_input_grad[2])
        # dgrad, its reduction left in flight while the wgrad GEMM runs (tp_comm.column_dgrad)
        pending = column_dgrad(dy_data, dy_scale_inv, ctx.w_fp8, ctx.config, ctx.act_dtype, ctx.tp) \
            if ctx.needs_input_grad[0] else None
        dw = _wgrad(ctx, dy_t, dy_scale_inv) if need_wgrad else None
        dx = pending.wait().view(ctx.in_shape) if pending is not None else None
        return dx, dw, db, None, None, None, None, None, None, None


def _keep(ctx, x_t, x_scale_inv, w_fp8, q_grad, config, tp, in_shape, act_dtype, need_wgrad, weight_dtype) -> None:
    """What both Functions' backward needs: the input's transposed FP8 copy and its scale_inv
    (saved only when wgrad runs) and the GEMM settings."""
    if need_wgrad:
        ctx.save_for_backward(x_t, x_scale_inv)
    ctx.w_fp8, ctx.q_grad, ctx.config, ctx.tp = w_fp8, q_grad, config, tp
    ctx.in_shape, ctx.act_dtype, ctx.need_wgrad, ctx.weight_dtype = in_shape, act_dtype, need_wgrad, weight_dtype


def _wgrad(ctx, dy_t: torch.Tensor, dy_scale_inv: torch.Tensor) -> torch.Tensor:
    """dW = dY^T X from the transposed copies; X^T is the one saved by `_keep`."""
    x_t, x_scale_inv = ctx.saved_tensors
    return gemm.wgrad(dy_t, dy_scale_inv, x_t, x_scale_inv, ctx.config, ctx.weight_dtype)


class _RowParallelFn(torch.autograd.Function):
    """Row-parallel FP8 Linear: the bias is added once, after the reduction. Saved for
    backward: the input shard's transposed FP8 copy (K/W, Mp) and its scale_inv."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_fp8, q_input: Quantizer, q_grad: Quantizer, config: GemmConfig,
                act_dtype: torch.dtype, need_wgrad: bool, tp: TPConfig):
        in_shape = x.shape
        x_data, x_t, x_scale_inv, _ = q_input.cast(rows(x), transpose=need_wgrad)  # (M, K/W), (K/W, Mp)
        y = row_fprop(x_data, x_scale_inv, w_fp8, config, act_dtype, bias, tp)  # (M, N), SP: (M/W, N)
        # the leading dim splits over the ranks under SP (tp_plan checks)
        out_shape = (in_shape[0] // tp.world, *in_shape[1:-1]) if tp.sequence_parallel else tuple(in_shape[:-1])
        _keep(ctx, x_t, x_scale_inv, w_fp8, q_grad, config, tp, in_shape, act_dtype, need_wgrad, weight.dtype)
        return y.view(*out_shape, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.need_wgrad
        dx, dy_t, dy_scale_inv, db = row_grad_output(rows(dy).to(ctx.act_dtype), ctx.q_grad, ctx.w_fp8, ctx.config,
                                                     ctx.act_dtype, need_dgrad, need_wgrad, ctx.needs_input_grad[2],
                                                     ctx.tp)  # dx (M, K/W)
        dw = None
        if dx is not None:
            dx = dx.view(ctx.in_shape)
        if need_wgrad:
            dw = _wgrad(ctx, dy_t, dy_scale_inv)
        return dx, dw, db, None, None, None, None, None, None, None


def tp_plan(layer, x: torch.Tensor, in_features: int) -> Tuple[Optional[Recipe], torch.dtype]:
    """Every TP layer's forward prologue: input checks, then (recipe, activation dtype), the
    recipe None outside fp8train.autocast (the high-precision path).

    Auto precision (recipe.auto_precision) and the dims fallback do not apply to TP layers:
    they run in FP8 inside fp8train.autocast (their shard dims are checked to be FP8-able at
    construction)."""
    recipe = layer.call_recipe()
    layer.check_input(x, in_features, fp8=recipe is not None)
    if isinstance(x, Float8Tensor):
        raise TypeError(f"{layer.describe()}: tensor-parallel layers take high-precision inputs, not Float8Tensor")
    if recipe is None:
        return None, x.dtype
    gemm.check_tensor_device(x)
    return recipe, activation_dtype(x)


def parallel_linear_forward(layer, x: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
    """fp8train.Linear.forward for a layer with a TPConfig (`layer.tp`)."""
    tp: TPConfig = layer.tp
    if not tp.column and isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] != tp.local_in_features:
        raise ValueError(f"{layer.describe()}: a row-parallel layer takes this rank's input shard, last dim "
                         f"in_features / {tp.world} = {tp.local_in_features}; got shape {tuple(x.shape)}")
    recipe, act_dtype = tp_plan(layer, x, tp.local_in_features)
    if tp.sequence_parallel and not tp.column and x.dim() >= 2 and x.shape[0] % tp.world:
        raise ValueError(f"{layer.describe()}: with sequence_parallel the input's leading (sequence) dim "
                         f"{x.shape[0]} must split evenly over the {tp.world} ranks")
    if recipe is None:
        return high_precision_forward(x, layer.weight, layer.bias, tp)
    q_input, q_weight, q_grad = layer.quantizers(recipe, layer.weight.device)
    grad = torch.is_grad_enabled()
    w_fp8 = layer._workspace.get(layer.weight, q_weight, is_first_microbatch,
                                 need_transpose=grad and x.requires_grad, skip=layer.weight_cast_skip)
    fn = _ColumnParallelFn if tp.column else _RowParallelFn
    y = fn.apply(x, layer.weight, layer.bias, w_fp8, q_input, q_grad, recipe.gemm, act_dtype,
                 grad and layer.weight.requires_grad, tp)
    mark_calibrated(q_input, q_weight, q_grad)
    return y


def linear_layout(tp: TPConfig) -> TPLayout:
    """A TP Linear's checkpoint layout: weight sharded on its mode's dim; the bias sharded
    with a column layer's outputs, replicated in a row layer (added after the reduction)."""
    return TPLayout(tp, {"weight": ShardSpec(tp.weight_dim()), "bias": ShardSpec(0 if tp.column else None)})
