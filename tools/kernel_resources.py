"""Registers, local memory and the SASS instruction mix of the block cast kernels, compiled for
the H200 (sm_90a) on a machine without a GPU: Triton's compiler and its bundled ptxas /
cuobjdump do not need one. Every launch-shape variant of `benchmarks/cast.py --block
--variants`, specialized as the launcher specializes (16-byte aligned pointers, sizes that
divide by 16), so the figures are the GPU's: the 2026-12-02 H200 run reported 61 / 90 / 245
registers where this reports 61 / 91 / 245 (triton 3.6; 3.9 within 3).

    python tools/kernel_resources.py [--dtype bf16|fp32] [--sass]

What it cannot say: time. A kernel with fewer registers or instructions is a candidate for
the GPU sweep, not a result.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fp8train.kernels import block_kernel, gated  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_INTS = ("M", "K", "stride_xm", "stride_sr", "stride_sc", "out_t_cols")


def compiled(fn, signature: dict, constexprs: dict, warps: int, divisible=("M", "K", "stride_xm", "out_t_cols"),
             maxnreg: int = 0):
    names = list(signature)
    aligned = [n for n, t in signature.items() if t.startswith("*")] + [n for n in divisible if n in signature]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> dict:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    field = lambda name: int(re.search(rf"{name}:(\d+)", usage).group(1))
    ops = collections.Counter(m.group(2) for m in (re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?P\d\s+)?([A-Z0-9_.]+)", line)
                                                   for line in sass.splitlines()) if m)
    return {"regs": field("REG"), "stack": field("STACK"), "shared": kernel.metadata.shared, "ops": ops}


def block_kernels(shapes: block_kernel.BlockShapes, dtype: str):
    """(name, compiled kernel) of each block cast kernel under `shapes`."""
    one = {"x_ptr": f"*{dtype}", "out_ptr": "*fp8e4nv", "sinv_ptr": "*fp32", **{n: "i32" for n in _INTS[:5]},
           "MODE": "constexpr", "FP8_MAX": "constexpr", "POW2": "constexpr", "TILE_M": "constexpr",
           "TILE_K": "constexpr"}
    for mode, name in ((0, "1x128"), (1, "128x1"), (2, "128x128")):
        tm, tk, warps = shapes.of(mode)
        yield name, compiled(block_kernel._block_cast_kernel, one, {"MODE": mode, "FP8_MAX": 448.0, "POW2": False,
                                                                   "TILE_M": tm, "TILE_K": tk}, warps)
    both = {"x_ptr": f"*{dtype}", "x1_ptr": f"*{dtype}", "x2_ptr": f"*{dtype}", "out_ptr": "*fp8e4nv",
            "out_t_ptr": "*fp8e4nv", "sinv_ptr": "*fp32", "sinv_t_ptr": "*fp32",
            **{n: "i32" for n in ("M", "K", "K1", "K2", "stride_xm", "stride_x1m", "stride_x2m", "stride_sr",
                                  "stride_sc", "out_t_cols")},
            "FP8_MAX": "constexpr", "POW2": "constexpr", "PARTS": "constexpr", "CLAMP": "constexpr",
            "GATED": "constexpr", "ACT": "constexpr", "EVEN": "constexpr", "SIDE": "constexpr", "PACK": "constexpr"}
    divisible = ("M", "K", "K1", "K2", "stride_xm", "stride_x1m", "stride_x2m", "out_t_cols")
    silu = gated._ACT_CODES["silu"]
    # whole tiles (launched unmasked where BlockShapes.even is on), then the plain cast of a
    # shape with tails (masked always); the norm's output rounded to bf16
    whole = shapes.even
    grads = [(1, 2, silu, whole, 1, "both gated grad dg"), (1, 2, silu, whole, 2, "both gated grad du")] \
        if shapes.gated_sides else [(1, 2, silu, whole, 0, "both gated grad")]
    for parts, gate, act, even, side, name in [(1, 0, 0, whole, 0, "both"), (1, 0, 0, False, 0, "both tails"),
                                               (3, 0, 0, whole, 0, "both 3 parts"), (1, 1, silu, whole, 0, "both gated"),
                                               *grads, (1, 3, 1, whole, 0, "both norm")]:
        sig = dict(both, x2_ptr="*fp32") if gate == 3 else both
        yield name, compiled(block_kernel._block_cast_both_kernel, sig,
                             {"FP8_MAX": 448.0, "POW2": False, "PARTS": parts, "CLAMP": shapes.both_clamp,
                              "GATED": gate, "ACT": act, "EVEN": even, "SIDE": side,
                              "PACK": 2 if shapes.packed_t else 0},  # the GPU's form (inline PTX)
                             shapes.both_warps(gate), divisible,
                             0 if gate else shapes.both_regs)
    weight = {"x_ptr": f"*{dtype}", "x1_ptr": f"*{dtype}", "x2_ptr": f"*{dtype}", "out_ptr": "*fp8e4nv",
              "out_t_ptr": "*fp8e4nv", "sinv_ptr": "*fp32", "sinv_t_ptr": "*fp32",
              **{n: "i32" for n in ("M", "K", "M1", "M2", "stride_xm", "out_t_cols")},
              "FP8_MAX": "constexpr", "POW2": "constexpr", "TRANSPOSE": "constexpr"}
    yield "weight", compiled(block_kernel._weight_tiles_kernel, weight,
                             {"FP8_MAX": 448.0, "POW2": False, "TRANSPOSE": True}, shapes.tiles[2])


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    """How many programs of this kernel an H100 / H200 SM holds at once: 64K registers (a
    warp's taken in 256s), 64 warps, 228 KB of shared memory (1 KB of it reserved a program)."""
    by_regs = 65536 // (-(-regs * 32 // 256) * 256 * warps)
    by_smem = (228 * 1024) // (shared + 1024)
    return min(by_regs, 64 // warps, by_smem, 32)


def _warps_and_tile(shapes: block_kernel.BlockShapes, name: str):
    """(warps, elements of the tile a program casts) of the kernel `name` under `shapes`."""
    if name.startswith("both"):
        gate = 3 if name == "both norm" else 2 if "gated grad" in name else 1 if "gated" in name else 0
        return shapes.both_warps(gate), 128 * 128
    if name == "weight":
        return shapes.tiles[2], 128 * 128
    tm, tk, warps = shapes.of({"1x128": 0, "128x1": 1, "128x128": 2}[name])
    return warps, tm * tk


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="x's dtype")
    parser.add_argument("--sass", action="store_true", help="also each kernel's memory and barrier instructions")
    args = parser.parse_args(argv)
    import dataclasses

    from cast import BLOCK_VARIANTS  # benchmarks/cast.py: the variants the GPU sweep times

    default = block_kernel.BlockShapes()
    wanted = {"rows": ("1x128",), "cols": ("128x1",), "tiles": ("128x128", "weight"), "both": ("both", "both tails", "both 3 parts"),
              "gated": ("both gated", "both gated grad", "both gated grad dg", "both gated grad du"),
              "norm": ("both norm",)}
    print(f"block cast kernels, x {args.dtype}, sm_90a, triton {triton.__version__}")
    for field, values in [(None, [None])] + BLOCK_VARIANTS:
        for value in values:
            shapes = dataclasses.replace(default, **(value if isinstance(value, dict) else {field: value})) \
                if field else default
            for name, kernel in block_kernels(shapes, args.dtype):
                if field and name not in wanted[field]:
                    continue
                r = resources(kernel)
                warps, tile = _warps_and_tile(shapes, name)
                label = f"{name} {'default' if field is None else f'{field}={value}'}"
                line = (f"  {label:<52} regs {r['regs']:>3}  stack {r['stack']:>4}  shared {r['shared']:>6}"
                        f"  programs an SM {programs_per_sm(r['regs'], warps, r['shared'])}")
                if args.sass:
                    # the kernels are straight-line code, one tile a program: static = executed
                    instr = sum(r["ops"].values())
                    mem = {o: n for o, n in r["ops"].items() if o.startswith(("LDG", "STG", "LDS", "STS", "BAR"))}
                    line += f"  instr {instr} ({instr * warps * 32 / tile:.1f} an element)  {mem}"
                print(line)


if __name__ == "__main__":
    main()
