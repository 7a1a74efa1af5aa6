"""Quantizers: one tensor role's scaling state, and the cast that uses it.

A quantizer is a small nn.Module so its state (scale, amax history, counters) moves with
`.to()` and lives in the owning layer's state_dict. It turns a high-precision tensor into a
Float8Tensor (optionally with the transposed copy the backward GEMMs need) in one kernel.
"""
from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from . import kernels, ops, scaling
from .recipe import CurrentScaling, DelayedScaling, Recipe
from .roles import TensorRole
from .tensor import Float8Tensor, padded_rows, version_of


_CASTABLE = (torch.bfloat16, torch.float16, torch.float32)


class Cast(NamedTuple):
    """One cast's outputs as plain tensors (what layers save and feed to the GEMMs)."""

    data: torch.Tensor               # x's shape, fp8, row-major
    data_t: Optional[torch.Tensor]   # (cols, padded_rows(rows)) fp8 transposed copy, zero padded; or None
    scale_inv: torch.Tensor          # (1,) float32, this cast's own 1/scale
    dbias: Optional[torch.Tensor] = None  # (cols,) float32 column sums of x's rows (cast(dbias=True))

    @property
    def transposed_scale_inv(self) -> torch.Tensor:
        """The scale_inv that goes with data_t: the same one (BlockCast: data_t's own)."""
        return self.scale_inv


def _launch_key(shape, dtype, transpose: bool, dbias: bool, skip: Optional[torch.Tensor] = None) -> tuple:
    """Where a quantizer keeps one prepared steady-state launch (Quantizer._launch)."""
    return shape, dtype, transpose, dbias, 0 if skip is None else skip.data_ptr()


class Quantizer(nn.Module):
    """Base: role, FP8 dtype, and the allocation/layout side of quantization.

    power_of_two: every scale this quantizer computes from an amax is rounded down to a
    power of two (the recipe's power_of_two_scales; scaling.compute_scale). A rule, like a
    delayed quantizer's algo and margin: the recipe sets it (`configure`), the state_dict
    does not hold it.
    """

    # Per-block scales (BlockScalingQuantizer): no scale of its own, and 2-D scale_invs.
    blockwise = False

    def __init__(self, role: TensorRole, dtype: torch.dtype, device=None, power_of_two: bool = False):
        super().__init__()
        self.role = role
        self.dtype = dtype
        self.power_of_two = bool(power_of_two)
        self.register_buffer("fp8_max", torch.tensor(scaling.fp8_max(dtype), device=device))
        if not self.blockwise:
            self.register_buffer("scale", torch.ones((), device=device))
            # inf/NaN amaxes seen (and kept away from the scale): readable by users and tests.
            self.register_buffer("nonfinite_count", torch.zeros((), dtype=torch.int32, device=device))
        self._prepared: dict = {}  # prepared launches per input shape/dtype/mode (host time, see _launch)
        # Instance attributes from the start: Dynamo guards on where they are found, and the
        # first compiled step's write would move them from the class, a recompile.
        self._traced_memo = None
        self._traced_stack = None
        self._offered = None

    def quantize(self, x: torch.Tensor, *, transpose: bool = False,
                 out: Optional[Float8Tensor] = None) -> Float8Tensor:
        """Cast `x` (any shape, float) to FP8 with this quantizer's scaling.

        transpose  also write the transposed copy of the 2-D view (rows, x.shape[-1]) and cache
                   it on the result (`Float8Tensor.transpose_data`), from the same read of x.
        out        an existing Float8Tensor of x's shape to overwrite in place (a workspace):
                   its payload, scale_inv and, when `transpose`, transposed buffer are reused.
        """
        if out is None:
            parts = self.cast(x, transpose=transpose)
            result = Float8Tensor(parts.data, parts.scale_inv, x.dtype, self.role)
            if parts.data_t is not None:
                result._set_transpose(parts.data_t)
            return result
        if out.shape != x.shape or out.fp8_dtype != self.dtype or out.device != x.device:
            raise ValueError(f"{self.role.name} quantizer: workspace {out!r} does not fit a {tuple(x.shape)} "
                             f"{x.dtype} tensor cast to {self.dtype}")
        self.requantize(x, out, transpose=transpose)
        return out

    def requantize(self, x: torch.Tensor, out: Float8Tensor, *, transpose: bool = False,
                   skip: Optional[torch.Tensor] = None) -> None:
        """quantize(x, out=out) for a caller that has checked that `out` fits x (a weight
        workspace, every step): payload, scale_inv and transposed buffer rewritten in place.
        skip: a () int32 device flag; while it is nonzero the cast kernels do nothing and
        `out` keeps what it held (a CUDA graph that replays the cast of a cached weight)."""
        x = self._checked(x)
        out._mark_rewritten()
        data_t = None
        if transpose:
            data_t = out._transpose
            shape = self._transpose_shape(x)
            if data_t is None or data_t.shape != shape:
                data_t = torch.empty(shape, dtype=self.dtype, device=x.device)
        self._cast(x, out._data, data_t, out._scale_inv, None, skip)
        if data_t is not None:
            out._set_transpose(data_t)

    def cast(self, x: torch.Tensor, *, transpose: bool = False, dbias: bool = False) -> "Cast":
        """The hot path of `quantize` for layers: the same cast into fresh buffers, returned
        as plain tensors (no Float8Tensor is built: its construction costs more host time
        than the launch). dbias: also the float32 column sums of x's rows, from the same
        read (the bias gradient, when x is a grad-output)."""
        x = self._checked(x)
        if torch.compiler.is_compiling():  # traced code: the same kernels as a custom op (fp8train/ops.py)
            return Cast(*ops.cast(x, self.dtype, self.scaling_state(), transpose, dbias))
        shape, device = x.shape, x.device
        data, data_t, scale_inv = self._buffers_for(shape, device, transpose)
        dbias_out = None
        if dbias:
            dbias_out = torch.empty(shape[-1] if shape else 1, dtype=torch.float32, device=device)
        self._cast(x, data, data_t, scale_inv, dbias_out)
        return Cast(data, data_t, scale_inv, dbias_out)

    # Layers whose input quantizer this is: above 1 for sibling layers that read one tensor
    # (modules/base.py ties their input quantizers), whose calls then go through cast_shared.
    sharing = 1
    # The tie's layers in the order they joined it (their first calls' order), plain
    # references (a deepcopy or pickle of the model points them at its own layers): a list
    # once a tie forms (modules/base.py), kept to the `sharing` layers whose input quantizer
    # this is. modules/stacked.py runs them as one GEMM.
    members: tuple = ()
    _memo = None  # cast_shared's last cast: (weakref to x, x._version, x.shape, scale epoch, hits left, Cast)
    _traced_memo = None  # the same in the trace being made: (x, hits left, Cast); None between traces (__init__)
    # modules/stacked.py's outputs for the members still to call: eager (weakref to x,
    # x._version, outputs), traced (x, outputs); an output None once taken
    _stack_memo = None
    _traced_stack = None
    # modules/stacked.py's offer: a cast of x made upstream for this quantizer's layer, (x, cast
    # as _LinearFn's four shared-cast arguments), taken by that layer's next call on x
    _offered = None

    def cast_shared(self, x: torch.Tensor, *, transpose: bool = False) -> "Cast":
        """cast(x as (rows, x.shape[-1]), transpose=transpose) for an input that `sharing`
        sibling layers read (the same tensor object): the first sibling's call casts and keeps
        the Cast, the others' calls get it back (no cast, and no second amax record: delayed
        scaling's would record the same amax), and it is dropped after the last of them.
        Kept only while it holds what a cast now would write: x unchanged (its version), the
        same scales (delayed scaling: no update since; current scaling's follows from x), and
        the transposed copy if the call needs one. Traced code: `_traced_cast_shared`."""
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
        if torch.compiler.is_compiling():
            return self._traced_cast_shared(x, rows, transpose)
        epoch = self._memo_epoch(x)
        memo = self._memo
        if memo is not None:
            ref, version, shape, memo_epoch, left, cast = memo
            if (ref() is x and version == version_of(x) and shape == x.shape and memo_epoch == epoch
                    and (cast.data_t is not None or not transpose)):
                self._memo = (ref, version, shape, epoch, left - 1, cast) if left > 1 else None
                return cast
        cast = self.cast(rows, transpose=transpose)
        self._memo = (weakref.ref(x), version_of(x), x.shape, epoch, self.sharing - 1, cast)
        return cast

    def offer_shared(self, x: torch.Tensor, cast: "Cast") -> None:
        """A producer's cast of x for the `sharing` sibling layers that read x (an RMSNorm
        whose kernel cast what it computed, with this quantizer: modules/rms_norm.py): their
        cast_shared calls get it back, as if the first of them had made it."""
        self._memo = (weakref.ref(x), version_of(x), x.shape, self._memo_epoch(x), self.sharing, cast)

    def _memo_epoch(self, x: torch.Tensor):
        epoch = self._scale_epoch()
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            epoch = (epoch, "captured")  # a memo serves within a CUDA graph capture, or outside, not across
        return epoch

    def _traced_cast_shared(self, x: torch.Tensor, rows: torch.Tensor, transpose: bool) -> "Cast":
        """cast_shared in a torch.compile trace: one cast op in the graph for all the siblings.
        Inductor merges none of them (each mutates the quantizer's state), and each made it
        write a copy of x of its own (HF Llama h1024 on the H200: three float32 copies of the
        q/k/v input from one RMSNorm kernel, three casts). Dynamo records the memo's writes and
        replays the last one, None once every sibling has cast, so the Cast is no graph output.
        The memo is keyed on x's identity alone (in a trace x._version is a constant, and the
        scale cannot change between siblings: delayed updates run on entering fp8train.autocast); the
        caller casts outside its autograd.Function, whose trace may not write module state."""
        memo = self._traced_memo
        if memo is not None and memo[0] is x and (memo[2].data_t is not None or not transpose):
            self._traced_memo = (x, memo[1] - 1, memo[2]) if memo[1] > 1 else None
            return memo[2]
        cast = self.cast(rows, transpose=transpose)
        self._traced_memo = (x, self.sharing - 1, cast) if self.sharing > 1 else None
        return cast

    def _scale_epoch(self) -> int:
        """What changes whenever the scale a cast applies may change without x changing."""
        return 0

    def allocate(self, shape, device, *, transpose: bool = False) -> "Cast":
        """Uninitialised output buffers of one cast of a tensor of `shape` (for producers)."""
        return Cast(*self._buffers_for(shape, device, transpose))

    def _buffers_for(self, shape, device, transpose: bool):
        dtype = self.dtype
        # Sizes as separate ints: torch.empty parses a torch.Size or tuple ~1.5 us slower.
        data = torch.empty(*shape, dtype=dtype, device=device) if shape else torch.empty((), dtype=dtype, device=device)
        scale_inv = torch.empty(1, dtype=torch.float32, device=device)  # (1,): cheaper to allocate than ()
        if not transpose:
            return data, None, scale_inv
        cols = shape[-1]
        data_t = torch.empty(cols, padded_rows(data.numel() // cols if cols else 0), dtype=dtype, device=device)
        return data, data_t, scale_inv

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _CASTABLE or isinstance(x, Float8Tensor):
            raise TypeError(f"{self.role.name} quantizer: expected a bfloat16, float16 or float32 tensor, "
                            f"got {'a Float8Tensor' if isinstance(x, Float8Tensor) else x.dtype}")
        return x if x.is_contiguous() else x.contiguous()  # kernels read it by pointer: no detach needed

    @staticmethod
    def _transpose_shape(x: torch.Tensor):
        cols = x.shape[-1]
        return cols, padded_rows(x.numel() // cols if cols else 0)

    def _cast(self, x, data, data_t, scale_inv, dbias_out=None, skip=None) -> None:
        raise NotImplementedError

    power_of_two = False  # set per instance in __init__; the class default serves quantizers pickled before it

    # True once casts take the scale from state (current scaling: always). Read, never
    # changed, by traced code; fp8train.modules.base.mark_calibrated flips it there.
    calibrated = True

    def scaling_state(self) -> ops.ScalingState:
        """The state tensors the custom ops take for this quantizer's next cast, following
        `produce` (fp8train/ops.py); depends on `calibrated` but does not change it."""
        raise NotImplementedError

    def produce(self, first_pass: Callable[[torch.Tensor], None],
                cast: Callable[[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]],
                               None],
                amax_hook: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """Quantize through a producer kernel (norm, activation) that casts what it computes.

        first_pass(amax_out)  max-accumulates the amax of the values the producer will cast
                              into amax_out and writes no output; run only when the scale
                              must come from those values (current scaling, calibration)
        cast(scale, amax_out, from_amax, nonfinite_count, power_of_two)
                              the producer's FP8 launch, with the cast kernels' contract
                              (kernels.reference.cast_amax); from_amax is not None exactly
                              when first_pass ran just before; power_of_two is this
                              quantizer's rule, for the scale computed from from_amax
        amax_hook(amax)       runs between the two, in place on the first pass's amax: under
                              tensor parallelism it makes that amax the group's maximum (one
                              all-reduce) so every rank casts with the same scale
                              (distributed.fp8_comm.cast_consistent, and the norm producer of
                              the sequence-parallel fused modules)
        """
        raise NotImplementedError

    def _launch(self, x, data, data_t, scale_inv, amax_out=None, from_amax=None, count=None,
                dbias_out=None, skip=None, own_amax=False) -> None:
        """One kernel launch of this quantizer's steady state through a prepared launch
        (kernels.prepare_cast), kept per (shape, dtype, transposed?, dbias?, skip flag).
        The buffers named here must be this quantizer's own, fixed for the key (and so is
        own_amax, per quantizer class): preparations are dropped whenever the buffers may have
        moved (`_forget_prepared`)."""
        key = _launch_key(x.shape, x.dtype, data_t is not None, dbias_out is not None, skip)
        launch = self._prepared.get(key)
        if launch is None:
            if len(self._prepared) >= 64:  # many input shapes (variable lengths): start over
                self._prepared.clear()
            launch = self._prepared[key] = kernels.prepare_cast(
                x, data, data_t, self.scale, scale_inv, amax_out, from_amax, count,
                dbias=dbias_out is not None, skip=skip, power_of_two=self.power_of_two, own_amax=own_amax)
        launch(x, data, data_t, scale_inv, dbias_out)

    def native_plan(self, shape, dtype: torch.dtype, transpose: bool, dbias_dtype: Optional[torch.dtype]):
        """The C++ cast plan (kernels/native.py) of this quantizer's steady-state cast of a
        contiguous 2-D input of `shape` and `dtype` on the current CUDA device, made from the
        launches the Python path prepared for it; None until that path has run once for this
        case (and prepared them), or where the C++ launcher cannot run them. dbias_dtype: the
        plan also returns x's column sums, in that dtype (the bias's: the same bytes as the
        Python path's float32 sums cast by autograd, without the engine's cast), or None.
        Dropped with the preparations (`_forget_prepared`)."""
        key = ("native", shape, dtype, transpose, dbias_dtype)
        prepared = self._prepared
        if key in prepared:
            return prepared[key]
        if dbias_dtype is not None and not isinstance(dbias_dtype, torch.dtype):
            raise TypeError(f"native_plan: dbias_dtype must be a torch.dtype or None, got {dbias_dtype!r}")
        dbias = dbias_dtype is not None
        launches = self._steady_launches(shape, dtype, transpose, dbias)
        if launches is None:
            return None
        from .kernels import native
        prepared[key] = native.cast_plan(launches, torch._C._cuda_getDevice(), dtype, self.dtype, shape, transpose,
                                         launches[-1].partial if dbias else None,
                                         dbias_dtype or torch.float32)
        return prepared[key]

    def native_recast(self, x: torch.Tensor, out: Float8Tensor, transpose: bool):
        """requantize(x, out, transpose=transpose) left to the caller's C++ call: this
        quantizer's cast plan for x (`native_plan`, run by the C++ side into out's payload,
        transposed buffer and scale_inv: csrc/linear_node.cpp `recast`), with `out`'s
        bookkeeping done, or None (nothing done) where the Python cast must run: no plan yet
        (delayed scaling before calibration, the first cast of a shape), a transposed copy
        wanted that `out` has no buffer for, x not a contiguous, 16-byte aligned 2-D tensor.
        `out` must fit x."""
        if isinstance(x, Float8Tensor) or x.dim() != 2 or not x.is_contiguous() or x.data_ptr() & 15:
            return None
        data_t = out._transpose if transpose else None
        if transpose and data_t is None:
            return None
        plan = self.native_plan(x.shape, x.dtype, transpose, None)
        if plan is None:
            return None
        out._mark_rewritten()  # the C++ launches rewrite payload (and transposed copy) through raw pointers
        if data_t is not None:
            out._set_transpose(data_t)
        return plan

    def replay_fixed(self) -> Optional[tuple]:
        """The buffers the next `produce` reads and writes when that is one cast launch from this
        quantizer's state alone, so that kernels/replay.py may record and replay it; None
        otherwise. Only delayed scaling, once calibrated (current scaling zeroes its amax with
        a torch op between its two launches, which a launch group would not repeat)."""
        return None

    def _steady_launches(self, shape, dtype, transpose: bool, dbias: bool) -> Optional[tuple]:
        """The prepared launches of one steady-state cast, in order (None: not all prepared)."""
        raise NotImplementedError

    def _forget_prepared(self) -> None:
        self._prepared = {}
        self._memo = None  # its scale may be stale too (a load, a move, a new rule)

    def _apply(self, fn, recurse=True):
        def keeping_dtype(t):
            # The scaling state stays float32 (the kernels read it so): a model's .to(bfloat16),
            # .half() or .double() moves these buffers, if it moves them, and converts only the
            # layers' parameters (rounding the scales to bf16 and back would lose their bits).
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(device=out.device)

        was_meta = self.fp8_max.is_meta
        out = super()._apply(keeping_dtype, recurse)
        if was_meta and not self.fp8_max.is_meta:
            # Materialised from the meta device (model.to_empty after a meta-device init, as
            # torchtitan and FSDP2 users build models): the new buffers hold whatever memory held.
            self._fill_initial_state()
        self._forget_prepared()  # buffers may be new tensors
        return out

    @torch.no_grad()
    def _fill_initial_state(self) -> None:
        """The state of a new quantizer, written into its buffers in place."""
        self.fp8_max.fill_(scaling.fp8_max(self.dtype))
        if not self.blockwise:
            self.scale.fill_(1.0)
            self.nonfinite_count.zero_()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._forget_prepared()  # assign=True loads replace the buffers

    # A tie's quantizer (sharing > 1) reaches one state_dict under each sibling's name. Its
    # first name's entry of fp8_max, (key, tensor), marks the state_dict being written.
    _state_mark = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        mark = self._state_mark
        if self.sharing > 1 and mark is not None and destination.get(mark[0]) is mark[1]:
            # A later name of a tie gets copies: safetensors (HF save_pretrained) refuses one
            # storage under several names. The first name keeps the buffers themselves, which
            # loads in place (torch.distributed.checkpoint) write through.
            entries: dict = {}
            super()._save_to_state_dict(entries, prefix, keep_vars)
            destination.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()})
            return
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "fp8_max"
        self._state_mark = (key, destination[key]) if self.sharing > 1 else None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_prepared"] = {}  # compiled kernels and views of this copy's buffers stay behind
        # the stack memo's outputs and an offered cast are graph tensors of this process
        state["_memo"] = state["_stack_memo"] = state["_offered"] = None
        state.pop("_state_mark", None)  # an alias of a buffer of the original
        return state

    def matches(self, recipe: Recipe, role: TensorRole) -> bool:
        raise NotImplementedError

    def configure(self, recipe: Recipe) -> None:
        """Adopt the recipe's scale rules (not state: they are not in the state_dict)."""
        if self.power_of_two != recipe.power_of_two_scales:
            self.power_of_two = recipe.power_of_two_scales
            self._forget_prepared()  # the prepared kernels (and C++ plans) were specialised on it

    def extra_repr(self) -> str:
        pow2 = ", power_of_two=True" if self.power_of_two else ""
        return f"role={self.role.name}, dtype={self.dtype}{pow2}"


class CurrentScalingQuantizer(Quantizer):
    """scale = fp8_max / amax of the tensor being cast: an amax pass, then the cast; on CUDA
    both in one cooperative launch (kernels/cast.py, OWN_AMAX).

    `scale` and `amax` hold the values of the last cast (a zero or non-finite amax keeps the
    previous scale, see scaling.compute_scale).
    """

    def __init__(self, role: TensorRole, dtype: torch.dtype, device=None, power_of_two: bool = False):
        super().__init__(role, dtype, device, power_of_two)
        self.register_buffer("amax", torch.zeros((), device=device))

    def _fill_initial_state(self) -> None:
        super()._fill_initial_state()
        self.amax.zero_()

    def _cast(self, x, data, data_t, scale_inv, dbias_out=None, skip=None) -> None:
        # amax <- x's amax, then the cast with the scale computed from it (a skipped cast leaves both)
        self._launch(x, data, data_t, scale_inv, from_amax=self.amax, count=self.nonfinite_count,
                     dbias_out=dbias_out, skip=skip, own_amax=True)

    def scaling_state(self) -> ops.ScalingState:
        return ops.ScalingState(self.scale, None, self.amax, self.nonfinite_count, self.power_of_two)

    def _steady_launches(self, shape, dtype, transpose, dbias):
        cast = self._prepared.get(_launch_key(shape, dtype, transpose, dbias))
        return None if cast is None else (cast,)

    def produce(self, first_pass, cast, amax_hook=None) -> None:
        self.amax.zero_()
        first_pass(self.amax)
        if amax_hook is not None:
            amax_hook(self.amax)
        cast(self.scale, None, self.amax, self.nonfinite_count, self.power_of_two)

    def matches(self, recipe: Recipe, role: TensorRole) -> bool:
        return isinstance(recipe, CurrentScaling) and self.dtype == recipe.fp8_format.dtype(role)


class DelayedScalingQuantizer(Quantizer):
    """Scale from the amax history (scaling.py explains its layout); the cast is one pass.

    Each cast max-accumulates its amax into `amax_history[0]`; `update_delayed_scales()`
    (run by `fp8train.autocast` on entry) rolls every history and recomputes every scale in
    one launch. The first cast of a fresh quantizer has no history and calibrates: it takes
    the tensor's own amax (one extra pass, once).
    """

    def __init__(self, role: TensorRole, dtype: torch.dtype, history_len: int,
                 algo: str = "max", margin: int = 0, device=None, power_of_two: bool = False):
        super().__init__(role, dtype, device, power_of_two)
        self.register_buffer("amax_history", torch.full((history_len,), scaling.UNRECORDED, device=device))
        self.register_buffer("_calibration_amax", torch.zeros((), device=device), persistent=False)
        self.algo = algo
        self.margin = margin
        self.calibrated = False
        _REGISTRY.add(self)

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[0]

    def _fill_initial_state(self) -> None:
        super()._fill_initial_state()
        self.amax_history.fill_(scaling.UNRECORDED)
        self._calibration_amax.zero_()
        self.calibrated = False

    def _scale_epoch(self) -> int:
        return delayed_updates()  # the scale changes at an update only (a kernel writes it: no version bump)

    def _cast(self, x, data, data_t, scale_inv, dbias_out=None, skip=None) -> None:
        if self.calibrated:
            if skip is None:
                launch = self._prepared.get(_launch_key(x.shape, x.dtype, data_t is not None, dbias_out is not None))
                if launch is not None:  # the steady state, inlined: one dict lookup and the launch
                    launch(x, data, data_t, scale_inv, dbias_out)
                    return
            # amax_history[0] is (): casts max into it
            self._launch(x, data, data_t, scale_inv, amax_out=self.amax_history[0], dbias_out=dbias_out, skip=skip)
            return
        pending = self.amax_history[0]
        self._calibration_amax.zero_()
        kernels.amax(x, self._calibration_amax)
        # A non-finite calibration amax keeps scale 1; the update counts it once (not here).
        kernels.cast_trusted(x, data, data_t, self.scale, scale_inv, pending, self._calibration_amax, None, dbias_out,
                             skip, self.power_of_two)
        self.calibrated = True

    def _steady_launches(self, shape, dtype, transpose, dbias):
        if not self.calibrated:
            return None
        cast = self._prepared.get(_launch_key(shape, dtype, transpose, dbias))
        return None if cast is None else (cast,)

    def requantize(self, x, out, *, transpose=False, skip=None) -> None:
        # The steady state of a weight workspace re-cast every step, inlined (host time): a
        # contiguous weight of a shape already prepared, the transposed buffer in place.
        if skip is None and self.calibrated and not isinstance(x, Float8Tensor) and x.is_contiguous():
            data_t = out._transpose if transpose else None
            launch = self._prepared.get(_launch_key(x.shape, x.dtype, transpose, False))
            if launch is not None and (data_t is not None or not transpose):
                out._mark_rewritten()
                launch(x, out._data, data_t, out._scale_inv)
                if data_t is not None:
                    out._set_transpose(data_t)
                return
        super().requantize(x, out, transpose=transpose, skip=skip)

    def scaling_state(self) -> ops.ScalingState:
        first_amax = None if self.calibrated else self._calibration_amax  # calibration: one amax pass first
        return ops.ScalingState(self.scale, self.amax_history, first_amax, None, self.power_of_two)

    def replay_fixed(self) -> Optional[tuple]:
        return tuple(b for b in self._buffers.values() if b is not None) if self.calibrated else None

    def produce(self, first_pass, cast, amax_hook=None) -> None:
        if self.calibrated:  # the scale comes from the history (agreeing across ranks once histories are reduced)
            cast(self.scale, self.amax_history[0], None, None, self.power_of_two)
            return
        self._calibration_amax.zero_()
        first_pass(self._calibration_amax)
        if amax_hook is not None:
            amax_hook(self._calibration_amax)
        cast(self.scale, self.amax_history[0], self._calibration_amax, None, self.power_of_two)
        self.calibrated = True

    def matches(self, recipe: Recipe, role: TensorRole) -> bool:
        return (isinstance(recipe, DelayedScaling) and self.history_len == recipe.amax_history_len
                and self.dtype == recipe.fp8_format.dtype(role))

    def configure(self, recipe: DelayedScaling) -> None:
        """Adopt the recipe's update rule (not state: it is not in the state_dict)."""
        rule = (self.algo, self.margin, self.power_of_two)
        super().configure(recipe)
        if rule != (recipe.amax_compute_algo, recipe.margin, recipe.power_of_two_scales):
            self.algo, self.margin = recipe.amax_compute_algo, recipe.margin
            _REGISTRY.invalidate()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        _REGISTRY.invalidate()  # buffers may be new tensors: rebuild the update's pointer tables
        return out

    def __setstate__(self, state):
        super().__setstate__(state)
        _REGISTRY.add(self)  # copies (copy.deepcopy, pickle) are live quantizers too

    def _load_from_state_dict(self, *args, **kwargs):
        ptrs = [b.data_ptr() for b in self.buffers()]
        super()._load_from_state_dict(*args, **kwargs)
        if ptrs != [b.data_ptr() for b in self.buffers()]:  # loads copy in place unless assign=True
            _REGISTRY.invalidate()
        # Resumed state with a recorded amax is calibrated (one sync, at load time only).
        self.calibrated = bool((self.amax_history >= 0).any())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, history_len={self.history_len}, algo={self.algo}, margin={self.margin}"


class _DelayedScalingRegistry:
    """Every live DelayedScalingQuantizer, so that one launch per step updates them all.

    Holds weak references: a quantizer leaves when its layer is freed. The update batches
    (pointer tables on CUDA) hold the buffers they point to, so a batch stays safe to run,
    and to replay from a CUDA graph, after its quantizers die; it is then only stale and is
    rebuilt at the next update outside graph capture. A new, moved or reconfigured quantizer
    needs a rebuild before its scale can update, and a rebuild cannot run during capture.
    """

    def __init__(self):
        self._refs: list = []
        self._batches: Optional[list] = None
        self._stale = False
        self.updates = 0  # eager update() calls so far: what a cast with the scales of an earlier one keys on

    def add(self, q: DelayedScalingQuantizer) -> None:
        self._refs.append(weakref.ref(q, self._forget))
        self._batches = None

    def _forget(self, ref) -> None:
        if ref in self._refs:
            self._refs.remove(ref)
        self._stale = True

    def invalidate(self) -> None:
        self._batches = None

    def live(self) -> list:
        return [q for q in (r() for r in self._refs) if q is not None]

    def batches(self) -> list:
        """The update batches as built now. A CUDA graph that captured `update` must hold
        these for as long as it may replay: a later rebuild drops them from here, and their
        pointer tables would be freed under the graph."""
        return list(self._batches or ())

    def update(self) -> None:
        if self._batches is None or self._stale:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if self._batches is None and capturing:
                raise RuntimeError(
                    "fp8train: FP8 layers were created, moved or reconfigured since the last eager step, "
                    "so the scale update cannot be captured in a CUDA graph; run one eager step "
                    "(forward and backward) before capturing")
            if not capturing:
                self._rebuild()
        self.updates += 1
        for batch in self._batches:
            batch()

    def _rebuild(self) -> None:
        groups: dict = {}
        for q in self.live():
            key = (q.amax_history.device, q.history_len, q.algo, q.margin, q.power_of_two)
            groups.setdefault(key, []).append(q)
        self._batches = [
            kernels.ScaleUpdateBatch([q.amax_history for q in qs], [q.scale for q in qs],
                                     [q.nonfinite_count for q in qs], [scaling.fp8_max(q.dtype) for q in qs],
                                     algo, margin, pow2)
            for (_, _, algo, margin, pow2), qs in groups.items()
        ]
        self._stale = False


_REGISTRY = _DelayedScalingRegistry()


def update_delayed_scales() -> None:
    """Roll every live delayed-scaling history and recompute its scale: one launch per
    (device, history length, algorithm, margin, power-of-two rule) group, no sync, no
    allocation once built."""
    _REGISTRY.update()


def delayed_updates() -> int:
    """How many times update_delayed_scales ran in Python (not counting CUDA-graph replays):
    delayed scales change only then."""
    return _REGISTRY.updates
