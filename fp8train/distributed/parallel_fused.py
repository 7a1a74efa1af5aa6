"""Tensor-parallel LayerNormLinear and LayerNormMLP: the norm feeds a column-parallel GEMM
(LayerNormLinear's, or LayerNormMLP's fc1); LayerNormMLP's fc2 is row-parallel.

Notation as in docs/distributed.md (W ranks, M rows, m = M / W per rank under SP).

  LayerNormLinear  y (M, N/W) = Norm(x) W_local^T + b_local   (out_features=(q, k, v): W_local is
                   [W_q,r; W_k,r; W_v,r], the layer splits y into the parts afterwards)
  LayerNormMLP     h (M, F1/W) = Norm(x) W1_local^T + b1_local   (swiglu: [gate_r; up_r])
                   y = sum over ranks of act(h) (M, F/W) W2_local^T, + b2 once after the reduction

Norm parameters are replicated (full hidden on every rank). Without SP x (M, K) is the same on
every rank and so is everything up to fc1's input; fc1's dgrad is all-reduced before the norm
backward, and fc2's output is all-reduced. Under SP x is this rank's rows (m, K): the norm runs
on them and writes FP8 with a scale all ranks share; the FP8 rows are gathered once and the
gathered rows feed fc1's fprop and, as their transposed copy saved for backward, fc1's wgrad
(never gathered again); fc1's dgrad is reduce-scattered back to this rank's rows, fc2's output
reduce-scattered. The norm parameters' gradients are then partial (this rank's rows only) and
are all-reduced over the group, in float32, inside the backward (Megatron leaves that to the
optimizer), so every rank holds the single-process layer's gradients. In both backwards the
column dgrad's reduction is issued before the column wgrad GEMM and waited for after it
(tp_comm.column_dgrad), so the two overlap.

Note (the group-consistent norm producer): under current scaling the fused norm runs as its
two-pass producer: the statistics pass takes the amax of the normalized rows, the
Quantizer.produce hook all-reduces that one float (MAX) over the group, then the cast pass
writes FP8 with the shared scale. Chosen over "norm to high precision, then cast_consistent"
because it keeps the fused kernels (no high-precision norm output written and read back) at
the same cost in communication, one scalar all-reduce. Under delayed scaling it is one launch
with the scale from the group-reduced history (`autocast(amax_reduction=group)`); a fresh
quantizer's calibration goes through the same hook.
"""
from __future__ import annotations

import functools

import torch

from .. import gemm
from ..modules.activation import activation_backward_fp8, activation_fp8, activation_high_precision
from ..modules.linear import linear_parts
from ..modules.norm import norm_backward, norm_fp8, norm_high_precision
from ..quantizer import Quantizer
from ..recipe import GemmConfig
from .fp8_comm import reduce_amax
from .tp_comm import PendingReduction, all_reduce_sum, column_dgrad, column_fprop, row_fprop, row_grad_output, rows
from .tp_config import TPConfig
from .tp_mappings import column_input, high_precision_forward, sum_grad


# --------------------------------------------------------------------------- shared steps


def _norm_fprop(x2, ln_weight, ln_bias, layer: bool, eps: float, q_input: Quantizer, w_fp8, config: GemmConfig,
                act_dtype, bias, need_wgrad: bool, want_ln: bool, tp: TPConfig):
    """Norm(x2) -> FP8 -> the column-parallel fprop (one FP8 gather under SP).
    Returns (y (M, N/W), X^T (K, Mp) fp8 of all M rows or None, X's scale_inv, mean, rstd,
    the norm output (x2's rows, high precision) or None)."""
    sp = tp.sequence_parallel
    hook = functools.partial(reduce_amax, groups=tp.group) if sp else None  # see the module docstring
    # Without SP the norm writes the transposed copy in the same pass; under SP it is formed
    # after the gather, from all M rows (column_fprop).
    xq, mean, rstd, ln_out = norm_fp8(x2, ln_weight, ln_bias, layer, eps, q_input, need_wgrad and not sp, want_ln,
                                      hook)
    y, x_t, x_scale_inv = column_fprop(xq, w_fp8, config, act_dtype, bias, need_wgrad, tp)
    return y, x_t, x_scale_inv, mean, rstd, ln_out


def _norm_backward_tp(dgrad: PendingReduction, d_ln_out, x2, ln_weight, ln_bias, mean, rstd, need_dx: bool,
                      tp: TPConfig):
    """The column-parallel dgrad (column_dgrad's, waited for here: the caller queues the wgrad
    GEMM in between) reduced over the group (to this rank's rows under SP), plus the gradient
    of a returned norm output (already this rank's), then the norm backward.
    Returns (dx (rows of x2) or None, d ln_weight, d ln_bias or None)."""
    d_ln = dgrad.wait()  # (M, K), SP: (m, K)
    if d_ln_out is not None:
        d_ln = d_ln + rows(d_ln_out).to(d_ln.dtype)
    if not tp.sequence_parallel:  # every rank normalized all rows: its parameter gradients are complete
        return norm_backward(d_ln, x2, ln_weight, ln_bias, mean, rstd, need_dx)
    dx, d_lnw, d_lnb = norm_backward(d_ln, x2, ln_weight, ln_bias, mean, rstd, need_dx, torch.float32)
    # this rank's rows' share of the norm parameters' gradients: one all-reduce for both, float32
    flat = all_reduce_sum(d_lnw if d_lnb is None else torch.cat((d_lnw, d_lnb)), tp)
    d_lnw = flat[:d_lnw.numel()].to(ln_weight.dtype)
    d_lnb = None if d_lnb is None else flat[d_lnw.numel():].to(ln_bias.dtype)
    return dx, d_lnw, d_lnb


def _sp_rows(x: torch.Tensor, tp: TPConfig) -> tuple:
    """The leading dims of the column-parallel output: under SP every rank's rows."""
    return (tp.world * x.shape[0], *x.shape[1:-1]) if tp.sequence_parallel else tuple(x.shape[:-1])


# --------------------------------------------------------------------------- LayerNormLinear


class LayerNormLinearTPFn(torch.autograd.Function):
    """Column-parallel LayerNormLinear. Forward: norm -> FP8 (group scale under SP), gather
    (SP), fprop. Backward: local cast of dY (M, N/W), dgrad and its reduction issued (all-
    reduce, or reduce-scatter under SP), wgrad with the saved transposed copy of the gathered
    rows while it runs, then the norm backward on this rank's rows. Saved: x's rows,
    mean/rstd, X^T (K, Mp) fp8 and its scale_inv."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, w_fp8, q_input: Quantizer, q_grad: Quantizer,
                config: GemmConfig, act_dtype, eps: float, layer: bool, need_wgrad: bool, want_ln: bool,
                tp: TPConfig):
        x2 = rows(x).contiguous()  # (M, K), SP: (m, K)
        y, x_t, x_scale_inv, mean, rstd, ln_out = _norm_fprop(x2, ln_weight, ln_bias, layer, eps, q_input, w_fp8,
                                                              config, act_dtype, bias, need_wgrad, want_ln, tp)
        ctx.save_for_backward(x2, ln_weight, ln_bias, mean, rstd, x_t, x_scale_inv)
        ctx.w_fp8, ctx.q_grad, ctx.config, ctx.act_dtype, ctx.tp = w_fp8, q_grad, config, act_dtype, tp
        ctx.in_shape, ctx.need_wgrad, ctx.weight_dtype = x.shape, need_wgrad, weight.dtype
        y = y.view(*_sp_rows(x, tp), y.shape[-1])  # (M, N/W)
        return y if ln_out is None else (y, ln_out.view(x.shape))  # ln_out: this rank's rows

    @staticmethod
    def backward(ctx, dy, d_ln_out=None):
        x2, ln_weight, ln_bias, mean, rstd, x_t, x_scale_inv = ctx.saved_tensors
        needs = ctx.needs_input_grad
        need_wgrad = needs[3] and ctx.need_wgrad
        # dY (M, N/W) is this rank's own columns: a local cast; db from the same pass
        dy_data, dy_t, dy_scale_inv, db = ctx.q_grad.cast(rows(dy).to(ctx.act_dtype), transpose=need_wgrad,
                                                          dbias=needs[4])
        # dgrad, its reduction left in flight while the wgrad GEMM runs (tp_comm.column_dgrad)
        dgrad = column_dgrad(dy_data, dy_scale_inv, ctx.w_fp8, ctx.config, ctx.act_dtype, ctx.tp) \
            if any(needs[:3]) else None
        dw = gemm.wgrad(dy_t, dy_scale_inv, x_t, x_scale_inv, ctx.config, ctx.weight_dtype) if need_wgrad else None
        dx = d_lnw = d_lnb = None
        if dgrad is not None:
            dx, d_lnw, d_lnb = _norm_backward_tp(dgrad, d_ln_out, x2, ln_weight, ln_bias, mean, rstd, needs[0], ctx.tp)
        if dx is not None:
            dx = dx.view(ctx.in_shape)
        return (dx, d_lnw, d_lnb, dw, db) + (None,) * 10


def layernorm_linear_high_precision(x, ln_weight, ln_bias, weight, bias, normalization: str, eps: float,
                                    tp: TPConfig, parts=None):
    """(y, norm output) of a TP LayerNormLinear outside fp8train.autocast (torch ops, the same
    communication; under SP the norm parameters' gradients are summed over the group). parts:
    the local out_features blocks (y is then a tuple, one F.linear per block on the one
    gathered input), or None."""
    if tp.sequence_parallel:
        ln_weight, ln_bias = sum_grad(ln_weight, tp), sum_grad(ln_bias, tp)
    ln = norm_high_precision(x, ln_weight, ln_bias, normalization, eps)
    return linear_parts(column_input(ln, tp), weight, bias, parts), ln


# --------------------------------------------------------------------------- LayerNormMLP


class LayerNormMLPTPFn(torch.autograd.Function):
    """LayerNormMLP with fc1 column- and fc2 row-parallel.
    Forward: norm -> FP8 X, gathered once under SP; fc1 -> H (M, F1/W); act -> FP8 A (this
    rank's columns, its own scale); fc2 partial sums reduced in the reduce dtype (all-reduce,
    or reduce-scatter under SP), + b2 once.
    Backward: dY cast (under SP with the group's scale and gathered as FP8); fc2 dgrad -> dA,
    fc2 wgrad; act backward -> FP8 dH (+dH^T, db1); fc1 dgrad and its reduction issued; fc1
    wgrad with the saved X^T of the gathered rows while it runs; norm backward (SP: parameter
    gradients all-reduced).
    Saved: x's rows, mean/rstd, X^T and A^T in FP8 with their scale_inv, and H."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, w1, b1, w2, b2, w1_fp8, w2_fp8, q1_input: Quantizer,
                q1_grad: Quantizer, q2_input: Quantizer, q2_grad: Quantizer, config: GemmConfig, act_dtype,
                eps: float, layer: bool, activation: str, grad: bool, tp1: TPConfig, tp2: TPConfig):
        x2 = rows(x).contiguous()  # (M, K), SP: (m, K)
        h, x_t, x_si, mean, rstd, _ = _norm_fprop(x2, ln_weight, ln_bias, layer, eps, q1_input, w1_fp8, config,
                                                  act_dtype, b1, grad, False, tp1)  # h (M, F1/W)
        aq = activation_fp8(h, activation, q2_input, grad)  # (M, F/W), (F/W, Mp)
        y = row_fprop(aq.data, aq.scale_inv, w2_fp8, config, act_dtype, b2, tp2)  # (M, K), SP: (m, K)
        ctx.save_for_backward(x2, ln_weight, ln_bias, mean, rstd, x_t, x_si, h, aq.data_t, aq.scale_inv)
        ctx.w_fp8, ctx.q_grad, ctx.tp = (w1_fp8, w2_fp8), (q1_grad, q2_grad), (tp1, tp2)
        ctx.config, ctx.act_dtype, ctx.activation, ctx.in_shape = config, act_dtype, activation, x.shape
        ctx.dtypes = (w1.dtype, b1.dtype if b1 is not None else None, w2.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, ln_weight, ln_bias, mean, rstd, x_t, x_si, h, a_t, a_si = ctx.saved_tensors
        (w1_fp8, w2_fp8), (q1_grad, q2_grad), (tp1, tp2) = ctx.w_fp8, ctx.q_grad, ctx.tp
        w1_dtype, b1_dtype, w2_dtype = ctx.dtypes
        needs, config, act_dtype = ctx.needs_input_grad, ctx.config, ctx.act_dtype
        # da (M, F/W); dY^T (K, Mp) of every row (gathered under SP); db2 (K,) float32, full on every rank
        da, dy_t, dy_si, db2 = row_grad_output(rows(dy).to(act_dtype), q2_grad, w2_fp8, config, act_dtype, True,
                                               needs[5], needs[6], tp2)
        dw2 = gemm.wgrad(dy_t, dy_si, a_t, a_si, config, w2_dtype) if needs[5] else None
        # (M, F1/W), (F1/W, Mp); db1 (F1/W,) in b1's dtype from the same pass
        dhq = activation_backward_fp8(da, h, ctx.activation, q1_grad, b1_dtype if needs[4] else None)
        # fc1 dgrad, its reduction left in flight while fc1's wgrad GEMM runs (tp_comm.column_dgrad)
        dgrad = column_dgrad(dhq.data, dhq.scale_inv, w1_fp8, config, act_dtype, tp1) if any(needs[:3]) else None
        dw1 = gemm.wgrad(dhq.data_t, dhq.scale_inv, x_t, x_si, config, w1_dtype) if needs[3] else None
        dx = d_lnw = d_lnb = None
        if dgrad is not None:
            dx, d_lnw, d_lnb = _norm_backward_tp(dgrad, None, x2, ln_weight, ln_bias, mean, rstd, needs[0], tp1)
            if dx is not None:
                dx = dx.view(ctx.in_shape)
        return (dx, d_lnw, d_lnb, dw1, dhq.dbias, dw2, db2) + (None,) * 14


def layernorm_mlp_high_precision(x, ln_weight, ln_bias, w1, b1, w2, b2, normalization: str, activation: str,
                                 eps: float, tp1: TPConfig, tp2: TPConfig) -> torch.Tensor:
    """A TP LayerNormMLP outside fp8train.autocast (torch ops, the same communication)."""
    if tp1.sequence_parallel:
        ln_weight, ln_bias = sum_grad(ln_weight, tp1), sum_grad(ln_bias, tp1)
    ln = norm_high_precision(x, ln_weight, ln_bias, normalization, eps)
    h = high_precision_forward(ln, w1, b1, tp1)  # (M, F1/W): [gate_r, up_r] for swiglu
    return high_precision_forward(activation_high_precision(h, activation), w2, b2, tp2)
