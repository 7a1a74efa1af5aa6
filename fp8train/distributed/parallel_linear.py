"""Tensor-parallel fp8train.Linear: the TP settings, the sharded FP8 forward/backward, and
the unsharded (high-precision) path outside fp8train.autocast.

Notation as in docs/distributed.md: a TP group of W ranks; M rows (tokens) of the full
activation, m = M / W per rank under sequence parallelism (SP).

  column  y_local (M, n/W) = x (M, k) @ W_local^T + b_local      dX = sum over ranks
  column + SP  x is this rank's rows (m, k): FP8 all-gather (group-consistent scale), fprop
          on the gathered rows; backward dgrad, then reduce-scatter dX over rows
  row     y (M, n) = sum over ranks of x_local (M, k/W) @ W_local^T, then + b (once)
  row + SP  this rank's rows of the reduce-scatter, + b; backward: FP8 all-gather of dY
          (group-consistent scale), then dgrad and wgrad on the gathered rows

Note: partial sums (the row-parallel output, the column-parallel dX) are reduced in float32
and cast to the activation dtype once after the reduction (as the collective matmuls'
default accum_dtype), so the result does not depend on W beyond float32 summation order.
With `tp_overlap` (SP only) the four SP communication points run as the ring collective
matmuls of collective_matmul.py instead of one collective next to one GEMM.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from .. import gemm
from ..autocast import active_recipe
from ..quantizer import Quantizer
from ..recipe import GemmConfig
from ..tensor import Float8Tensor
from .collective_matmul import all_gather_dgrad, all_gather_fprop, dgrad_reduce_scatter, fprop_reduce_scatter
from .fp8_comm import _all_gather_into, all_gather_fp8, cast_consistent, transpose_rows
from .groups import group_rank, group_size

_ACCUM = torch.float32  # dtype partial sums are reduced in (see the module docstring)


class ParallelMode(enum.Enum):
    COLUMN = "column"  # out_features sharded: weight (out/W, in), bias (out/W)
    ROW = "row"        # in_features sharded: weight (out, in/W), bias full, added after the reduction


@dataclasses.dataclass(frozen=True)
class TPConfig:
    """How one Linear is sharded over a tensor-parallel group. `world` and `rank` are read
    from the group at construction (torch.distributed must be initialised)."""

    group: ProcessGroup
    mode: ParallelMode
    in_features: int
    out_features: int
    sequence_parallel: bool = False
    overlap: bool = False  # tp_overlap: ring collective matmuls for the SP gathers / reduce-scatters
    world: int = dataclasses.field(init=False)
    rank: int = dataclasses.field(init=False)

    def __post_init__(self):
        what = f"Linear(in={self.in_features}, out={self.out_features}, parallel_mode={self.mode.value!r})"
        if not isinstance(self.group, ProcessGroup):
            raise ValueError(f"{what}: tp_group must be a torch.distributed ProcessGroup (for the whole world: "
                             f"torch.distributed.group.WORLD), got {self.group!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"{what}: sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"{what}: tp_overlap must be a bool, got {self.overlap!r}")
        if self.overlap and not self.sequence_parallel:
            raise ValueError(f"{what}: tp_overlap=True overlaps the sequence-parallel all-gather / reduce-scatter "
                             "with the GEMMs; it needs sequence_parallel=True (without SP the layer's one "
                             "all-reduce has no ring form here)")
        object.__setattr__(self, "world", group_size(self.group))
        object.__setattr__(self, "rank", group_rank(self.group))
        name, dim = (("out_features", self.out_features) if self.mode is ParallelMode.COLUMN
                     else ("in_features", self.in_features))
        if dim % self.world:
            raise ValueError(f"{what}: {name}={dim} does not split evenly over the {self.world} ranks of tp_group")
        if not gemm.dims_ok(self.local_in_features, self.local_out_features):
            raise ValueError(f"{what}: each rank's shard is ({self.local_out_features}, {self.local_in_features}); "
                             "tensor-parallel FP8 layers need both shard dims to be multiples of 16")

    @classmethod
    def create(cls, tp_group, parallel_mode, sequence_parallel: bool, in_features: int,
               out_features: int, tp_overlap: bool = False) -> Optional["TPConfig"]:
        """The config for Linear's constructor arguments; None for an unsharded layer."""
        if parallel_mode is None:
            if sequence_parallel or tp_overlap:
                flag = "sequence_parallel" if sequence_parallel else "tp_overlap"
                raise ValueError(f"Linear: {flag}=True needs parallel_mode='column' or 'row'")
            if tp_group is not None:
                raise ValueError("Linear: tp_group given without parallel_mode; pass parallel_mode='column' or 'row'")
            return None
        try:
            mode = ParallelMode(parallel_mode)
        except ValueError:
            raise ValueError(f"Linear: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}") from None
        if tp_group is None:
            raise ValueError(f"Linear: parallel_mode={parallel_mode!r} needs tp_group (a torch.distributed "
                             "ProcessGroup; torch.distributed.group.WORLD for all ranks)")
        return cls(tp_group, mode, in_features, out_features, sequence_parallel, tp_overlap)

    @property
    def column(self) -> bool:
        return self.mode is ParallelMode.COLUMN

    @property
    def local_in_features(self) -> int:
        return self.in_features if self.column else self.in_features // self.world

    @property
    def local_out_features(self) -> int:
        return self.out_features // self.world if self.column else self.out_features

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of `full` along `dim` (W equal parts, rank order)."""
        return full.chunk(self.world, dim)[self.rank].contiguous()

    def weight_dim(self) -> int:
        return 0 if self.column else 1


# --------------------------------------------------------------------------- collectives


def all_reduce_sum(t: torch.Tensor, tp: TPConfig) -> torch.Tensor:
    dist.all_reduce(t, group=tp.group)
    return t


def reduce_scatter_rows(t: torch.Tensor, tp: TPConfig) -> torch.Tensor:
    """This rank's rows (M/W, ...) of the sum over ranks of t (M, ...)."""
    out = torch.empty((t.shape[0] // tp.world, *t.shape[1:]), dtype=t.dtype, device=t.device)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # see _all_gather_into
    rs(out, t.contiguous(), group=tp.group)
    return out


def all_gather_rows(t: torch.Tensor, tp: TPConfig) -> torch.Tensor:
    """(W*m, ...): every rank's t (m, ...) in rank order."""
    t = t.contiguous()
    out = torch.empty((tp.world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_into(out, t, tp.group)
    return out


def all_gather_dim(t: torch.Tensor, tp: TPConfig, dim: int) -> torch.Tensor:
    """Every rank's t (the same shape everywhere) concatenated along `dim` in rank order
    (unsharding a parameter; not on the training path)."""
    parts = [torch.empty_like(t) for _ in range(tp.world)]
    dist.all_gather(parts, t.detach().contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


# --------------------------------------------------------------------------- high precision


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (column input without
    SP; the bias of a row-parallel layer with SP)."""

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


def high_precision_forward(x, weight, bias, tp: TPConfig):
    """The TP layer outside fp8train.autocast: torch GEMMs with the same communication."""
    if tp.column:
        x = _GatherRows.apply(x, tp) if tp.sequence_parallel else _SumGrad.apply(x, tp)
        return F.linear(x, weight, bias)
    y = F.linear(x, weight)
    if tp.sequence_parallel:
        # Each rank adds the bias to its own rows only: its gradient is summed over the ranks
        # (as the FP8 path does), so every rank holds the full-layer bias gradient.
        y = _ScatterRows.apply(y, tp)
        return y if bias is None else y + _SumGrad.apply(bias, tp)
    y = _SumForward.apply(y, tp)
    return y if bias is None else y + bias


# --------------------------------------------------------------------------- FP8


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


# The four sequence-parallel communication points, each either one collective next to one
# GEMM or (tp.overlap) the ring collective matmul of collective_matmul.py. Both forms give
# the same result up to float32 summation order.


def _gather_fprop(x, q_input, w_fp8, config, act_dtype, bias, tp: TPConfig):
    """Column + SP forward: Y (M, N/W) = AllGather(x (m, K)) @ W_local^T + b_local.
    Returns (Y, gathered x (M, K) fp8, its scale_inv, shared by the group)."""
    local = cast_consistent(x, q_input, tp.group)
    if tp.overlap:
        y, x_data = all_gather_fprop(local.data, local.scale_inv, *_operands(w_fp8), config, act_dtype, tp.group,
                                     bias)
        return y, x_data, local.scale_inv
    x_data = all_gather_fp8(local.data, tp.group)
    return gemm.fprop(x_data, local.scale_inv, *_operands(w_fp8), config, act_dtype, bias), x_data, local.scale_inv


def _dgrad_scatter(dy_data, dy_scale_inv, w_fp8, config, act_dtype, tp: TPConfig):
    """Column + SP backward: this rank's rows (m, K) of the sum over ranks of dY_local @ W_local."""
    if tp.overlap:
        return dgrad_reduce_scatter(dy_data, dy_scale_inv, *_transposed(w_fp8), config, act_dtype, tp.group,
                                    accum_dtype=_ACCUM)
    dx = gemm.dgrad(dy_data, dy_scale_inv, *_transposed(w_fp8), config, _ACCUM)  # (M, K) partial
    return reduce_scatter_rows(dx, tp).to(act_dtype)


def _fprop_scatter(x_data, x_scale_inv, w_fp8, config, act_dtype, bias, tp: TPConfig):
    """Row + SP forward: this rank's rows (M/W, N) of the sum over ranks of x_local @ W_local^T, + b."""
    if tp.overlap:
        return fprop_reduce_scatter(x_data, x_scale_inv, *_operands(w_fp8), config, act_dtype, tp.group, bias,
                                    accum_dtype=_ACCUM)
    y = reduce_scatter_rows(gemm.fprop(x_data, x_scale_inv, *_operands(w_fp8), config, _ACCUM), tp)
    if bias is not None:
        y += bias.to(_ACCUM)
    return y.to(act_dtype)


def _gather_dgrad(dy, q_grad, w_fp8, config, act_dtype, need_dgrad: bool, tp: TPConfig):
    """Row + SP backward: dY's rows (m, N) cast with the group's scale and gathered as FP8;
    dX (M, K/W) = gathered dY @ W_local when need_dgrad. Returns (dX or None, gathered dY
    (M, N) fp8, its scale_inv)."""
    local = cast_consistent(dy, q_grad, tp.group)
    if tp.overlap and need_dgrad:
        dx, dy_data = all_gather_dgrad(local.data, local.scale_inv, *_transposed(w_fp8), config, act_dtype, tp.group)
        return dx, dy_data, local.scale_inv
    dy_data = all_gather_fp8(local.data, tp.group)
    dx = gemm.dgrad(dy_data, local.scale_inv, *_transposed(w_fp8), config, act_dtype) if need_dgrad else None
    return dx, dy_data, local.scale_inv


class _ColumnParallelFn(torch.autograd.Function):
    """Column-parallel FP8 Linear. Saved for backward: the (gathered, under SP) input's
    transposed FP8 copy (K, Mp) and its scale_inv."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_fp8, q_input: Quantizer, q_grad: Quantizer, config: GemmConfig,
                act_dtype: torch.dtype, need_wgrad: bool, tp: TPConfig):
        in_shape = x.shape
        if tp.sequence_parallel:
            y, x_data, x_scale_inv = _gather_fprop(_rows(x), q_input, w_fp8, config, act_dtype, bias, tp)
            x_t = transpose_rows(x_data) if need_wgrad else None  # (K, Mp) of the gathered rows
            out_shape = (tp.world * in_shape[0], *in_shape[1:-1])
        else:
            # x is the same on every rank, so is this cast's scale
            x_data, x_t, x_scale_inv, _ = q_input.cast(_rows(x), transpose=need_wgrad)  # (M, K), (K, Mp)
            y = gemm.fprop(x_data, x_scale_inv, *_operands(w_fp8), config, act_dtype, bias)  # (M, N/W)
            out_shape = tuple(in_shape[:-1])
        if need_wgrad:
            ctx.save_for_backward(x_t, x_scale_inv)
        ctx.w_fp8, ctx.q_grad, ctx.config, ctx.tp = w_fp8, q_grad, config, tp
        ctx.in_shape, ctx.act_dtype, ctx.need_wgrad, ctx.weight_dtype = in_shape, act_dtype, need_wgrad, weight.dtype
        return y.view(*out_shape, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        tp = ctx.tp
        dy2 = _rows(dy).to(ctx.act_dtype)
        need_wgrad = ctx.needs_input_grad[1] and ctx.need_wgrad
        # dY (M, N/W) is this rank's own columns: a local cast (no other rank reads it)
        dy_data, dy_t, dy_scale_inv, db = ctx.q_grad.cast(dy2, transpose=need_wgrad, dbias=ctx.needs_input_grad[2])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if tp.sequence_parallel:
                dx = _dgrad_scatter(dy_data, dy_scale_inv, ctx.w_fp8, ctx.config, ctx.act_dtype, tp)  # (m, K)
            else:
                dx = gemm.dgrad(dy_data, dy_scale_inv, *_transposed(ctx.w_fp8), ctx.config, _ACCUM)  # (M, K) partial
                dx = all_reduce_sum(dx, tp).to(ctx.act_dtype)
            dx = dx.view(ctx.in_shape)
        if need_wgrad:
            x_t, x_scale_inv = ctx.saved_tensors
            dw = gemm.wgrad(dy_t, dy_scale_inv, x_t, x_scale_inv, ctx.config, ctx.weight_dtype)
        return dx, dw, db, None, None, None, None, None, None, None


class _RowParallelFn(torch.autograd.Function):
    """Row-parallel FP8 Linear: the bias is added once, after the reduction. Saved for
    backward: the input shard's transposed FP8 copy (K/W, Mp) and its scale_inv."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_fp8, q_input: Quantizer, q_grad: Quantizer, config: GemmConfig,
                act_dtype: torch.dtype, need_wgrad: bool, tp: TPConfig):
        in_shape = x.shape
        x_data, x_t, x_scale_inv, _ = q_input.cast(_rows(x), transpose=need_wgrad)  # (M, K/W), (K/W, Mp)
        if tp.sequence_parallel:  # the leading dim splits over the ranks (parallel_linear_forward checks)
            y = _fprop_scatter(x_data, x_scale_inv, w_fp8, config, act_dtype, bias, tp)  # (M/W, N)
            out_shape = (in_shape[0] // tp.world, *in_shape[1:-1])
        else:
            y = all_reduce_sum(gemm.fprop(x_data, x_scale_inv, *_operands(w_fp8), config, _ACCUM), tp)  # (M, N)
            if bias is not None:
                y += bias.to(_ACCUM)
            y = y.to(act_dtype)
            out_shape = tuple(in_shape[:-1])
        if need_wgrad:
            ctx.save_for_backward(x_t, x_scale_inv)
        ctx.w_fp8, ctx.q_grad, ctx.config, ctx.tp = w_fp8, q_grad, config, tp
        ctx.in_shape, ctx.act_dtype, ctx.need_wgrad, ctx.weight_dtype = in_shape, act_dtype, need_wgrad, weight.dtype
        return y.view(*out_shape, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        tp = ctx.tp
        dy2 = _rows(dy).to(ctx.act_dtype)
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.need_wgrad
        if tp.sequence_parallel:
            dx, dy_data, dy_scale_inv = _gather_dgrad(dy2, ctx.q_grad, ctx.w_fp8, ctx.config, ctx.act_dtype,
                                                      need_dgrad, tp)  # (M, K/W), (M, N) gathered
            dy_t = transpose_rows(dy_data) if need_wgrad else None  # (N, Mp)
            db = all_reduce_sum(dy2.sum(0, dtype=torch.float32), tp) if ctx.needs_input_grad[2] else None
        else:
            # dY (M, N) is the same on every rank: a local cast gives the same scale everywhere
            dy_data, dy_t, dy_scale_inv, db = ctx.q_grad.cast(dy2, transpose=need_wgrad,
                                                              dbias=ctx.needs_input_grad[2])
            dx = gemm.dgrad(dy_data, dy_scale_inv, *_transposed(ctx.w_fp8), ctx.config,
                            ctx.act_dtype) if need_dgrad else None  # (M, K/W)
        dw = None
        if dx is not None:
            dx = dx.view(ctx.in_shape)
        if need_wgrad:
            x_t, x_scale_inv = ctx.saved_tensors
            dw = gemm.wgrad(dy_t, dy_scale_inv, x_t, x_scale_inv, ctx.config, ctx.weight_dtype)
        return dx, dw, db, None, None, None, None, None, None, None


def _operands(w_fp8):
    from ..modules.weight_workspace import weight_operands  # modules import this file

    return weight_operands(w_fp8)


def _transposed(w_fp8):
    from ..modules.weight_workspace import weight_transposed

    return weight_transposed(w_fp8)


def parallel_linear_forward(layer, x: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
    """fp8train.Linear.forward for a layer with a TPConfig (`layer.tp`).

    Auto precision (recipe.auto_precision) is not applied to TP layers: they run in FP8
    inside fp8train.autocast (their shard dims are checked to be FP8-able at construction).
    """
    from ..modules.base import activation_dtype, mark_calibrated

    tp: TPConfig = layer.tp
    recipe = active_recipe()
    if not tp.column and isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] != tp.local_in_features:
        raise ValueError(f"{layer.describe()}: a row-parallel layer takes this rank's input shard, last dim "
                         f"in_features / {tp.world} = {tp.local_in_features}; got shape {tuple(x.shape)}")
    layer.check_input(x, tp.local_in_features, fp8=recipe is not None)
    if isinstance(x, Float8Tensor):
        raise TypeError(f"{layer.describe()}: tensor-parallel layers take high-precision inputs, not Float8Tensor")
    if tp.sequence_parallel and not tp.column and x.dim() >= 2 and x.shape[0] % tp.world:
        raise ValueError(f"{layer.describe()}: with sequence_parallel the input's leading (sequence) dim "
                         f"{x.shape[0]} must split evenly over the {tp.world} ranks")
    if recipe is None:
        return high_precision_forward(x, layer.weight, layer.bias, tp)
    act_dtype = activation_dtype(x)
    gemm.check_device(x.device)
    q_input, q_weight, q_grad = layer.quantizers(recipe, layer.weight.device)
    grad = torch.is_grad_enabled()
    w_fp8 = layer._workspace.get(layer.weight, q_weight, is_first_microbatch,
                                 need_transpose=grad and x.requires_grad, skip=layer.weight_cast_skip)
    fn = _ColumnParallelFn if tp.column else _RowParallelFn
    y = fn.apply(x, layer.weight, layer.bias, w_fp8, q_input, q_grad, recipe.gemm, act_dtype,
                 grad and layer.weight.requires_grad, tp)
    mark_calibrated(q_input, q_weight, q_grad)
    return y


# --------------------------------------------------------------------------- checkpoints


def shard_state(tp: TPConfig, full: dict, prefix: str = "") -> dict:
    """This rank's `weight` / `bias` entries sliced from an unsharded state_dict (exact copies)."""
    out = {}
    w = full.get(prefix + "weight")
    if w is not None:
        if tuple(w.shape) != (tp.out_features, tp.in_features):
            raise ValueError(f"load_full_state_dict: expected an unsharded weight of shape "
                             f"({tp.out_features}, {tp.in_features}), got {tuple(w.shape)}")
        out[prefix + "weight"] = tp.shard(w, tp.weight_dim())
    b = full.get(prefix + "bias")
    if b is not None and tp.column:
        if tuple(b.shape) != (tp.out_features,):
            raise ValueError(f"load_full_state_dict: expected an unsharded bias of shape ({tp.out_features},), "
                             f"got {tuple(b.shape)}")
        out[prefix + "bias"] = tp.shard(b, 0)
    return out


def unshard_state(tp: TPConfig, local: dict, prefix: str = "") -> dict:
    """The unsharded `weight` / `bias` entries gathered from every rank's shards (collective)."""
    out = {prefix + "weight": all_gather_dim(local[prefix + "weight"], tp, tp.weight_dim())}
    if prefix + "bias" in local and tp.column:
        out[prefix + "bias"] = all_gather_dim(local[prefix + "bias"], tp, 0)
    return out
