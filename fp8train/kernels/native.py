"""The C++ side of the eager hot path: fp8train/csrc/ (linear_node.cpp, lt_gemm.cpp, high_mlp.cpp), built
on first use.

It holds the Linear layer's autograd node in C++ (forward and backward with no Python
between the launches), the high-precision path of LayerNormMLP and LayerNormLinear as one node
(high_mlp.cpp: the torch composition's ATen ops, one call forward and one node backward, for
the layers auto precision keeps out of FP8) and a launcher for Triton binaries that Python compiled and loaded:
a `CastPlan` is one quantizer's cast of one input shape, made from the quantizer's prepared
launches (kernels.cast.PreparedCast.native_launch). The Python path stays the reference
and the fallback: on the CPU, under the interpreter or torch.compile, with launch hooks,
and wherever the extension could not be built (one warning says why).

`ENABLED = False` turns the C++ node off for the process (an A/B switch for benchmarks and
tests; tools/run_with_flags.py sets it from the command line). `GEMM_OP = False` makes code
traced from then on call torch._scaled_mm instead of the extension's GEMM operator (an A/B
switch: benchmarks/hf_llama.py's "aten-mm" variant; Dynamo guards on it). `BLOCK_GEMM` sends
BlockScaling's CUDA GEMMs, eager and traced, through the extension's `block_scaled_mm`
(cuBLASLt's block scale modes, the algorithm cached) instead of torch.nn.functional.scaled_mm
(on; off is an A/B switch: benchmarks/hf_llama.py's "torch-gemm" variants; the GPU test,
tests/gpu/test_block_scaling_gpu.py, runs every case both ways). BlockScaling's Linears take
the same C++ node (block cast plans, block GEMMs; tests/gpu/test_block_native_gpu.py).

The extension's FP8 GEMM (`scaled_mm`, lt_gemm.cpp: cuBLASLt with the algorithm cached per
problem, torch._scaled_mm's bytes at a fraction of its host time) serves the C++ nodes and
gemm.scaled_mm alike, so the Python path and the nodes run the same kernels whether or not
the node is on. `set_lt_gemm(False)` sends every one of those calls to at::_scaled_mm.

BlockScaling's GEMMs can be tuned (opt-in, `set_block_gemm_tuning(True)`; at h1024 it
saves ~0.14 ms of a step's device time, docs/benchmarks.md): then the first call of a
problem for which cuBLASLt's heuristic offers several algorithms (on the H200, the wgrads)
times them on its own operands and keeps the fastest for the process where it takes under
0.9x the heuristic's first answer's time (`block_gemm_tunings()` lists the problems). Off,
every call runs the first answer, torch's kernel and bytes. Algorithms sum in different
orders, so a tuned GEMM's bytes may differ from torch's and, where two answers time within
noise of the margin, between processes. That is why it stays off by default: the block and
GEMM GPU tests pass with it on (fifty-ninth session), but a default run gives torch's
bytes, the same in every process.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import sys
import time
import warnings
from typing import List, NamedTuple, Optional, Sequence

import torch

from ..tensor import padded_rows

ENABLED = True
GEMM_OP = True
BLOCK_GEMM = True

_CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [str(_CSRC / "linear_node.cpp"), str(_CSRC / "lt_gemm.cpp"), str(_CSRC / "high_mlp.cpp")]
NAME = "fp8train_linear_node"
# -O1: the node's own code is a few loops around ATen and driver calls; -O2 only lengthens the
# build (30 s against 23 s on a 2-core machine).
CFLAGS = ["-O1"]
# -l:libstdc++.so.6: the process's C++ runtime, by name. Where the compiler finds no
# libstdc++.so to link (the GPU machine's image: only libstdc++.a beside its g++ 13), g++ links
# the static archive into the extension, and that private copy's locale is never set up: the
# first number streamed into a message (every TORCH_CHECK with a value) ended the process with
# a segmentation fault instead of raising (docs/design.md, "The extension's errors").
LDFLAGS = ["-ldl", "-l:libstdc++.so.6"] if sys.platform.startswith("linux") else ["-ldl"]
_ext = None
_failure: Optional[str] = None

# Activation dtypes by the code linear_forward takes.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def extension():
    """The compiled extension, or None where it cannot be built (the first call builds it,
    tens of seconds once per machine and torch version; torch caches the build)."""
    global _ext, _failure
    if _ext is not None or _failure is not None:
        return _ext
    try:
        from torch.utils.cpp_extension import load
        _find_ninja()
        start, building = time.perf_counter(), _needs_build()
        if building:  # tens of seconds with nothing on the screen otherwise
            print("fp8train: building the C++ extension (once per machine and torch version)...", end=" ",
                  file=sys.stderr, flush=True)
        _ext = load(name=NAME, sources=SOURCES, extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)
        _register_gemm_fake()
        if building:
            print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    except Exception as e:  # no compiler, no ninja, headers that differ: the Python node runs
        lines = str(e).strip().splitlines()
        errors = [line.strip() for line in lines if "error" in line.lower()]
        _failure = f"{type(e).__name__}: {(errors or lines or [''])[0][:300]}"
        warnings.warn(f"fp8train: the C++ Linear node could not be built ({_failure}); FP8 Linear layers use "
                      "the Python autograd node (more host time per call)", stacklevel=2)
    return _ext


def _register_gemm_fake() -> None:
    """The shape functions of the extension's GEMM operators (lt_gemm.cpp), for tracing."""
    @torch.library.register_fake("fp8train_lt::scaled_mm")
    def _(a, a_scale_inv, b, b_scale_inv, fast_accum, out_dtype, bias):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)  # (M, N) row-major

    @torch.library.register_fake("fp8train_lt::block_scaled_mm")
    def _(a, a_scale, b, b_scale, b_tiles, out_dtype, bias):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)  # (M, N) row-major


def gemm_op_loaded() -> bool:
    """Whether torch.ops.fp8train_lt.scaled_mm exists: the extension is loaded (layers load
    it when they make their quantizers, before any trace). Traced code calls it for CUDA
    GEMMs (gemm.py) unless GEMM_OP is off; Dynamo reads this as a constant of the trace."""
    return GEMM_OP and _ext is not None


def _needs_build() -> bool:
    """Whether load() will compile: no built library yet, or a source newer than it (torch's
    own check also hashes flags and versions; this one only decides whether to say so)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        built = pathlib.Path(_get_build_directory(NAME, verbose=False)) / f"{NAME}.so"
        return not built.exists() or any(pathlib.Path(s).stat().st_mtime > built.stat().st_mtime for s in SOURCES)
    except Exception:  # a private torch helper: if it moves, say nothing
        return False


def hooks_installed() -> bool:
    """launcher.hooks_installed, imported on first use (triton is not needed to import fp8train)."""
    global _hooks_installed
    if _hooks_installed is None:
        from .launcher import hooks_installed as _hooks_installed
    return _hooks_installed()


_hooks_installed = None


def _find_ninja() -> None:
    """torch's build runs `ninja` from PATH; the pip package's binary (the dev extra) is not on
    PATH when the venv's python runs without the venv activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def failure() -> Optional[str]:
    """Why the extension could not be built (None: built, or not tried yet)."""
    return _failure


def launch_spec(binary, grid: int, args: Sequence, holes: Sequence = ()) -> Optional[tuple]:
    """((function, grid, block, shared, values, hole indices, cooperative), fixed tensors) of a launch of
    `binary` on `grid` programs with runtime `args` (DirectKernel's), for `Launch`; None where
    the C++ launcher cannot make it (launcher.kernel_params). An argument that *is* one of
    `holes` becomes a hole with that index (filled per call); other tensors are fixed
    pointers, kept alive by whoever keeps the tensors returned with the spec."""
    from .launcher import kernel_params, pack_param
    params = kernel_params(binary, args)
    if params is None:
        return None
    index = {id(h): i for i, h in enumerate(holes)}
    values, hole_of, fixed = [], [], []
    for ty, value in params:
        hole = index.get(id(value), -1)
        hole_of.append(hole)
        if hole >= 0 or value is None:
            values.append(0)
        elif ty.startswith("*"):
            values.append(value.data_ptr())
            fixed.append(value)
        else:
            values.append(pack_param(ty, value))
    meta = binary.metadata
    cooperative = bool(getattr(meta, "launch_cooperative_grid", False))
    return (binary.function, grid, 32 * meta.num_warps, meta.shared, values, hole_of, cooperative), fixed


def launch_for(prepared):
    """A C++ Launch of a PreparedCast's launch (holes: the call's x, data, data_t, scale_inv),
    or None where it has none or the extension is missing."""
    spec = prepared.native_launch()
    ext = extension() if spec is not None else None
    return None if ext is None else ext.Launch(*spec[0])


def fixed_launch(binary, grid: int, args: Sequence):
    """A C++ Launch of `binary` with every argument fixed (the caller keeps the tensors in
    `args` alive), or None (see launch_spec; or no extension)."""
    ext = extension()
    spec = launch_spec(binary, grid, args) if ext is not None else None
    return None if spec is None else ext.Launch(*spec[0])


def cast_plan(launches: Sequence, device: int, x_dtype: torch.dtype, fp8_dtype: torch.dtype, shape, transpose: bool,
              partial: Optional[torch.Tensor] = None, dbias_dtype: torch.dtype = torch.float32):
    """A C++ CastPlan running `launches` (PreparedCasts, in order) on an input of 2-D `shape`
    and `x_dtype` (the plan refuses any other); None where a
    launch is not one the C++ launcher can make or the extension is missing. partial: the
    (row tiles, N) float32 dbias buffer of the last launch; the plan returns its column sums
    as dbias, in dbias_dtype, by the colsum launch kernels.PreparedCast makes (the same sums,
    rounded once into dbias_dtype)."""
    ext = extension()
    if ext is None:
        return None
    dbias_sum = None
    if partial is not None:  # the partial sums' colsum launch, into each call's dbias
        from .colsum import native_spec
        spec = native_spec(partial, dbias_dtype)
        if spec is None:
            return None
        dbias_sum = ext.Launch(*spec[0])
    made, keep = [], []
    for prepared in launches:
        spec = prepared.native_launch()
        if spec is None:
            return None
        made.append(ext.Launch(*spec[0]))
        keep.extend(spec[1])
    m, n = shape
    data_t_shape = [n, padded_rows(m)] if transpose else []
    if x_dtype not in DTYPE_CODES or dbias_dtype not in DTYPE_CODES:
        return None
    return ext.CastPlan(device, DTYPE_CODES[x_dtype], fp8_dtype == torch.float8_e5m2, [m, n], data_t_shape,
                        made, partial, dbias_sum, DTYPE_CODES[dbias_dtype], keep)


def gemm():
    """The extension, for an FP8 GEMM on the GPU (its `scaled_mm`), or None: traced code
    (which calls the same GEMM as an operator: gemm_op_loaded), or no extension."""
    if torch.compiler.is_compiling():
        return None
    return _ext if _ext is not None else extension()


def set_lt_gemm(enabled: bool) -> None:
    """The extension's GEMMs through cuBLASLt (True, the default) or at::_scaled_mm (an A/B
    switch; a no-op without the extension)."""
    ext = extension()
    if ext is not None:
        ext.set_lt_gemm(bool(enabled))


def set_block_gemm_tuning(enabled: bool) -> None:
    """Whether block_scaled_mm's calls from now on run each problem's tuned algorithm (True:
    a problem's first such call times the heuristic's answers) or the heuristic's first
    answer, torch's (False, the default; a no-op without the extension)."""
    ext = extension()
    if ext is not None:
        ext.set_block_gemm_tuning(bool(enabled))


class BlockGemmTuning(NamedTuple):
    """One tuned block GEMM problem: a (M, K) @ b (K, N); the answers timed, the pick's index
    among them (0: the heuristic's first), and the fastest run of the first and of the pick."""
    m: int
    n: int
    k: int
    answers: int
    pick: int
    first_us: float
    pick_us: float


def block_gemm_tunings() -> List[BlockGemmTuning]:
    """The block GEMM problems tuned so far in this process (none without the extension)."""
    ext = extension()
    return [] if ext is None else [BlockGemmTuning(*t) for t in ext.block_gemm_tunings()]


__all__ = ["DTYPE_CODES", "ENABLED", "GEMM_OP", "SOURCES", "BlockGemmTuning", "block_gemm_tunings", "gemm",
           "gemm_op_loaded", "set_block_gemm_tuning", "set_lt_gemm", "cast_plan", "fixed_launch", "launch_for",
           "launch_spec", "extension", "failure", "hooks_installed"]
