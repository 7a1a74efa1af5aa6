"""Memory-bound FP8 kernels. Each public function runs its Triton kernel on CUDA tensors and
its pure-torch twin from `reference.py` elsewhere (CPU); both have the same in-place contract,
documented on the twin.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from . import reference


def amax(x: torch.Tensor, amax_out: torch.Tensor) -> None:
    impl = _triton_cast().amax if x.is_cuda else reference.amax
    impl(x, amax_out)


def cast_amax(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, scale_inv_out: torch.Tensor,
              amax_out: Optional[torch.Tensor] = None, from_amax: Optional[torch.Tensor] = None,
              nonfinite_count: Optional[torch.Tensor] = None, dbias_out: Optional[torch.Tensor] = None,
              power_of_two: bool = False) -> None:
    impl = _triton_cast().cast_amax if x.is_cuda else _checked_twin("cast_amax")
    impl(x, out, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out, power_of_two=power_of_two)


def cast_transpose_amax(x: torch.Tensor, out: torch.Tensor, out_t: torch.Tensor, scale: torch.Tensor,
                        scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                        from_amax: Optional[torch.Tensor] = None,
                        nonfinite_count: Optional[torch.Tensor] = None,
                        dbias_out: Optional[torch.Tensor] = None, power_of_two: bool = False) -> None:
    impl = _triton_cast().cast_transpose_amax if x.is_cuda else _checked_twin("cast_transpose_amax")
    impl(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out,
         power_of_two=power_of_two)


def block_cast(x: torch.Tensor, out: torch.Tensor, scale_inv_out: torch.Tensor, block, power_of_two: bool = False,
               traced: bool = False) -> None:
    """block_reference.block_cast of a 2-D x into out (fp8, x's shape) and scale_inv_out
    (float32, one per block): the Triton kernel on CUDA (kernels/block_kernel.py), the twin elsewhere.
    traced: inside a torch.library.triton_op's body (the kernel launched through wrap_triton)."""
    if x.is_cuda:
        from .block_kernel import block_cast_into
        block_cast_into(x, out, scale_inv_out, block, power_of_two, traced)
        return
    from .block_reference import block_cast as twin
    data, scale_inv = twin(x.detach(), out.dtype, tuple(block), power_of_two)  # torch ops: keep autograd out
    out.copy_(data)
    scale_inv_out.copy_(scale_inv)


def block_cast_both(x, out: torch.Tensor, out_t: torch.Tensor, scale_inv_out: torch.Tensor,
                    scale_inv_t_out: torch.Tensor, power_of_two: bool = False, traced: bool = False) -> None:
    """x (M, K) cast in 1 x 128 blocks (out, scale_inv_out) and in 128 x 1 blocks, transposed
    into out_t (K, Mp), Mp = M rounded up to 128, zero bytes beyond M (scale_inv_t_out (Mb, K)):
    on CUDA one Triton kernel reading x once (kernels/block_kernel.py), elsewhere its twin,
    two block_reference.block_cast calls and a byte transpose. x may be a list of
    column-stacked parts (block_kernel.MAX_PARTS at most, each but the last a multiple of 128
    columns): the cast of their concatenation. out_t and scale_inv_t_out None: the 1 x 128
    cast alone (the kernel reads parts in place; the twin concatenates them)."""
    if (x if isinstance(x, torch.Tensor) else x[0]).is_cuda:  # the kernel reads the parts in place
        from .block_kernel import block_cast_both_into
        block_cast_both_into(x, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two, traced)
        return
    if not isinstance(x, torch.Tensor):
        x = torch.cat(list(x), dim=1)
    block_cast(x, out, scale_inv_out, (1, 128), power_of_two)
    if out_t is None and scale_inv_t_out is None:
        return
    again = torch.empty_like(out)
    block_cast(x, again, scale_inv_t_out, (128, 1), power_of_two)
    byte_transpose(again, out_t)


def gated_block_cast(g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor, out_t: torch.Tensor,
                     scale_inv_out: torch.Tensor, scale_inv_t_out: torch.Tensor, power_of_two: bool = False,
                     traced: bool = False, keep: Optional[torch.Tensor] = None) -> None:
    """block_cast_both of a gated MLP's product act(g) * u, rounded to g's dtype (the gated
    kernel's output, gated_reference.gated_fwd): on CUDA computed inside the cast's one read
    of g and u (block_kernel.gated_block_cast_into), never stored (keep, with out_t and
    scale_inv_t_out None: stored there, in keep's dtype); elsewhere the twin, the product
    then block_cast_both. g, u: (M, K), one dtype."""
    if g.is_cuda:
        from .block_kernel import gated_block_cast_into
        gated_block_cast_into(g, u, act, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two, traced, keep)
        return
    from .gated_reference import check_cast_args, gated_forward
    check_cast_args("gated_block_cast", act, g, u)
    h = gated_forward(g.detach(), u.detach(), act).to(g.dtype)
    block_cast_both(h, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two)
    _kept(keep, h, out_t)


def gated_grad_block_cast(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor,
                          out_t: torch.Tensor, scale_inv_out: torch.Tensor, scale_inv_t_out: torch.Tensor,
                          power_of_two: bool = False, traced: bool = False, keep: Optional[torch.Tensor] = None) -> None:
    """block_cast_both of the gated product's gradients side by side, dg | du (M, 2K), each
    rounded to g's dtype (gated_reference.gated_bwd): on CUDA computed inside the cast's reads
    of da, g and u (block_kernel.gated_grad_block_cast_into), never stored (keep: as
    gated_block_cast's); elsewhere the twin. da, g, u: (M, K), one dtype, K a multiple of 128."""
    if g.is_cuda:
        from .block_kernel import gated_grad_block_cast_into
        gated_grad_block_cast_into(da, g, u, act, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two, traced,
                                   keep)
        return
    from .gated_reference import check_cast_args, gated_grads
    check_cast_args("gated_grad_block_cast", act, da, g, u, whole_blocks=True)
    dg, du = gated_grads(da.detach(), g.detach(), u.detach(), act)
    dgu = torch.cat([dg.to(g.dtype), du.to(g.dtype)], dim=1)
    block_cast_both(dgu, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two)
    _kept(keep, dgu, out_t)


def norm_block_cast(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, out_dtype: torch.dtype,
                    out: torch.Tensor, out_t: torch.Tensor, scale_inv_out: torch.Tensor,
                    scale_inv_t_out: torch.Tensor, power_of_two: bool = False, traced: bool = False,
                    keep: Optional[torch.Tensor] = None) -> None:
    """block_cast_both of an RMS norm's output, weight * (x * rstd rounded to x's dtype) rounded
    to out_dtype (modules/rms_norm.py's formula with its rstd given): on CUDA computed inside
    the cast's read of x (block_kernel.norm_block_cast_into), never stored (keep: as
    gated_block_cast's); elsewhere the twin. x (M, K), weight (K,), rstd (M,) float32."""
    if x.is_cuda:
        from .block_kernel import norm_block_cast_into
        norm_block_cast_into(x, weight, rstd, out_dtype, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two,
                             traced, keep)
        return
    from .block_reference import check_norm_args
    check_norm_args("norm_block_cast", x, weight, rstd, out_dtype)
    y = (weight.float() * (x.detach().float() * rstd[:, None]).to(x.dtype).float()).to(out_dtype)
    block_cast_both(y, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two)
    _kept(keep, y, out_t)


def _kept(keep: Optional[torch.Tensor], y: torch.Tensor, out_t: Optional[torch.Tensor]) -> None:
    """The twins' keep: y, the computed tile's values, in keep's dtype (the kernels' KEEP)."""
    if keep is None:
        return
    if out_t is not None or keep.shape != y.shape:
        raise ValueError(f"keep must be of the computed tensor's shape {tuple(y.shape)}, given without out_t")
    keep.copy_(y)


def weight_tiles(x, out: torch.Tensor, scales: torch.Tensor, out_t: Optional[torch.Tensor] = None,
                 scales_t: Optional[torch.Tensor] = None, power_of_two: bool = False, traced: bool = False) -> None:
    """x (M, K) in 128 x 128 tiles into out and scales (Mb, round_up(Kb, 4)): the tiles'
    scale_inv in the first Kb columns, 1 in the rest (the block GEMM's B layout, rows padded to
    4); with out_t (K, Mp) and scales_t (Kb, round_up(Mb, 4)) also out's bytes transposed (zero
    beyond M) and the scales transposed, likewise padded. x may be a list of row-stacked parts
    (block_kernel.MAX_PARTS at most, each but the last a multiple of 128 rows): the cast of
    their concatenation. On CUDA one Triton launch (block_kernel.weight_tiles_into), elsewhere
    its twin: block_cast, byte_transpose and copies."""
    if (x if isinstance(x, torch.Tensor) else x[0]).is_cuda:  # the kernel reads the parts in place
        from .block_kernel import weight_tiles_into
        weight_tiles_into(x, out, scales, out_t, scales_t, power_of_two, traced)
        return
    if not isinstance(x, torch.Tensor):
        x = torch.cat(list(x))
    from .block_reference import block_cast as twin
    data, scale_inv = twin(x.detach(), out.dtype, (128, 128), power_of_two)
    out.copy_(data)
    mb, kb = scale_inv.shape
    scales[:, :kb].copy_(scale_inv)
    scales[:, kb:].fill_(1.0)
    if out_t is not None:
        byte_transpose(out, out_t)
        scales_t[:, :mb].copy_(scale_inv.t())
        scales_t[:, mb:].fill_(1.0)


def byte_transpose(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (N, Mp)[:, :M] = src (M, N) transposed, zero beyond (transpose.transpose_reference):
    the Triton byte transpose on CUDA (kernels/transpose.py), a torch copy elsewhere."""
    if src.is_cuda:
        from .transpose import transpose_into
        transpose_into(src, dst)
        return
    m = src.shape[0]
    dst[:, :m].copy_(src.t())
    dst[:, m:].view(torch.uint8).zero_()


def cast_trusted(x: torch.Tensor, out: torch.Tensor, out_t: Optional[torch.Tensor], scale: torch.Tensor,
                 scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                 from_amax: Optional[torch.Tensor] = None, nonfinite_count: Optional[torch.Tensor] = None,
                 dbias_out: Optional[torch.Tensor] = None, skip: Optional[torch.Tensor] = None,
                 power_of_two: bool = False) -> None:
    """cast_amax (out_t None) or cast_transpose_amax of x's rows (x.shape[-1] columns)
    without argument checks; dbias_out (N,) float32 gets the column sums of x's rows; skip
    (a () int32 flag) turns the whole cast into a no-op when nonzero, read on the device;
    power_of_two rounds a scale computed from from_amax down to a power of two.

    The per-cast hot path of quantizers, which allocate `out`/`out_t` and own the scale
    buffers themselves; everyone else calls the checked functions above.
    """
    if x.is_cuda:
        _triton_cast().launch_cast(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                                   dbias_out, skip, power_of_two)
        return
    if skip is not None and reference.skipped(skip):
        return
    x = x.detach()  # the twins write with torch ops, which autograd would record
    if out_t is None:
        reference.cast_amax(x, out, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out,
                            power_of_two)
    else:
        cols = x.shape[-1]
        reference.cast_transpose_amax(x.reshape(-1, cols), out.view(-1, cols), out_t, scale, scale_inv_out,
                                      amax_out, from_amax, nonfinite_count, dbias_out, power_of_two)


def prepare_cast(x: torch.Tensor, out: torch.Tensor, out_t: Optional[torch.Tensor],
                 scale: torch.Tensor, scale_inv_out: torch.Tensor,
                 amax_out: Optional[torch.Tensor] = None, from_amax: Optional[torch.Tensor] = None,
                 nonfinite_count: Optional[torch.Tensor] = None, dbias: bool = False,
                 skip: Optional[torch.Tensor] = None, power_of_two: bool = False, own_amax: bool = False):
    """`cast_trusted` prepared for repeated calls on tensors like these with the same scale
    buffers: returns f(x, out, out_t, scale_inv_out, dbias_out=None)
    (dbias_out only when prepared with dbias; `skip` and `power_of_two` as for cast_trusted,
    fixed). own_amax (with from_amax): each call first sets from_amax to x's own amax, so the
    scale comes from x (current scaling's cast as one call; on CUDA one launch).
    Nothing is launched by the preparation itself.
    On CUDA the compiled kernel, grid and fixed arguments are kept (cast.PreparedCast);
    elsewhere f runs the reference twin."""
    if x.is_cuda:
        return _triton_cast().PreparedCast(x, out, out_t, scale, scale_inv_out, amax_out, from_amax,
                                           nonfinite_count, dbias, skip, power_of_two, own_amax)

    def cast(x, out, out_t, scale_inv_out, dbias_out=None):
        if own_amax and from_amax is not None and not (skip is not None and reference.skipped(skip)):
            from_amax.zero_()
            reference.amax(x.detach(), from_amax)
        cast_trusted(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out, skip,
                     power_of_two)
    return cast


class ScaleUpdateBatch:
    """The delayed-scaling update of a fixed set of quantizers, one launch per call on CUDA.

    Built once for a set of (history, scale, count) buffers that share a device, a history
    length, an amax algorithm, a margin and the power-of-two rule; calling it neither
    allocates nor synchronises, so it can be captured in a CUDA graph. Rebuild it when the
    set or any buffer changes.
    """

    def __init__(self, histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                 counts: Sequence[torch.Tensor], fp8_maxes: Sequence[float], algo: str, margin: int,
                 power_of_two: bool = False):
        if not histories:
            raise ValueError("ScaleUpdateBatch needs at least one quantizer")
        self.size = len(histories)
        if histories[0].is_cuda:
            from . import scale_update as _su

            self._launch = _su.ScaleUpdateLaunch(histories, scales, counts, fp8_maxes, algo, margin, power_of_two)
        else:
            args = (list(histories), list(scales), list(counts), list(fp8_maxes), algo, margin, power_of_two)
            self._launch = lambda: reference.scale_update(*args)

    def __call__(self) -> None:
        self._launch()


def norm_stats(x, weight, bias, eps, mean_out, rstd_out, amax_out=None) -> None:
    """LayerNorm (mean_out given) / RMSNorm row statistics, optionally the amax of the
    normalized output (norm_reference.norm_stats: the contract)."""
    _family(x, "norm").norm_stats(x, weight, bias, eps, mean_out, rstd_out, amax_out)


def norm_fwd_fp8(x, weight, bias, eps, mean_out, rstd_out, out, out_t, scale, scale_inv_out, amax_out=None,
                 from_amax=None, nonfinite_count=None, y_out=None, stats_ready=False, power_of_two=False) -> None:
    """Normalization straight into FP8 (+ transposed copy, amax, optional high-precision y)."""
    _family(x, "norm").norm_fwd_fp8(x, weight, bias, eps, mean_out, rstd_out, out, out_t, scale, scale_inv_out,
                                    amax_out, from_amax, nonfinite_count, y_out, stats_ready, power_of_two)


def norm_fwd(x, weight, bias, eps, mean_out, rstd_out, y_out) -> None:
    """Normalization in high precision alone: statistics and y, no cast (norm_reference.norm_fwd)."""
    _family(x, "norm").norm_fwd(x, weight, bias, eps, mean_out, rstd_out, y_out)


def norm_bwd(dy, x, weight, mean, rstd, dx_out, dweight_out, dbias_out=None) -> None:
    _family(x, "norm").norm_bwd(dy, x, weight, mean, rstd, dx_out, dweight_out, dbias_out)


def act_amax(h, act, amax_out) -> None:
    _family(h, "activation").act_amax(h, act, amax_out)


def act_fwd_fp8(h, act, out, out_t, scale, scale_inv_out, amax_out=None, from_amax=None,
                nonfinite_count=None, power_of_two=False) -> None:
    """act(h) straight into FP8 (+ transposed copy, amax): activation_reference.act_fwd_fp8."""
    _family(h, "activation").act_fwd_fp8(h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax,
                                         nonfinite_count, power_of_two)


def act_bwd_amax(da, h, act, amax_out) -> None:
    _family(h, "activation").act_bwd_amax(da, h, act, amax_out)


def act_bwd_fp8(da, h, act, out, out_t, scale, scale_inv_out, amax_out=None, from_amax=None,
                nonfinite_count=None, dbias_out=None, power_of_two=False) -> None:
    """dh = da * act'(h) straight into FP8 (+ transposed copy, amax, bias gradient)."""
    _family(h, "activation").act_bwd_fp8(da, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax,
                                         nonfinite_count, dbias_out, power_of_two)


def gated_fwd(g, u, act, out) -> None:
    """out <- act(g) * u, act "silu" or "gelu_tanh", float32 math rounded once
    (gated_reference.gated_fwd: the contract)."""
    _family(g, "gated").gated_fwd(g, u, act, out)


def gated_bwd(da, g, u, act, dg_out, du_out) -> None:
    """dg_out, du_out <- the gradients of act(g) * u (gated_reference.gated_bwd: the contract)."""
    _family(g, "gated").gated_bwd(da, g, u, act, dg_out, du_out)


def _checked_twin(name: str):
    """The twin of a public cast with the GPU wrapper's dbias check (the twins check nothing else)."""
    twin = getattr(reference, name)

    def run(x, *args, power_of_two=False):
        from .checks import check_dbias
        check_dbias(name, args[-1], x.shape[-1] if x.dim() else 1, x.device)
        twin(x, *args, power_of_two=power_of_two)
    return run


def _family(x: torch.Tensor, name: str):
    """The Triton module of a kernel family on CUDA, its pure-torch twin module elsewhere."""
    if not isinstance(x, torch.Tensor):  # the argument whose device picks the family; the families check the rest
        raise TypeError(f"fp8train.kernels ({name} family): expected a tensor to pick the device by, got {type(x).__name__}")
    return _family_module(name, x.is_cuda)


@functools.lru_cache(maxsize=None)
def _family_module(name: str, cuda: bool):
    # Cached: import_module costs a few us, and norm / activation layers ask on every launch.
    import importlib

    return importlib.import_module(f".{name}" if cuda else f".{name}_reference", __name__)


def _triton_cast():
    # Imported on first CUDA use only: CPU machines need neither triton nor a GPU.
    from . import cast as _cast

    return _cast
