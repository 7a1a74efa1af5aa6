"""The delayed-scaling update of every quantizer in one Triton launch (twin: reference.scale_update).

Also home of `compute_scale`, the device twin of `scaling.compute_scale`, which the cast
kernels use for current scaling.

Note: scale conventions (scale vs scale_inv, the amax history layout, UNRECORDED) are
those of fp8train/scaling.py.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import scaling
from . import native
from .launcher import DirectKernel, device_guard, hooks_installed

_UNRECORDED: tl.constexpr = tl.constexpr(scaling.UNRECORDED)
_SCALE_MIN: tl.constexpr = tl.constexpr(scaling.SCALE_MIN)
_SCALE_MAX: tl.constexpr = tl.constexpr(scaling.SCALE_MAX)
# float32's largest finite value: `|a| <= _FLT_MAX` is "finite" (NaN compares false). Not a
# +inf constant: Inductor copies a kernel's constexpr globals as tl.constexpr(repr(value)),
# and repr(inf) does not load (wrapper.py, torch 2.11; tests/test_launcher.py).
_FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def compute_scale(amax, prev_scale, fp8_max, margin_factor, POW2: tl.constexpr):
    """scaling.compute_scale on float32 scalars (or blocks); margin_factor = 2**-margin;
    POW2: power_of_two.

    Bit for bit: the IEEE quotient (`div_rn`, not Triton's approximate `/`), then a
    multiplication by an exact power of two, which rounds like torch's division by it; POW2
    clears the clamped scale's mantissa bits as scaling.round_down_pow2 does.
    """
    scale = tl.math.div_rn(fp8_max, amax) * margin_factor
    scale = tl.minimum(tl.maximum(scale, _SCALE_MIN), _SCALE_MAX)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    usable = (amax > 0.0) & (amax <= _FLT_MAX)  # NaN compares false: kept out too
    return tl.where(usable, scale, prev_scale)


@triton.jit
def _scale_update_kernel(
    history_ptrs,   # (Q,) int64: address of each quantizer's (H,) float32 amax history
    scale_ptrs,     # (Q,) int64: address of each quantizer's () float32 scale, updated in place
    count_ptrs,     # (Q,) int64: address of each quantizer's () int32 nonfinite count
    fp8_max_ptr,    # (Q,) float32: largest finite value of each quantizer's FP8 format
    H,              # history length, shared by all quantizers
    margin_factor,  # float32 2**-margin
    ALGO_MAX: tl.constexpr,  # True: amax = max of the history; False: most recent amax
    POW2: tl.constexpr,      # True: scales rounded down to powers of two (power_of_two_scales)
    BLOCK_H: tl.constexpr,   # power of two >= H
):
    q = tl.program_id(0)  # one program per quantizer
    history = tl.load(history_ptrs + q).to(tl.pointer_type(tl.float32), bitcast=True)
    scale_ptr = tl.load(scale_ptrs + q).to(tl.pointer_type(tl.float32), bitcast=True)
    count_ptr = tl.load(count_ptrs + q).to(tl.pointer_type(tl.int32), bitcast=True)
    fp8_max = tl.load(fp8_max_ptr + q)

    offs = tl.arange(0, BLOCK_H)
    in_h = offs < H
    h = tl.load(history + offs, mask=in_h, other=_UNRECORDED)               # (BLOCK_H,)
    older = tl.load(history + offs - 1, mask=in_h & (offs > 0), other=_UNRECORDED)  # rolled
    pending = tl.load(history)
    old_scale = tl.load(scale_ptr)
    count = tl.load(count_ptr)
    # The roll below rewrites the history in place: every thread of this program must hold
    # its loaded values before any thread stores.
    tl.debug_barrier()

    recorded = (pending >= 0.0) | (pending != pending)
    finite = tl.abs(pending) <= _FLT_MAX
    valid = recorded & finite
    if ALGO_MAX:
        # torch's max propagates NaN and compute_scale then keeps the old scale; inf does
        # the same, so NaN may count as inf here. amax_from_history's clamp_min(0) is left
        # out: when the update applies, the max is >= pending >= 0 (or -0.0, which like +0.0
        # keeps the old scale).
        amax = tl.max(tl.where(h != h, _FLT_MAX * 2.0, h), axis=0)  # NaN as +inf (the product overflows)
    else:
        amax = pending
    new_scale = compute_scale(amax, old_scale, fp8_max, margin_factor, POW2)
    tl.store(scale_ptr, tl.where(valid, new_scale, old_scale))

    # valid: [UNRECORDED, h0, .., h_{H-2}];  recorded but inf/NaN: only h0 <- UNRECORDED.
    # The predicates as (BLOCK_H,) blocks, made from int32: the triton 3.9 interpreter cannot
    # broadcast a scalar boolean.
    zeros = tl.zeros([BLOCK_H], dtype=tl.int32)
    roll = (zeros + valid.to(tl.int32)) != 0
    clear_first = (zeros + recorded.to(tl.int32)) != 0
    new_h = tl.where(offs == 0, _UNRECORDED, tl.where(roll, older, h))
    tl.store(history + offs, new_h, mask=in_h & tl.where(offs == 0, clear_first, roll))
    tl.store(count_ptr, count + (recorded & ~finite).to(tl.int32))


class ScaleUpdateLaunch:
    """One kernel launch that applies `scaling.delayed_update` to every quantizer, in place.

    Built once: the buffers' addresses go into device tables, so a call neither allocates
    nor synchronises and can be captured in a CUDA graph. The buffers must stay alive and
    in place (this object keeps references to them); rebuild when any of them changes.
    """

    def __init__(self, histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                 counts: Sequence[torch.Tensor], fp8_maxes: Sequence[float], algo: str, margin: int,
                 power_of_two: bool = False):
        n = len(histories)
        if not (n == len(scales) == len(counts) == len(fp8_maxes)) or n == 0:
            raise ValueError(f"ScaleUpdateLaunch needs as many scales, counts and fp8 maxes as histories "
                             f"(got {n}, {len(scales)}, {len(counts)}, {len(fp8_maxes)}), at least one")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"unknown amax_compute_algo {algo!r}; use 'max' or 'most_recent'")
        device = histories[0].device
        length = histories[0].numel()
        for i, (h, s, c) in enumerate(zip(histories, scales, counts)):
            _check_buffer(f"histories[{i}]", h, torch.float32, length, device)
            _check_buffer(f"scales[{i}]", s, torch.float32, 1, device)
            _check_buffer(f"counts[{i}]", c, torch.int32, 1, device)
        if length == 0:
            raise ValueError("amax histories must have at least one entry")
        for name, ts in (("histories", histories), ("scales", scales), ("counts", counts)):
            if len({t.data_ptr() for t in ts}) != n:
                raise ValueError(f"scale update: two quantizers share a buffer in {name}; each needs its own")
        for m in fp8_maxes:
            scaling.fp8_dtype_of_max(float(m))  # raises unless 448 or 57344

        self._buffers = (list(histories), list(scales), list(counts))  # keep the addresses valid
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)
        self._history_ptrs = ptrs(histories)  # (Q,) int64
        self._scale_ptrs = ptrs(scales)       # (Q,) int64
        self._count_ptrs = ptrs(counts)       # (Q,) int64
        self._fp8_max = torch.tensor([float(m) for m in fp8_maxes], dtype=torch.float32, device=device)
        self._device = device
        self._num_quantizers = n
        self._length = length
        self._margin_factor = 2.0 ** -int(margin)  # exact in float32 for |margin| <= 126
        block_h = max(32, triton.next_power_of_2(length))
        self._binary = None  # compiled kernel for these fixed arguments, from the first call
        self._native = None  # its launch from C++ (kernels/native.py), where the extension is built
        self._kernel = DirectKernel(_scale_update_kernel, num_warps=1 if block_h <= 256 else 4,
                                    ALGO_MAX=algo == "max", POW2=bool(power_of_two), BLOCK_H=block_h)

    def __call__(self) -> None:
        launch = self._native
        if launch is not None and native.ENABLED and not hooks_installed():  # the steady state, from C++
            native.extension().launch(launch, self._device.index, None, None, None, None)
            return
        args = (self._history_ptrs, self._scale_ptrs, self._count_ptrs, self._fp8_max, self._length,
                self._margin_factor)
        with device_guard(self._device):
            if self._binary is None:
                self._binary = self._kernel.binary_for(*args)
                if self._binary is not None:
                    self._native = native.fixed_launch(self._binary, self._num_quantizers, args)
            binary = self._binary
            if binary is None or hooks_installed():
                self._kernel(self._num_quantizers, *args)
                return
            # Fixed arguments: launch the kept binary directly (no per-call specialization key).
            binary.run(self._num_quantizers, 1, 1, torch._C._cuda_getCurrentRawStream(self._device.index),
                       binary.function, binary.packed_metadata, None, None, None, *args, *self._kernel.tail)


def _check_buffer(name: str, t: torch.Tensor, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    if t.dtype != dtype or t.numel() != numel or t.device != device or not t.is_contiguous():
        raise ValueError(f"scale update: {name} must be a contiguous {dtype} tensor of {numel} element(s) on "
                         f"{device}; got {t.dtype} {tuple(t.shape)} on {t.device}")

