"""Launch a Triton kernel through its compiled binary, skipping Triton's per-call Python path.

`kernel[grid](...)` binds arguments, builds a specialization key, hashes it and looks the
binary up on every call: about 30 us of host time on the GPU machine, more than the
kernel itself for the tensors of a small layer. A DirectKernel fixes the constexprs and
launch options once, keys the compiled binary on exactly what Triton specializes on
(argument dtypes, 16-byte alignment of pointers, integers that are 1, divisible by 16 or
outside int32; floats are never specialized) plus the device, and then calls the binary's launcher itself.

The binary for a new key comes from Triton (`warmup`: it compiles or loads it). Launches go
through Triton's own path while a profiler hook is installed, under the interpreter, and
for tensors off the current CUDA device. `binary_for` lets a caller that launches the same
shapes again and again (a quantizer's prepared cast) keep the binary and skip even the key.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import struct
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import triton

from . import forms

try:  # triton >= 3.3 keeps its runtime switches in `knobs`
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton: always take Triton's path
    _knobs = None


def _hook_active(hook) -> bool:
    # triton 3.6 holds launch hooks in a HookChain (never None; empty `calls` means none);
    # a user may also assign a plain callable.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def hooks_installed() -> bool:
    """Whether a Triton launch hook (a profiler) is installed: launches must then go through Triton."""
    if _knobs is None:
        return True
    runtime = _knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _is_constexpr(annotation: Any) -> bool:
    """A parameter annotated tl.constexpr: a string under `from __future__ import annotations`,
    else the class itself."""
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return name.split(".")[-1] == "constexpr"


_I32_MIN, _I32_MAX = -2**31, 2**31 - 1


def _spec(a: Any) -> Tuple:
    """What Triton's specialization depends on for one runtime argument."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if isinstance(a, float):
        return ()  # passed as float32, never specialized
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"DirectKernel takes tensors, ints and floats as runtime arguments, got {type(a).__name__}")
    return (a == 1, a & 15 == 0, _I32_MIN <= a <= _I32_MAX)


class DirectKernel:
    """One Triton kernel with fixed constexprs and launch options, launched on a 1-D grid.

        k = DirectKernel(_flat_kernel, num_warps=8, BLOCK=4096, CAST=True, ...)
        k(grid, x, out, ..., n)   # runtime arguments in the kernel's order, nothing else

    The constexprs must be exactly the kernel's trailing `tl.constexpr` parameters.
    Runtime arguments are tensors (on the current CUDA device), ints and floats.
    """

    def __init__(self, fn, num_warps: int, cooperative: bool = False, maxnreg: Optional[int] = None, **constexprs):
        params = inspect.signature(fn.fn).parameters
        names = list(params)
        wanted = [n for n, p in params.items() if _is_constexpr(p.annotation)]
        n_runtime = len(names) - len(constexprs)
        if set(wanted) != set(constexprs) or names[n_runtime:] != wanted:
            raise ValueError(f"DirectKernel: constexprs {sorted(constexprs)} must be exactly the trailing "
                             f"constexpr parameters {wanted} of {fn.fn.__name__}")
        self._fn = fn
        self._options: Dict[str, Any] = dict(constexprs, num_warps=num_warps)
        if cooperative:  # every program resident at once (a kernel with a grid-wide barrier)
            self._options["launch_cooperative_grid"] = True
        if maxnreg is not None:  # ptxas's register cap a thread (more programs an SM, or spills)
            self._options["maxnreg"] = maxnreg
        self._n_runtime = n_runtime
        self.constexprs = dict(constexprs)
        self.tail = tuple(constexprs[name] for name in names[n_runtime:])  # appended to every launch
        self._direct = isinstance(fn, triton.runtime.jit.JITFunction)  # not under TRITON_INTERPRET
        self._binaries: Dict[Tuple, Any] = {}

    def __call__(self, grid: int, *args) -> None:
        binary = self.binary_for(*args)
        if binary is None:
            if _recording is not None:
                _recording.complete = False  # a launch the recording cannot replay
            self._fn[(grid,)](*args, **self._options)
            return
        if _recording is not None:
            _recording.launches.append((binary, grid, args))
        binary.run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(args[0].device.index), binary.function,
                   binary.packed_metadata, None, None, None, *args, *self.tail)

    def traced(self, grid: int, *args) -> None:
        """The same launch from the body of a torch.library.triton_op: through wrap_triton,
        which Inductor turns into a launch from its own generated code (eager calls it as
        Triton's `kernel[grid]`)."""
        from torch.library import wrap_triton
        if "maxnreg" in self._options:
            # torch 2.13's wrap_triton takes num_warps and num_stages as launch options of a
            # plain @triton.jit kernel, not maxnreg (it would pass it as a kernel argument)
            raise NotImplementedError(f"DirectKernel.traced: {self._fn.fn.__name__} has a register cap (maxnreg), "
                                      "which a traced launch cannot pass to Inductor")
        wrap_triton(self._fn)[(grid,)](*args, **self._options)

    def binary_for(self, *args):
        """The compiled kernel for these arguments (compiled now if new), or None where the
        launch must go through Triton: interpreter, CPU tensors, installed launch hooks, or
        tensors off the current device. Launch it with `run(grid, 1, 1, stream, function,
        packed_metadata, None, None, None, *args, *self.tail)`."""
        if len(args) != self._n_runtime:
            raise TypeError(f"DirectKernel: expected {self._n_runtime} runtime arguments, got {len(args)}")
        first = args[0]
        if not self._direct or not first.is_cuda or hooks_installed():
            return None
        device = torch.cuda.current_device()
        if first.device.index != device:
            return None  # Triton loads the binary for that device
        key = (device,) + tuple(map(_spec, args))
        binary = self._binaries.get(key)
        if binary is None:
            binary = self._fn.warmup(*args, grid=(1,), **self._options)  # compiles or loads; no launch
            if hasattr(binary, "result"):  # an async-compile future in some versions
                binary = binary.result()
            binary.run  # loads the binary onto the current device
            self._binaries[key] = binary
        return binary


class Recording:
    """What DirectKernel launched while `recording()` was active, for kernels/replay.py: each
    launch as (binary, grid, runtime args), and the scratch buffers the wrappers allocated
    for those launches through `scratch` (by address: (buffer, zeroed)). `complete` is False
    once a launch went through Triton's own path (it has no binary to replay)."""

    def __init__(self):
        self.launches: List[Tuple[Any, int, tuple]] = []
        self.scratch: Dict[int, Tuple[torch.Tensor, bool]] = {}
        self.complete = True


class LaunchOverride:
    """A kernel module's launch shapes, replaced inside a `with override.using(value)` block
    (benchmark variants, tests); `value` is None outside one; forms.KEY names the overrides in
    force (compiled models guard on it). Not thread-safe."""

    def __init__(self):
        self.value: Any = None

    @contextlib.contextmanager
    def using(self, value) -> Iterator[None]:
        saved, self.value = self.value, value
        saved_key, forms.KEY = forms.KEY, f"{forms.KEY}|{value!r}"
        try:
            yield
        finally:
            self.value, forms.KEY = saved, saved_key


_recording: Optional[Recording] = None


@contextlib.contextmanager
def recording():
    """Record the DirectKernel launches made inside the block (they still run); not
    thread-safe, like the kernels' launch-shape overrides."""
    global _recording
    saved, _recording = _recording, Recording()
    try:
        yield _recording
    finally:
        _recording = saved


def scratch(shape, device: torch.device, zeroed: bool = False) -> torch.Tensor:
    """A float32 buffer that only the launches of one wrapper call use (partial sums); while
    recording, it is noted as such, so a replay allocates its own instead of reusing it."""
    t = (torch.zeros if zeroed else torch.empty)(shape, dtype=torch.float32, device=device)
    if _recording is not None:
        _recording.scratch[t.data_ptr()] = (t, zeroed)
    return t


def kernel_params(binary, args) -> Optional[List[Tuple[str, Any]]]:
    """The parameters the compiled kernel itself takes for a launch with runtime `args` (as
    `DirectKernel` passes them), in order, as (Triton type, value) pairs: what a launcher
    outside Triton (kernels/native.py's C++ one) must pass to cuLaunchKernel. None when such
    a launch would not be the same as Triton's.

    The ABI (triton 3.6's generated launcher): arguments Triton specialised into constants
    (ints equal to 1, None) are not parameters; pointers are 8 bytes, i32/fp32 4, i64 8;
    every kernel then takes a global-scratch and a profile-scratch pointer, null when the
    binary needs no such scratch. Clusters and PDL need cuLaunchKernelEx attributes, so those
    binaries are refused, as are ones with scratch; a cooperative binary's launch must be
    cooperative too (`launch_spec` says so).
    """
    src, meta = getattr(binary, "src", None), binary.metadata
    signature = list(getattr(src, "signature", {}).values())
    if len(signature) < len(args) or any(t != "constexpr" for t in signature[len(args):]):
        return None  # not the layout described above (another Triton version)
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False):
        return None
    params = [(t, a) for t, a in zip(signature, args) if t != "constexpr"]
    if any(t not in _PARAM_BYTES and not t.startswith("*") for t, _ in params):
        return None
    for name in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(meta, name):
            if getattr(meta, name):
                return None
            params.append(("*scratch", None))
    return params


def resident_programs(binary, device: torch.device) -> int:
    """How many programs of `binary` fit on `device` at once (per-SM residency from its
    registers, threads and shared memory, times the SM count): the largest grid a cooperative
    launch of it may have."""
    props = torch.cuda.get_device_properties(device)
    warps = binary.metadata.num_warps
    regs_per_warp = -(-max(binary.n_regs, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = props.regs_per_multiprocessor // regs_per_warp // warps
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    by_shared = props.shared_memory_per_multiprocessor // (binary.metadata.shared + 1024)  # 1 KiB reserved a block
    return max(0, min(by_regs, by_threads, by_shared, 32)) * props.multi_processor_count


# Scalar parameter types a C++ launch packs, by their struct format (little-endian).
_PARAM_BYTES = {"i32": "<i", "i64": "<q", "u64": "<Q", "fp32": "<f", "i1": "<b", "u1": "<B"}


def pack_param(ty: str, value: Any) -> int:
    """A scalar parameter's bytes as the unsigned 64-bit slot a C++ launch passes (the
    driver reads the parameter's own size from the slot's low bytes)."""
    fmt = _PARAM_BYTES[ty]
    raw = struct.pack(fmt, float(value) if ty == "fp32" else int(value))
    return int.from_bytes(raw.ljust(8, b"\0"), "little")


_NO_GUARD = contextlib.nullcontext()


def device_guard(device: torch.device):
    """Make `device` current for a launch; free when it already is (the usual case)."""
    if _is_cuda(device) and device.index != torch._C._cuda_getDevice():
        return torch.cuda.device(device)
    return _NO_GUARD


@functools.lru_cache(maxsize=None)
def _is_cuda(device: torch.device) -> bool:
    # Cached: torch.device.type builds a new string on every read (a C++ ostringstream).
    return device.type == "cuda"


__all__ = ["DirectKernel", "Recording", "device_guard", "hooks_installed", "kernel_params", "pack_param", "recording",
           "resident_programs", "scratch"]
