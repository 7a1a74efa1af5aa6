"""Probe (delete once answered): does the two-way block cast gain from more programs an SM?

Compiled for sm_90a on the CPU (2026-12-07): the default (4 warps) takes 251 registers, so 2
programs an SM; capped at 168 (Triton's `maxnreg`), 3 programs, with 104 bytes of spills; at 8
warps it takes 166 (1 program), capped at 128 it takes 128 with no spills (2 programs, 16
warps an SM). Each form is checked bit for bit against the default and timed by CUDA-graph
replay (benchmarks/cast.py's median_ms) at HF Llama h2048's and h1024's sizes.

If a cap wins, note that Inductor drops `maxnreg` from user-defined kernels' configs
(config_to_dict in torch/_inductor/runtime/triton_heuristics.py keeps num_warps and
num_stages), so the compiled path needs the register count reached without the cap.

    python tools/probe_maxnreg.py    # on the GPU machine
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from cast import Buffers, median_ms  # noqa: E402
from fp8train.kernels import block_kernel  # noqa: E402
from fp8train.kernels.launcher import DirectKernel  # noqa: E402

FORMS = [(4, None), (4, 168), (8, None), (8, 128), (16, None), (2, None)]  # (warps, register cap)
SIZES = [(8192, 2048, torch.float32), (8192, 5632, torch.bfloat16), (8192, 2048, torch.bfloat16),
         (8192, 1024, torch.float32), (8192, 512, torch.bfloat16), (8192, 1024, torch.bfloat16)]


def outputs(b: Buffers) -> tuple:
    return (b.out.view(torch.uint8).clone(), b.out_t_blocks.view(torch.uint8).clone(), b.sinv_rows.clone(),
            b.sinv_cols.clone())


def main() -> None:
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    for rows, cols, dtype in SIZES:
        b = Buffers(rows, cols, dtype)
        grid = triton.cdiv(rows, 128) * triton.cdiv(cols, 128)
        args = (b.x, b.x, b.x, b.out, b.out_t_blocks, b.sinv_rows, b.sinv_cols, rows, cols, cols, cols, cols, cols,
                cols, *b.sinv_rows.stride(), b.out_t_blocks.shape[1])
        first = None
        line = f"{str(dtype)[6:]:>8} {rows} x {cols}:"
        for warps, cap in FORMS:
            kernel = DirectKernel(block_kernel._block_cast_both_kernel, num_warps=warps, FP8_MAX=448.0, POW2=False,
                                  PARTS=1)
            if cap:
                kernel._options["maxnreg"] = cap
            b.out.zero_()
            b.out_t_blocks.zero_()
            kernel(grid, *args)
            torch.cuda.synchronize()
            got = outputs(b)
            first = first or got
            same = all(torch.equal(a, c) for a, c in zip(first, got))
            binary = kernel.binary_for(*args)
            us = median_ms(lambda: kernel(grid, *args)) * 1e3
            line += f"  ({warps}, {cap}) {us:6.1f} us r{binary.n_regs} s{binary.n_spills}{'' if same else ' DIFF'}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
