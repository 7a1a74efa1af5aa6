"""The FP8 copy of a weight that a layer owns and rewrites in place."""
from __future__ import annotations

import contextlib
import weakref
from typing import Optional, Tuple, Union

import torch

from .. import gemm
from ..block_quantizer import BlockCast, transpose_tiles
from ..quantizer import Cast, Quantizer
from ..tensor import Float8Tensor, version_of


class WeightWorkspace:
    """One Float8Tensor per weight, allocated once and re-cast in place.

    is_first_microbatch  True: cast (and transpose) and keep the result;
                         False: reuse what was kept, no cast at all;
                         None: cast on every call.
    The Float8Tensor carries its own scale_inv, written by the same kernel as its data, so a
    later scale update of the quantizer can never desynchronise the cached payload.

    Under torch.compile the same meaning holds, with plain tensors: the cast is a custom op
    whose result (a `Cast`) the workspace keeps in `compiled` (Dynamo replays that attribute
    store after the graph), and `is_first_microbatch` is a Python value the compiled graph
    is specialised on (one graph per value used). A compiled call drops the eager forms
    (`fp8`, `block`): it never reads them, and an eager step before compiling (as HF users
    run one) would otherwise hold two bytes per parameter for good (0.67 GiB at the HF Llama
    h2048 shape). A later eager call casts into a fresh workspace.

    Block scaling (a blockwise quantizer): the weight's block cast is kept as a `BlockCast` in
    `block` (a Float8Tensor holds one scale_inv), cast into fresh buffers when Python casts it
    and re-cast into the same buffers by the C++ node (for_native); a kept cast without the transposed copy gets its tiles
    transposed (no second cast).

    Activation checkpointing's recomputation (a forward run inside the backward pass) reuses
    the kept cast, as is_first_microbatch=False would, where it was cast from this weight as
    it is now (`source`: its storage and version counter, which an optimizer step bumps) by
    the same quantizer: the re-cast would write the same bytes (current scaling: scales from
    the weight alone; delayed: scales that move on autocast entry only, as for the rest of
    the recomputation). Eager calls only; a graphed layer's skip flag keeps its own rule.
    """

    def __init__(self):
        self.fp8: Optional[Float8Tensor] = None
        self.compiled: Optional[Cast] = None  # the kept cast of compiled calls (data, data_t, scale_inv)
        self.block: Optional[BlockCast] = None  # the kept block cast (BlockScaling)
        self.source: Optional[tuple] = None  # (storage pointer, version, quantizer) of the weight eager casts last read
        self._gemm_scales: Optional[tuple] = None  # (block, its fprop and dgrad tile scales' views): block_gemm_scales
        self._recast: Optional[tuple] = None  # the last block re-cast plan and what it was made for: _block_recast

    def __getstate__(self):  # copies and pickles start without the re-cast plan: it is this process's
        state = dict(self.__dict__)
        state["_recast"] = None
        return state

    def _cast_from(self, weight: torch.Tensor, quantizer: Quantizer) -> None:
        """Note that the kept cast is (about to be) rewritten from `weight` by `quantizer`."""
        self.source = (weight.data_ptr(), version_of(weight), quantizer)

    def _recomputing(self, weight: torch.Tensor, quantizer: Quantizer, skip) -> bool:
        """Whether this call is a recomputation that may take the kept cast as it is."""
        source = self.source
        return (source is not None and skip is None and torch._C._current_graph_task_id() != -1
                and source[1] is not None and source[2] is quantizer
                and source[0] == weight.data_ptr() and source[1] == weight._version)

    def get(self, weight: torch.Tensor, quantizer: Quantizer, is_first_microbatch: Optional[bool],
            need_transpose: bool, skip: Optional[torch.Tensor] = None,
            parts: Optional[list] = None) -> Union[Float8Tensor, Cast, BlockCast]:
        """skip: the device flag of a graphed layer with FP8 weight caching (graphs.py): the
        cast is issued on every call and the kernels skip it while the flag is nonzero.
        parts: weight's row-stacked parts (a stacked tie's weight, torch.cat of them): traced
        calls cast them in place (BlockScalingQuantizer.cast_stacked), so that the graph's
        concatenation feeds the autograd node alone and Inductor drops it.
        A weight that FSDP2 gathered in FP8 (distributed/fsdp.py) is its own FP8 copy: it is
        returned as it is (its transposed copy is made from its bytes on demand)."""
        if isinstance(weight, Float8Tensor):
            if torch.compiler.is_compiling():  # as a Cast: Dynamo (torch 2.11) fails an internal assertion
                # on a tensor subclass passed through an autograd.Function (_LinearFn)
                data = weight._data
                return Cast(data, data.t().contiguous() if need_transpose else None, weight._scale_inv)
            return weight
        if torch.compiler.is_compiling():
            return self._get_traced(weight, quantizer, is_first_microbatch, need_transpose, parts)
        if is_first_microbatch is not False and self._recomputing(weight, quantizer, skip):
            is_first_microbatch = False
        if quantizer.blockwise:
            return self._get_block(weight, quantizer, is_first_microbatch, need_transpose, skip)
        ws = self.fp8
        fits = self.fits(weight, quantizer)
        if is_first_microbatch is False and fits:
            return ws  # the transposed copy, if missing, is built from the FP8 payload on demand
        self._cast_from(weight, quantizer)
        if fits:
            quantizer.requantize(weight, ws, transpose=need_transpose, skip=skip)
        else:
            with _kept():
                self.fp8 = quantizer.quantize(weight, transpose=need_transpose)
        return self.fp8

    def for_native(self, weight: torch.Tensor, quantizer: Quantizer, is_first_microbatch: Optional[bool],
                   need_transpose: bool, skip: Optional[torch.Tensor] = None):
        """(workspace, plan) for a C++ node: where this call re-casts the weight in its
        steady state, the quantizer's C++ cast plan of that re-cast (Quantizer.native_recast:
        bookkeeping done, the node runs it into the workspace before its GEMMs) and the
        workspace it writes; else (get(...)'s result, None), the weight cast or kept here in
        Python."""
        if isinstance(weight, Float8Tensor):  # gathered by FSDP2 in FP8: nothing to cast
            return weight, None
        if is_first_microbatch is not False and self._recomputing(weight, quantizer, skip):
            is_first_microbatch = False
        if quantizer.blockwise:  # the re-cast into the kept block cast's buffers (a tile plan)
            kept = self.block
            if is_first_microbatch is not False and skip is None and kept is not None \
                    and kept.data.device == weight.device:
                plan = self._block_recast(weight, quantizer, kept, need_transpose)
                if plan is not None:
                    if not need_transpose and kept.data_t is not None:  # not rewritten: no longer kept
                        self.block = kept = kept._replace(data_t=None, scale_inv_t=None)
                        self._gemm_scales = self._recast = None
                    self._cast_from(weight, quantizer)
                    return kept, plan
        elif is_first_microbatch is not False and skip is None and self.fits(weight, quantizer):
            plan = quantizer.native_recast(weight, self.fp8, need_transpose)
            if plan is not None:
                self._cast_from(weight, quantizer)
                return self.fp8, plan
        return self.get(weight, quantizer, is_first_microbatch, need_transpose=need_transpose, skip=skip), None

    def _block_recast(self, weight: torch.Tensor, quantizer: Quantizer, kept: BlockCast, transpose: bool):
        """quantizer.native_recast(weight, kept, transpose), kept for the next call with the same
        weight (its storage and shape), quantizer and kept cast: the plan's checks took 7.7 us a
        call, each layer's weight re-cast of every eager step (the fifty-second session)."""
        memo = self._recast
        if memo is not None and memo[0] is kept and memo[1]() is weight and memo[2] is quantizer \
                and memo[3] == transpose and memo[4] == weight.data_ptr() and memo[5] == weight.shape:
            return memo[6]
        plan = quantizer.native_recast(weight, kept, transpose)
        self._recast = (kept, weakref.ref(weight), quantizer, transpose, weight.data_ptr(), weight.shape, plan)
        return plan

    def fits(self, weight: torch.Tensor, quantizer: Quantizer) -> bool:
        """Whether the workspace exists and can hold `weight` cast by `quantizer`."""
        ws = self.fp8
        return (ws is not None and ws.shape == weight.shape and ws.device == weight.device
                and ws.dtype == weight.dtype and ws.fp8_dtype == quantizer.dtype)

    def _get_traced(self, weight, quantizer, is_first_microbatch, need_transpose, parts=None) -> Cast:
        # stores only (no guard); Dynamo replays them after the graph
        self.fp8 = self.block = self._gemm_scales = self._recast = None
        cast = quantizer.cast if parts is None else lambda w, transpose: quantizer.cast_stacked(parts,
                                                                                                 transpose=transpose)
        if is_first_microbatch is None:  # cast on every call; `compiled` not read: no guard on it
            return cast(weight, transpose=need_transpose)
        kept = self.compiled
        fits = (kept is not None and kept.data.shape == weight.shape and kept.data.dtype == quantizer.dtype
                and (kept.data_t is not None or not need_transpose))
        if is_first_microbatch is False and fits:
            return kept
        # A kept cast without the transposed copy that is now needed is cast again (eager
        # transposes the FP8 payload instead); the result is the same bytes.
        self.compiled = kept = cast(weight, transpose=need_transpose)
        return kept

    def _get_block(self, weight, quantizer, is_first_microbatch, need_transpose, skip) -> BlockCast:
        if skip is not None:
            raise NotImplementedError("fp8train: FP8 weight caching in CUDA graphs does not take BlockScaling yet")
        kept = self.block
        if is_first_microbatch is False and kept is not None and kept.data.shape == weight.shape \
                and kept.data.dtype == quantizer.dtype and kept.data.device == weight.device:
            with _kept():
                if need_transpose and kept.data_t is None:
                    self.block = kept = transpose_tiles(kept)
                    self._gemm_scales = self._recast = None
            return kept
        self._cast_from(weight, quantizer)
        with _kept():
            self.block = quantizer.cast(weight, transpose=need_transpose)
        self._gemm_scales = self._recast = None
        return self.block

    def block_gemm_scales(self, w: BlockCast, transposed: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The block cast w's tile scales as the block GEMMs' B operands (gemm.tile_scales):
        fprop's, and with `transposed` dgrad's, else None. Views of the kept cast (`block`,
        re-cast in place by the C++ node) are made once and kept with it; those of any other
        cast are made here."""
        memo = self._gemm_scales
        if memo is not None and memo[0] is w and (memo[2] is not None or not transposed):
            return memo[1], memo[2] if transposed else None
        scales = (gemm.tile_scales(w.scale_inv), gemm.tile_scales(w.scale_inv_t) if transposed else None)
        if w is self.block:
            self._gemm_scales = (w, *scales)
        return scales


def _kept():
    """Where the workspace allocates what it keeps between steps: ordinary tensors, also under
    torch.inference_mode (an evaluation before training), since a training step rewrites them
    in place, which an inference tensor refuses outside inference mode."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def weight_operands(w: Union[Float8Tensor, Cast, BlockCast]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(W (N, K) fp8, scale_inv) for the fprop GEMM, from either form of the FP8 weight."""
    if isinstance(w, Float8Tensor):
        return w.fp8_data, w.scale_inv
    return w.data, w.scale_inv


def weight_transposed(w: Union[Float8Tensor, Cast, BlockCast]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(W^T (K, N) fp8, scale_inv) for the dgrad GEMM, from either form of the FP8 weight
    (a block cast's scale_inv_t: W's tile scales transposed)."""
    if isinstance(w, Float8Tensor):
        return w.transpose_data(), w.scale_inv
    return w.data_t, w.transposed_scale_inv


def high_precision_weight(layer, weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A weight for a layer's high-precision path: the parameter, or one FSDP2 gathered in
    FP8 (fp8_all_gather) dequantized, which the layer says once (FSDP2 keeps one form of each
    unsharded weight: the master is not gathered)."""
    if not isinstance(weight, Float8Tensor):
        return weight
    layer.warn_once("gathered", "FSDP2 gathers this weight in FP8 (fp8_all_gather): outside FP8 it computes "
                                "with the dequantized FP8 weight, not the master weight")
    return weight.dequantize()
