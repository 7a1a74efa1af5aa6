"""Tensor-parallel layers outside fp8train.autocast: torch GEMMs in the parameters' dtype with
the same communication as the FP8 path, through Megatron-style autograd mappings (a
collective forward, its adjoint backward)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .tp_comm import all_gather_rows, all_reduce_sum, reduce_scatter_rows
from .tp_config import TPConfig


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (column input without
    SP; the bias of a row-parallel layer with SP; norm parameters under SP)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_sum(g.contiguous().clone(), ctx.tp), None


class _SumForward(torch.autograd.Function):
    """Sum over the group forward; identity backward (row output, no SP)."""

    @staticmethod
    def forward(ctx, y, tp):
        return all_reduce_sum(y.contiguous().clone(), tp)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 forward; reduce-scatter backward (column input with SP)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather_rows(x, tp)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_rows(g, ctx.tp), None


class _ScatterRows(torch.autograd.Function):
    """Reduce-scatter along dim 0 forward; all-gather backward (row output with SP)."""

    @staticmethod
    def forward(ctx, y, tp):
        ctx.tp = tp
        return reduce_scatter_rows(y, tp)

    @staticmethod
    def backward(ctx, g):
        return all_gather_rows(g, ctx.tp), None


def sum_grad(t: Optional[torch.Tensor], tp: TPConfig) -> Optional[torch.Tensor]:
    """t, whose gradient is summed over the group in backward (a replicated parameter each
    rank uses on its own rows only, e.g. the norm weight under SP)."""
    return None if t is None else _SumGrad.apply(t, tp)


def column_input(x: torch.Tensor, tp: TPConfig) -> torch.Tensor:
    """A column-parallel GEMM's input: under SP every rank's rows (gathered; the gradient
    reduce-scattered), else x itself (its gradient summed over the group)."""
    return _GatherRows.apply(x, tp) if tp.sequence_parallel else _SumGrad.apply(x, tp)


def high_precision_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           tp: TPConfig) -> torch.Tensor:
    """A TP Linear's GEMM outside fp8train.autocast: torch GEMMs with the same communication."""
    if tp.column:
        return F.linear(column_input(x, tp), weight, bias)
    y = F.linear(x, weight)
    if tp.sequence_parallel:
        # Each rank adds the bias to its own rows only: its gradient is summed over the ranks
        # (as the FP8 path does), so every rank holds the full-layer bias gradient.
        y = _ScatterRows.apply(y, tp)
        return y if bias is None else y + sum_grad(bias, tp)
    y = _SumForward.apply(y, tp)
    return y if bias is None else y + bias
