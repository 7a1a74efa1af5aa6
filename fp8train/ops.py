"""The memory-bound kernels as `torch.library` custom ops, for code traced by torch.compile.

Eager layers launch kernels through prepared launches that write into buffers they allocate
(kernels/__init__.py, Quantizer._launch): fast on the host, but opaque to Dynamo. Under
`torch.compiler.is_compiling()` the quantizer and producer helpers call these ops instead
(one branch each: Quantizer.cast, norm_fp8/norm_backward, activation_fp8/activation_backward).
Each op's implementation calls the same `fp8train.kernels` function as the eager path
(Triton on CUDA, the pure-torch twin elsewhere), in the same order, so compiled and eager
results are identical; Inductor calls the op as an opaque kernel instead of tracing into it.

Scaling state travels as four tensors, `scaling_state()` of the quantizer (see
Quantizer.scaling_state):
  scale            () float32; read, or rewritten from first_amax (current scaling)
  amax_history     (H,) float32 or None; the cast max-accumulates its amax into entry 0
  first_amax       () float32 or None; when given, zeroed and filled by the producer's first
                   pass (amax only), and the cast's scale comes from it
  nonfinite_count  () int32 or None; counts a non-finite first_amax
Every op declares all four as mutated, so functionalization keeps their updates (a mutation
declared but not performed only costs a copy of a scalar).

Ops return plain tensors; a result that does not exist (no transposed copy, no bias
gradient, RMSNorm's mean) is an empty (0,) tensor, mapped back to None by the wrappers.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import kernels
from .kernels.activation_reference import out_features
from .tensor import padded_rows

_STATE = ("scale", "amax_history", "first_amax", "nonfinite_count")


class ScalingState(NamedTuple):
    """A quantizer's state tensors in the form the ops take (module docstring)."""

    scale: Tensor
    amax_history: Optional[Tensor]
    first_amax: Optional[Tensor]
    nonfinite_count: Optional[Tensor]


def _scaled(first_pass: Callable[[Tensor], None], cast: Callable, scale: Tensor, amax_history: Optional[Tensor],
            first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor]) -> None:
    """Quantizer.produce's sequence, from the state tensors instead of the quantizer."""
    if first_amax is not None:
        first_amax.zero_()
        first_pass(first_amax)
    cast(scale, amax_history[0] if amax_history is not None else None, first_amax, nonfinite_count)


def _transposed_empty(rows: int, cols: int, dtype: torch.dtype, device, transpose: bool) -> Tensor:
    # (cols, padded_rows(rows)) fp8, or the (0,) "absent" marker
    if not transpose:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.empty((cols, padded_rows(rows)), dtype=dtype, device=device)


def _none_if_empty(t: Tensor) -> Optional[Tensor]:
    return None if t.dim() == 1 and t.shape[0] == 0 else t


# ------------------------------------------------------------------------------------ cast

def _cast_outputs(x: Tensor, fp8_dtype: torch.dtype, transpose: bool, dbias: bool):
    cols = x.shape[-1] if x.dim() else 1
    rows = x.numel() // cols if cols else 0
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)  # x's shape, fp8
    data_t = _transposed_empty(rows, cols, fp8_dtype, x.device, transpose)  # (cols, Mp) fp8
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    db = torch.empty(cols if dbias else 0, dtype=torch.float32, device=x.device)  # (cols,) float32
    return data, data_t, scale_inv, db


@torch.library.custom_op("fp8train::cast", mutates_args=_STATE)
def _cast(x: Tensor, fp8_dtype: torch.dtype, scale: Tensor, amax_history: Optional[Tensor],
          first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor], transpose: bool,
          dbias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantizer.cast: (data, data_t, scale_inv, dbias) of a contiguous x."""
    data, data_t, scale_inv, db = _cast_outputs(x, fp8_dtype, transpose, dbias)
    _scaled(lambda amax_out: kernels.amax(x, amax_out),
            lambda s, amax_out, from_amax, count: kernels.cast_trusted(
                x, data, data_t if transpose else None, s, scale_inv, amax_out, from_amax, count,
                db if dbias else None),
            scale, amax_history, first_amax, nonfinite_count)
    return data, data_t, scale_inv, db


@_cast.register_fake
def _(x, fp8_dtype, scale, amax_history, first_amax, nonfinite_count, transpose, dbias):
    return _cast_outputs(x, fp8_dtype, transpose, dbias)


def cast(x: Tensor, fp8_dtype: torch.dtype, state: ScalingState, transpose: bool, dbias: bool):
    """(data, data_t or None, scale_inv, dbias or None): what Quantizer.cast returns."""
    data, data_t, scale_inv, db = torch.ops.fp8train.cast(x.detach(), fp8_dtype, *state, transpose, dbias)
    return data, (data_t if transpose else None), scale_inv, (db if dbias else None)


# ------------------------------------------------------------------------------- normalization

def _norm_outputs(x: Tensor, layer: bool, fp8_dtype: torch.dtype, transpose: bool, want_y: bool):
    m, k = x.shape
    mean = torch.empty(m if layer else 0, dtype=torch.float32, device=x.device)  # (M,) float32
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    data = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    data_t = _transposed_empty(m, k, fp8_dtype, x.device, transpose)  # (K, Mp) fp8
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    y = torch.empty((m, k) if want_y else (0,), dtype=x.dtype, device=x.device)
    return data, data_t, scale_inv, mean, rstd, y


@torch.library.custom_op("fp8train::norm_fwd_fp8", mutates_args=_STATE)
def _norm_fwd_fp8(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, layer: bool,
                  fp8_dtype: torch.dtype, scale: Tensor, amax_history: Optional[Tensor],
                  first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor], transpose: bool,
                  want_y: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """norm_fp8: (data, data_t, scale_inv, mean, rstd, y) of x (M, K)."""
    data, data_t, scale_inv, mean, rstd, y = _norm_outputs(x, layer, fp8_dtype, transpose, want_y)
    mean_arg = mean if layer else None
    _scaled(lambda amax_out: kernels.norm_stats(x, weight, bias, eps, mean_arg, rstd, amax_out),
            lambda s, amax_out, from_amax, count: kernels.norm_fwd_fp8(
                x, weight, bias, eps, mean_arg, rstd, data, data_t if transpose else None, s, scale_inv,
                amax_out, from_amax, count, y if want_y else None, stats_ready=from_amax is not None),
            scale, amax_history, first_amax, nonfinite_count)
    return data, data_t, scale_inv, mean, rstd, y


@_norm_fwd_fp8.register_fake
def _(x, weight, bias, eps, layer, fp8_dtype, scale, amax_history, first_amax, nonfinite_count, transpose, want_y):
    return _norm_outputs(x, layer, fp8_dtype, transpose, want_y)


def norm_fwd_fp8(x2: Tensor, weight: Tensor, bias: Optional[Tensor], layer: bool, eps: float,
                 fp8_dtype: torch.dtype, state: ScalingState, transpose: bool, want_y: bool):
    """(data, data_t or None, scale_inv), mean or None, rstd, y or None: as modules.norm.norm_fp8."""
    data, data_t, scale_inv, mean, rstd, y = torch.ops.fp8train.norm_fwd_fp8(
        x2, weight, bias, eps, layer, fp8_dtype, *state, transpose, want_y)
    return (data, data_t if transpose else None, scale_inv), (mean if layer else None), rstd, \
        (y if want_y else None)


def _norm_bwd_outputs(x: Tensor, weight: Tensor, bias: Optional[Tensor]):
    dbias = torch.empty_like(bias) if bias is not None else torch.empty(0, dtype=weight.dtype, device=x.device)
    return torch.empty_like(x), torch.empty_like(weight), dbias


@torch.library.custom_op("fp8train::norm_bwd", mutates_args=())
def _norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], mean: Optional[Tensor],
              rstd: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """norm_backward: (dx, dweight, dbias); `bias` is read for its shape and dtype only."""
    dx, dweight, dbias = _norm_bwd_outputs(x, weight, bias)
    kernels.norm_bwd(dy, x, weight, mean, rstd, dx, dweight, dbias if bias is not None else None)
    return dx, dweight, dbias


@_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd):
    return _norm_bwd_outputs(x, weight, bias)


def norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], mean: Optional[Tensor],
             rstd: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    dx, dweight, dbias = torch.ops.fp8train.norm_bwd(dy, x, weight, bias, mean, rstd)
    return dx, dweight, (dbias if bias is not None else None)


# ---------------------------------------------------------------------------------- activation

def _act_outputs(h: Tensor, cols: int, fp8_dtype: torch.dtype, transpose: bool):
    m = h.shape[0]
    data = torch.empty((m, cols), dtype=fp8_dtype, device=h.device)  # (M, cols) fp8
    data_t = _transposed_empty(m, cols, fp8_dtype, h.device, transpose)  # (cols, Mp) fp8
    return data, data_t, torch.empty(1, dtype=torch.float32, device=h.device)


@torch.library.custom_op("fp8train::act_fwd_fp8", mutates_args=_STATE)
def _act_fwd_fp8(h: Tensor, act: str, fp8_dtype: torch.dtype, scale: Tensor, amax_history: Optional[Tensor],
                 first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor],
                 transpose: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """act(h) (M, F) in FP8: (data, data_t, scale_inv)."""
    data, data_t, scale_inv = _act_outputs(h, out_features(h, act), fp8_dtype, transpose)
    _scaled(lambda amax_out: kernels.act_amax(h, act, amax_out),
            lambda s, amax_out, from_amax, count: kernels.act_fwd_fp8(
                h, act, data, data_t if transpose else None, s, scale_inv, amax_out, from_amax, count),
            scale, amax_history, first_amax, nonfinite_count)
    return data, data_t, scale_inv


@_act_fwd_fp8.register_fake
def _(h, act, fp8_dtype, scale, amax_history, first_amax, nonfinite_count, transpose):
    return _act_outputs(h, out_features(h, act), fp8_dtype, transpose)


def act_fwd_fp8(h: Tensor, act: str, fp8_dtype: torch.dtype, state: ScalingState, transpose: bool):
    data, data_t, scale_inv = torch.ops.fp8train.act_fwd_fp8(h, act, fp8_dtype, *state, transpose)
    return data, (data_t if transpose else None), scale_inv


@torch.library.custom_op("fp8train::act_bwd_fp8", mutates_args=_STATE)
def _act_bwd_fp8(da: Tensor, h: Tensor, act: str, fp8_dtype: torch.dtype, scale: Tensor,
                 amax_history: Optional[Tensor], first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor],
                 transpose: bool, dbias_dtype: Optional[torch.dtype]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dh = da * act'(h) (M, Fh) in FP8, and fc1's bias gradient: [data, data_t, scale_inv, dbias]."""
    data, data_t, scale_inv = _act_outputs(h, h.shape[1], fp8_dtype, transpose)
    db = torch.empty(h.shape[1] if dbias_dtype is not None else 0, dtype=dbias_dtype or h.dtype, device=h.device)
    _scaled(lambda amax_out: kernels.act_bwd_amax(da, h, act, amax_out),
            lambda s, amax_out, from_amax, count: kernels.act_bwd_fp8(
                da, h, act, data, data_t if transpose else None, s, scale_inv, amax_out, from_amax, count,
                db if dbias_dtype is not None else None),
            scale, amax_history, first_amax, nonfinite_count)
    return data, data_t, scale_inv, db


@_act_bwd_fp8.register_fake
def _(da, h, act, fp8_dtype, scale, amax_history, first_amax, nonfinite_count, transpose, dbias_dtype):
    data, data_t, scale_inv = _act_outputs(h, h.shape[1], fp8_dtype, transpose)
    db = torch.empty(h.shape[1] if dbias_dtype is not None else 0, dtype=dbias_dtype or h.dtype, device=h.device)
    return data, data_t, scale_inv, db


def act_bwd_fp8(da: Tensor, h: Tensor, act: str, fp8_dtype: torch.dtype, state: ScalingState, transpose: bool,
                dbias_dtype: Optional[torch.dtype]):
    data, data_t, scale_inv, db = torch.ops.fp8train.act_bwd_fp8(da, h, act, fp8_dtype, *state, transpose,
                                                                 dbias_dtype)
    return (data, data_t if transpose else None, scale_inv), (db if dbias_dtype is not None else None)
