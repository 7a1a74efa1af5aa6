"""Replay a recorded group of kernel launches from C++ with a new call's tensors.

The fused modules' memory-bound steps are short sequences of DirectKernel launches (the norm
kernel and the byte transpose of its output; the activation kernel, its transpose and the
bias-gradient column sums; ...). Through Python each launch costs tens of microseconds of
host time in argument checks, launch planning and Triton's launcher. A sequence that runs
again and again on same-shaped tensors is recorded once (`launcher.recording`) while it runs
through Python, and `build` turns it into a C++ launch group (csrc/linear_node.cpp `Group`):
later calls pass their own tensors and the group launches the same binaries with the same
grids and scalars, from one Python call.

Every pointer argument of a recorded launch must be one of three things, or `build` gives up
(None) rather than bake a per-call address into the group:
  a hole     one of the call's tensors (`holes`, matched by address; a view of one, such as
             the byte view the transpose kernel takes, has its address too);
  scratch    a buffer a wrapper allocated for its own launches through `launcher.scratch`:
             the group allocates its own per call, zeroed where the recorded one was;
  fixed      an address inside one of `fixed` (a quantizer's scale, amax history, counters):
             the group keeps those tensors alive, and whoever keeps the group must drop it
             when they are replaced (quantizers drop their preparations on `_apply` and loads).
A launch that went through Triton's own path (a profiler hook, the interpreter) leaves the
recording incomplete, and then nothing is built either.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import native


def run(cache: dict, key: Hashable, holes: Sequence[Optional[torch.Tensor]], fixed: Optional[Sequence[torch.Tensor]],
        python: Callable[[], None]) -> Optional["Group"]:
    """Run a wrapper sequence: from its launch group in `cache[key]` when there is one, else
    through `python()` (which launches it with the tensors in `holes`), recording the first
    eligible call and building the group from it (False in the cache: it cannot be built).

    `key` must determine every launch: shapes, dtypes, flags, the device. `fixed` None means
    this call must take Python (e.g. a quantizer whose next cast is not a single launch).
    Python also runs on the CPU, with launch hooks installed (a profiler), with the C++ node
    switched off (native.ENABLED), and inside another recording.

    Returns the group that ran or was built from this call (the C++ LayerNormMLP node
    collects them), or None."""
    first = holes[0]
    if fixed is None or _python_only(first):
        python()
        return None
    from . import launcher
    # The binaries were specialised on which pointers are 16-byte aligned: a call that differs
    # (a misaligned view as input) gets its own recording.
    aligned = tuple(t is not None and t.data_ptr() & 15 == 0 for t in holes)
    key = (key, aligned, _overrides())
    group = cache.get(key)
    if group:
        group(*holes)
        return group
    if group is False:
        python()
        return None
    with launcher.recording() as rec:
        python()
    group = cache[key] = build(rec, holes, fixed) or False
    return group or None


def _python_only(first: torch.Tensor) -> bool:
    """Whether a call on `first`'s device must take Python (run's docstring says when)."""
    if not first.is_cuda or not native.ENABLED:
        return True
    from . import launcher  # triton: CUDA paths only
    return (launcher._recording is not None or first.device.index != torch._C._cuda_getDevice()
            or launcher.hooks_installed())


class Group:
    """A built launch group: `group(*tensors)` launches it with the call's tensors in the
    order of `build`'s holes (None where the recorded call had None)."""

    def __init__(self, group, holes: int, device: int):
        self._group = group
        self.holes = holes
        self.device = device

    def __call__(self, *tensors: Optional[torch.Tensor]) -> None:
        native.extension().run_group(self._group, list(tensors))


def _overrides() -> tuple:
    """The kernels' launch-shape overrides in force (benchmarks, tests): part of every key."""
    from . import activation, norm
    return activation._override.value, norm._override.value


class GroupSpec(NamedTuple):
    """A launch group as data (`plan`): per launch (binary, grid, values, hole indices), the
    pointer table's size and scratch buffers, and the fixed tensors to keep alive."""

    device: Optional[int]
    holes: int
    launches: List[Tuple[Any, int, List[int], List[int]]]
    scratch_shapes: List[List[int]]
    scratch_zeroed: List[bool]
    aligned: List[bool]
    keep: List[torch.Tensor]


class Slots:
    """Where each pointer of a recording goes (the module docstring's three kinds): `place`
    gives a call tensor's slot (its index in `holes`), a scratch buffer's slot (after the
    call tensors, in order of first use), -1 for an address inside one of `fixed` (kept in
    `keep`), or None where it is none of these. `ok` is False when two call tensors share an
    address (a recorded pointer would be ambiguous)."""

    def __init__(self, rec, holes: Sequence[Optional[torch.Tensor]], fixed: Sequence[torch.Tensor]):
        self.holes = len(holes)
        self.ok = True
        self._slot_of = {}  # address -> slot of a call tensor
        for i, t in enumerate(holes):
            if t is None or t.numel() == 0:
                continue
            if t.data_ptr() in self._slot_of:
                self.ok = False
            self._slot_of[t.data_ptr()] = i
        self._ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t) for t in fixed]
        self._scratch = rec.scratch
        self._scratch_slot: dict = {}
        self.scratch_shapes: List[List[int]] = []
        self.scratch_zeroed: List[bool] = []
        self._keep: dict = {}
        self.devices: set = set()

    @property
    def keep(self) -> List[torch.Tensor]:
        return list(self._keep.values())

    def place(self, value: torch.Tensor) -> Optional[int]:
        self.devices.add(value.device.index)
        ptr = value.data_ptr()
        if ptr in self._slot_of:
            return self._slot_of[ptr]
        if ptr in self._scratch:
            if ptr not in self._scratch_slot:
                buf, zeroed = self._scratch[ptr]
                self._scratch_slot[ptr] = self.holes + len(self.scratch_shapes)
                self.scratch_shapes.append(list(buf.shape))
                self.scratch_zeroed.append(zeroed)
            return self._scratch_slot[ptr]
        owner = next((t for lo, hi, t in self._ranges if lo <= ptr < hi), None)
        if owner is None:
            return None  # neither the call's nor a known fixed buffer: never bake it in
        self._keep[id(owner)] = owner
        return -1


def plan(rec, holes: Sequence[Optional[torch.Tensor]], fixed: Sequence[torch.Tensor]) -> Optional[GroupSpec]:
    """The launch group of everything `rec` (a launcher.Recording) holds, as data, or None
    where none can be made: see the module docstring; also nothing recorded, launches on
    more than one device, a binary the C++ launcher cannot launch (launcher.kernel_params)."""
    from .launcher import kernel_params, pack_param
    if not rec.complete or not rec.launches:
        return None
    slots = Slots(rec, holes, fixed)
    if not slots.ok:
        return None
    launches = []
    for binary, grid, args in rec.launches:
        params = kernel_params(binary, args)
        if params is None:
            return None
        values, hole_of = [], []
        for ty, value in params:
            slot = -1
            if value is None:  # a scratch pointer the binary does not use
                values.append(0)
            elif ty.startswith("*"):
                slot = slots.place(value)
                if slot is None:
                    return None
                values.append(0 if slot >= 0 else value.data_ptr())
            else:
                values.append(pack_param(ty, value))
            hole_of.append(slot)
        launches.append((binary, grid, values, hole_of))
    if len(slots.devices) != 1:
        return None
    aligned = [t is not None and t.numel() > 0 and t.data_ptr() % 16 == 0 for t in holes]
    return GroupSpec(slots.devices.pop(), len(holes), launches, slots.scratch_shapes, slots.scratch_zeroed, aligned,
                     slots.keep)


def build(rec, holes: Sequence[Optional[torch.Tensor]], fixed: Sequence[torch.Tensor]) -> Optional[Group]:
    """The C++ launch group of `plan(rec, holes, fixed)` (None where there is none, or no
    extension)."""
    spec = plan(rec, holes, fixed)
    ext = native.extension() if spec is not None and spec.device is not None else None
    if ext is None:
        return None
    launches = [ext.Launch(binary.function, grid, 32 * binary.metadata.num_warps, binary.metadata.shared, values,
                           hole_of, bool(getattr(binary.metadata, "launch_cooperative_grid", False)))
                for binary, grid, values, hole_of in spec.launches]
    group = ext.Group(spec.device, spec.holes, launches, spec.scratch_shapes, spec.scratch_zeroed, spec.aligned,
                      spec.keep)
    return Group(group, spec.holes, spec.device)


__all__ = ["Group", "GroupSpec", "Slots", "build", "plan", "run"]
