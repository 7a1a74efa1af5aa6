"""The memory-bound kernels in code traced by torch.compile.

Eager layers launch kernels through prepared launches that write into buffers they allocate
(kernels/__init__.py, Quantizer._launch): fast on the host, but opaque to Dynamo. Under
`torch.compiler.is_compiling()` the quantizer and producer helpers call this module instead
(one branch each: Quantizer.cast, BlockScalingQuantizer.cast, norm_fp8/norm_backward,
activation_fp8/activation_backward):
  * the casts are torch.library.triton_op operators whose bodies launch the eager cast kernels
    through wrap_triton, so Inductor launches them from its own code: fp8train::cast_kernels
    (`cast`, the per-tensor casts) and fp8train::block_cast (block_quantizer.py, BlockScaling's);
    off CUDA their bodies are the twins' torch ops (`_traced_cast`, `block_cast`), traced into
    the graph. On the H200 (2026-12-02) these replaced the twins' torch ops, which Inductor
    fused into their producers: HF Llama compiled, 0.86x the wall time at h1024 and level at
    h2048 (204 and 408 fewer launches a step), BlockScaling 0.97x at h2048; the price is
    peak memory (+1.3 GiB on 9.1 at h2048, delayed; the forward writes the transposed copies);
  * the fused norm and activation kernels are `torch.library` custom ops, whose
    implementation calls the same `fp8train.kernels` function as the eager path (Triton on
    CUDA, the twin elsewhere) in the same order; Inductor calls each as an opaque kernel.

Scaling state travels as four tensors and one rule, `scaling_state()` of the quantizer (see
Quantizer.scaling_state):
  scale            () float32; read, or rewritten from first_amax (current scaling)
  amax_history     (H,) float32 or None; the cast max-accumulates its amax into entry 0
  first_amax       () float32 or None; when given, set to x's amax (the fused producers: zeroed
                   and filled by their first pass; `cast`: the max of x's per-row amaxes taken
                   in the graph, graph_row_abs_max, reduced by the cast kernel),
                   and the cast's scale comes from it
  nonfinite_count  () int32 or None; counts a non-finite first_amax
  power_of_two     bool: the scale computed from first_amax is rounded down to a power of two
Every custom op declares the four tensors as mutated, so functionalization keeps their updates
(a mutation declared but not performed only costs a copy of a scalar); the rule is a plain
bool argument, a constant of the graph (Dynamo guards on the quantizer's attribute).

Ops return plain tensors; a result that does not exist (no transposed copy, no bias
gradient, RMSNorm's mean) is an empty (0,) tensor, mapped back to None by the wrappers.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels, scaling
from .kernels import block_reference, reference
from .kernels.activation_reference import out_features
from .tensor import padded_rows

_STATE = ("scale", "amax_history", "first_amax", "nonfinite_count")


class ScalingState(NamedTuple):
    """A quantizer's state tensors and scale rule in the form the ops take (module docstring)."""

    scale: Tensor
    amax_history: Optional[Tensor]
    first_amax: Optional[Tensor]
    nonfinite_count: Optional[Tensor]
    power_of_two: bool = False


def _scaled(first_pass: Callable[[Tensor], None], cast: Callable, scale: Tensor, amax_history: Optional[Tensor],
            first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor], power_of_two: bool) -> None:
    """Quantizer.produce's sequence, from the state tensors instead of the quantizer."""
    if first_amax is not None:
        first_amax.zero_()
        first_pass(first_amax)
    cast(scale, amax_history[0] if amax_history is not None else None, first_amax, nonfinite_count, power_of_two)


def _transposed_empty(rows: int, cols: int, dtype: torch.dtype, device, transpose: bool) -> Tensor:
    # (cols, padded_rows(rows)) fp8, or the (0,) "absent" marker
    if not transpose:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.empty((cols, padded_rows(rows)), dtype=dtype, device=device)


def _none_if_empty(t: Tensor) -> Optional[Tensor]:
    return None if t.dim() == 1 and t.shape[0] == 0 else t


# ------------------------------------------------------------------------------------ cast

def graph_row_abs_max(rows: Tensor) -> Tensor:
    """(M,) float32: reference.abs_max of each row of rows (M, N) by torch ops in the graph,
    NaN as +inf; zeros where N == 0. Current scaling's amax in traced code: the per-row step
    has the iteration space of the producer's own kernel (an RMSNorm, a pointwise op), so
    Inductor fuses it there instead of reading x once more, and the cast kernel reduces the
    (M,) vector itself (kernels/cast.py, FROM_ROWS; a max is exact in any order). On the H200
    (docs/benchmarks.md, thirty-second and thirty-third sessions), against the operator's own
    zeroing and amax kernels, the graph's amax took a compiled HF Llama h2048 step with
    current scaling from 38.43 to 36.23 ms; at h1024 the kernel's reduction of the rows
    instead of the graph's took it from 20.37 to 19.21 ms (431 to 359 kernels)."""
    if rows.numel() == 0:
        return rows.new_zeros(rows.shape[0], dtype=torch.float32)
    a = rows.float().abs()
    return torch.where(torch.isnan(a), torch.inf, a).amax(dim=1)


def cast(x: Tensor, fp8_dtype: torch.dtype, state: ScalingState, transpose: bool, dbias: bool):
    """Quantizer.cast in traced code: (data, data_t or None, scale_inv (1,), dbias or None),
    the operator fp8train::cast_kernels (one launch of the eager kernel per cast); where the
    scale comes from x, x's per-row amaxes first, in the graph (graph_row_abs_max). dbias:
    x's column sums in torch ops."""
    x = x.detach()
    cols = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, cols)  # (M, N)
    rows_amax = graph_row_abs_max(rows) if state.first_amax is not None else None
    data, data_t, scale_inv = torch.ops.fp8train.cast_kernels(rows, fp8_dtype, *state, transpose, rows_amax)
    return data.view(x.shape), (data_t if transpose else None), scale_inv, (rows.float().sum(0) if dbias else None)


def _traced_cast(x: Tensor, fp8_dtype: torch.dtype, state: ScalingState, transpose: bool, dbias: bool,
                 rows_amax: Optional[Tensor]):
    """`cast` as the cast kernels' twin (kernels/reference.py, cast_transpose_amax) in plain
    torch ops: fp8train::cast_kernels' body off CUDA, traced into the graph (Inductor
    generates its code). The values are the twin's, which the eager Triton kernels match bit
    for bit; the divisions of the scale math run in float64 (scaling.py says why that is
    IEEE float32 exactly). The padding columns of data_t are +0.0 (byte 0), cast like the rest."""
    scale, amax_history, first_amax, nonfinite_count, power_of_two = state
    if first_amax is not None:  # current scaling, or a delayed quantizer's calibration
        first_amax.copy_(reference.abs_max(rows_amax))  # the max of x's per-row amaxes, taken by `cast`
        reference.resolve_scale(scale, first_amax, nonfinite_count, scaling.fp8_max(fp8_dtype), power_of_two)
    if amax_history is not None:
        reference.amax(x, amax_history[0])
    data = reference.saturating_cast(x, scale, fp8_dtype)
    cols = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, cols)  # (M, N)
    data_t = None
    if transpose:  # (N, Mp): x's rows transposed, zero columns up to Mp
        pad = padded_rows(rows.shape[0]) - rows.shape[0]
        # contiguous: the GEMMs take it row-major (F.pad keeps the transposed view's strides)
        data_t = reference.saturating_cast(F.pad(rows.t(), (0, pad)), scale, fp8_dtype).contiguous()
    db = rows.float().sum(0) if dbias else None
    return data, data_t, scaling.scale_inverse(scale).reshape(1), db


@torch.library.triton_op("fp8train::cast_kernels", mutates_args=_STATE)
def _cast_kernels(rows: Tensor, fp8_dtype: torch.dtype, scale: Tensor, amax_history: Optional[Tensor],
                  first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor], power_of_two: bool,
                  transpose: bool, rows_amax: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """`cast` of rows (M, N) as an operator for traced code: (data, data_t,
    scale_inv), data_t (0,) without transpose. On CUDA its body allocates as the eager cast
    does and launches the eager kernels through wrap_triton (kernels/cast.py, traced=True):
    one launch (amax, cast, transposed copy and scale_inv). Where the scale comes from x
    (first_amax), rows_amax are the rows' (M,) amaxes taken in the graph (`cast`), which the
    kernel reduces into first_amax before it resolves the scale. The entry 0 of amax_history
    is its first element, so the kernel takes the whole history as its amax pointer (no view
    of a mutated input). Off CUDA: the twin's torch ops (`_traced_cast`), traced into the graph."""
    state = ScalingState(scale, amax_history, first_amax, nonfinite_count, power_of_two)
    if not rows.is_cuda:
        data, data_t, scale_inv, _ = _traced_cast(rows, fp8_dtype, state, transpose, False, rows_amax)
        return data, (data_t if transpose else rows.new_empty(0, dtype=fp8_dtype)), scale_inv
    from .kernels import cast as cast_kernels
    m, n = rows.shape
    data = torch.empty((m, n), dtype=fp8_dtype, device=rows.device)
    data_t = _transposed_empty(m, n, fp8_dtype, rows.device, transpose)
    scale_inv = torch.empty(1, dtype=torch.float32, device=rows.device)
    cast_kernels.launch_cast(rows, data, data_t if transpose else None, scale, scale_inv, amax_history, first_amax,
                             nonfinite_count, power_of_two=power_of_two, traced=True, rows_amax=rows_amax)
    return data, data_t, scale_inv


def block_cast(x: Tensor, fp8_dtype: torch.dtype, block: Tuple[int, int], power_of_two: bool, transpose: bool,
               dbias: bool):
    """BlockScalingQuantizer.cast of x (M, K) as the twin's torch ops (kernels/block_reference.py;
    `_traced_block_cast`): (data, data_t or None, scale_inv, dbias or None, scale_inv_t or
    None); off CUDA the body of the operator fp8train::block_cast (as fp8train::block_cast_cpu,
    run eagerly: opaque to Inductor), and the torch-op form benchmarks/cast.py compiles against
    the kernels. The transposed copies are eager's:
    128 x 128 tiles, the payload's bytes transposed (no second cast), and 1 x 128 blocks, x
    cast again in 128 x 1 blocks; zero padded to padded_rows(M) and padded_rows(M, 128)
    columns."""
    x = x.detach()
    data, scale_inv = _traced_block_cast(x, fp8_dtype, block, power_of_two)
    data_t = scale_inv_t = None
    m = x.shape[0]
    if transpose and block == (128, 128):
        data_t, scale_inv_t = bytes_transposed(data, padded_rows(m)), scale_inv.t()
    elif transpose:
        again, scale_inv_cols = _traced_block_cast(x, fp8_dtype, (128, 1), power_of_two)
        data_t, scale_inv_t = bytes_transposed(again, padded_rows(m, 128)), scale_inv_cols.t()
    db = x.sum(0, dtype=torch.float32) if dbias else None
    return data, data_t, scale_inv, db, scale_inv_t


def _traced_block_cast(x: Tensor, fp8_dtype: torch.dtype, block: Tuple[int, int], power_of_two: bool):
    """block_reference.block_cast's (data, scale_inv). Where x holds whole blocks (the
    models' shapes) x is viewed as (block rows, rows per block, block cols, cols per block):
    each block's amax is one reduction and the cast one pointwise op broadcasting its block's
    scale, which Inductor makes into one reduction kernel (benchmarks/cast.py). The twin's
    form (its scales spread over x by a concatenation) compiled to pointwise kernels that took
    ~0.5 ms per cast at h1024 on the H200 (2026-12-02); it stays for tail blocks."""
    m, k = x.shape
    (br, bc), (nr, nc) = block, block_reference.blocks_of(x.shape, block)
    if (nr * br, nc * bc) != (m, k):
        return block_reference.block_cast(x, fp8_dtype, block, power_of_two)
    blocks = x.reshape(nr, br, nc, bc)
    a = blocks.float().abs()
    amax = torch.where(torch.isnan(a), torch.inf, a).amax(dim=(1, 3), keepdim=True)  # NaN counts as inf
    scale = block_reference.block_scale(amax, scaling.fp8_max(fp8_dtype), power_of_two)
    data = reference.saturating_cast(blocks, scale, fp8_dtype).reshape(m, k)
    return data, scaling.scale_inverse(scale).reshape(nr, nc)


def bytes_transposed(data: Tensor, cols: int) -> Tensor:
    """(K, cols) fp8: data (M, K) transposed, zero bytes in columns M.. (kernels.byte_transpose)."""
    raw = F.pad(data.view(torch.uint8).t(), (0, cols - data.shape[0]))
    return raw.contiguous().view(data.dtype)


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
                  first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor], power_of_two: bool,
                  transpose: bool, want_y: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """norm_fp8: (data, data_t, scale_inv, mean, rstd, y) of x (M, K)."""
    data, data_t, scale_inv, mean, rstd, y = _norm_outputs(x, layer, fp8_dtype, transpose, want_y)
    mean_arg = mean if layer else None
    _scaled(lambda amax_out: kernels.norm_stats(x, weight, bias, eps, mean_arg, rstd, amax_out),
            lambda s, amax_out, from_amax, count, pow2: kernels.norm_fwd_fp8(
                x, weight, bias, eps, mean_arg, rstd, data, data_t if transpose else None, s, scale_inv,
                amax_out, from_amax, count, y if want_y else None, stats_ready=from_amax is not None,
                power_of_two=pow2),
            scale, amax_history, first_amax, nonfinite_count, power_of_two)
    return data, data_t, scale_inv, mean, rstd, y


@_norm_fwd_fp8.register_fake
def _(x, weight, bias, eps, layer, fp8_dtype, scale, amax_history, first_amax, nonfinite_count, power_of_two,
      transpose, want_y):
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
                 first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor], power_of_two: bool,
                 transpose: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """act(h) (M, F) in FP8: (data, data_t, scale_inv)."""
    data, data_t, scale_inv = _act_outputs(h, out_features(h, act), fp8_dtype, transpose)
    _scaled(lambda amax_out: kernels.act_amax(h, act, amax_out),
            lambda s, amax_out, from_amax, count, pow2: kernels.act_fwd_fp8(
                h, act, data, data_t if transpose else None, s, scale_inv, amax_out, from_amax, count, pow2),
            scale, amax_history, first_amax, nonfinite_count, power_of_two)
    return data, data_t, scale_inv


@_act_fwd_fp8.register_fake
def _(h, act, fp8_dtype, scale, amax_history, first_amax, nonfinite_count, power_of_two, transpose):
    return _act_outputs(h, out_features(h, act), fp8_dtype, transpose)


def act_fwd_fp8(h: Tensor, act: str, fp8_dtype: torch.dtype, state: ScalingState, transpose: bool):
    data, data_t, scale_inv = torch.ops.fp8train.act_fwd_fp8(h, act, fp8_dtype, *state, transpose)
    return data, (data_t if transpose else None), scale_inv


@torch.library.custom_op("fp8train::act_bwd_fp8", mutates_args=_STATE)
def _act_bwd_fp8(da: Tensor, h: Tensor, act: str, fp8_dtype: torch.dtype, scale: Tensor,
                 amax_history: Optional[Tensor], first_amax: Optional[Tensor], nonfinite_count: Optional[Tensor],
                 power_of_two: bool, transpose: bool,
                 dbias_dtype: Optional[torch.dtype]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dh = da * act'(h) (M, Fh) in FP8, and fc1's bias gradient: [data, data_t, scale_inv, dbias]."""
    data, data_t, scale_inv = _act_outputs(h, h.shape[1], fp8_dtype, transpose)
    db = torch.empty(h.shape[1] if dbias_dtype is not None else 0, dtype=dbias_dtype or h.dtype, device=h.device)
    _scaled(lambda amax_out: kernels.act_bwd_amax(da, h, act, amax_out),
            lambda s, amax_out, from_amax, count, pow2: kernels.act_bwd_fp8(
                da, h, act, data, data_t if transpose else None, s, scale_inv, amax_out, from_amax, count,
                db if dbias_dtype is not None else None, pow2),
            scale, amax_history, first_amax, nonfinite_count, power_of_two)
    return data, data_t, scale_inv, db


@_act_bwd_fp8.register_fake
def _(da, h, act, fp8_dtype, scale, amax_history, first_amax, nonfinite_count, power_of_two, transpose,
      dbias_dtype):
    data, data_t, scale_inv = _act_outputs(h, h.shape[1], fp8_dtype, transpose)
    db = torch.empty(h.shape[1] if dbias_dtype is not None else 0, dtype=dbias_dtype or h.dtype, device=h.device)
    return data, data_t, scale_inv, db


def act_bwd_fp8(da: Tensor, h: Tensor, act: str, fp8_dtype: torch.dtype, state: ScalingState, transpose: bool,
                dbias_dtype: Optional[torch.dtype]):
    data, data_t, scale_inv, db = torch.ops.fp8train.act_bwd_fp8(da, h, act, fp8_dtype, *state, transpose,
                                                                 dbias_dtype)
    return (data, data_t if transpose else None, scale_inv), (db if dbias_dtype is not None else None)
