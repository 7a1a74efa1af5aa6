"""FP8 GEMMs of a HF Llama Linear layer, per-tensor against block-scaled (GPU only).

    python benchmarks/gemm.py                       # h1024 and h2048 Llama GEMMs, table + JSON
    python benchmarks/gemm.py --shapes h4096 --json /tmp/gemm.json

For every Linear of benchmarks/hf_llama.py's shapes (8192 tokens) and each of its three GEMMs
(fprop Y = X W^T, dgrad dX = dY W, wgrad dW = dY^T X, the last with a float32 output as for
float32 master weights), the device time of:

  bf16           torch.mm
  fp8 tensor     the per-tensor scaled FP8 GEMM fp8train runs (gemm.scaled_mm: the extension's
                 cuBLASLt call; fast accumulation where GemmConfig() has it)
  block          BlockScaling's GEMM (gemm.block_scaled_mm: cuBLASLt's blockwise scaling, 1 x 128
                 x 128 x 128 in fprop and dgrad, 1 x 128 x 1 x 128 in wgrad), with its relative
                 error against the emulation (gemm.emulated_block_scaled_mm)

The sibling Linears that read one input (q/k/v, gate/up) are also timed as one GEMM each, their
weights stacked ("q+k+v", "gate+up"). One layer's seven Linears are summed both ways, separate
and stacked.

Times are medians of CUDA-graph replays (cast.py's median_ms); ratios are to fp8 tensor in the
same run. Writes JSON; never asserts on time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

try:
    import fp8train  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cast import median_ms  # noqa: E402

import triton  # noqa: E402

from fp8train import gemm  # noqa: E402
from fp8train.kernels import block_reference  # noqa: E402
from fp8train.recipe import GemmConfig  # noqa: E402
from fp8train.roles import GemmRole  # noqa: E402

FP8 = torch.float8_e4m3fn
TOKENS = 8192
# (hidden, ffn, kv width) of hf_llama.py's shapes
SHAPES = {"h1024": (1024, 2816, 256), "h2048": (2048, 5632, 512), "h4096": (4096, 14336, 1024)}


def linears(hidden: int, ffn: int, kv: int):
    """(name, in, out) of one Llama layer's distinct Linear shapes, then the sibling Linears that
    read one input (q/k/v, gate/up) as one GEMM each ("q+k+v", "gate+up": their weights stacked)."""
    return [("q/o", hidden, hidden), ("k/v", hidden, kv), ("gate/up", hidden, ffn), ("down", ffn, hidden),
            ("q+k+v", hidden, hidden + 2 * kv), ("gate+up", hidden, 2 * ffn)]


# How often each distinct shape runs in one layer: separate Linears, and with the siblings stacked
LAYER_SEPARATE = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
LAYER_STACKED = {"q/o": 1, "q+k+v": 1, "gate+up": 1, "down": 1}


def gemms(k_in: int, n_out: int):
    """(role, M, K, N, bt_block, out dtype) of a Linear's three GEMMs, as Y = A @ Bt^T."""
    return [("fprop", TOKENS, k_in, n_out, gemm.TILE, torch.bfloat16),
            ("dgrad", TOKENS, n_out, k_in, gemm.TILE, torch.bfloat16),
            ("wgrad", n_out, TOKENS, k_in, gemm.ROW, torch.float32)]


def operands(m: int, k: int, n: int, bt_block, device):
    """a (M, K), bt (N, K) block-cast (the twin: the casts' speed is not measured here), with the
    scale layouts the layers hand the GEMM (1 x 128 scales column-major; tiles row-major)."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    a, sa = block_reference.block_cast(x, FP8, gemm.ROW)
    b, sb = block_reference.block_cast(w, FP8, tuple(bt_block))
    column_major = lambda s: s.t().contiguous().t()  # noqa: E731  (strides (1, rows): no copy in the timed call)
    return x, w, a, column_major(sa), b, sb if tuple(bt_block) == gemm.TILE else column_major(sb)


def check(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of y against the emulation (float32 sums), max-norm."""
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="h1024,h2048", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--json", default="gemm.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemm.py needs a CUDA GPU")
    dev = torch.device("cuda")
    config = GemmConfig()
    roles = {"fprop": GemmRole.FPROP, "dgrad": GemmRole.DGRAD, "wgrad": GemmRole.WGRAD}
    rows = []
    print(f"{'shape':6} {'linear':8} {'gemm':6} {'M x K x N':>18} {'bf16 us':>8} {'tensor':>8} {'block':>8} "
          f"{'block/tensor':>12} {'tensor/bf16':>11} {'block err':>9}")
    for shape_name in args.shapes.split(","):
        for lname, k_in, n_out in linears(*SHAPES[shape_name]):
            for role, m, k, n, bt_block, out_dtype in gemms(k_in, n_out):
                torch.manual_seed(0)
                x, w, a, sa, b, sb = operands(m, k, n, bt_block, dev)
                ones = torch.ones((), device=dev)
                a8, b8 = x.to(FP8), w.to(FP8)
                t_bf16 = median_ms(lambda: torch.mm(x, w.t()))
                t_tensor = median_ms(lambda: gemm.scaled_mm(a8, ones, b8.t(), ones, role=roles[role], config=config,
                                                            out_dtype=out_dtype))
                block = lambda: gemm.block_scaled_mm(a, sa, b, sb, bt_block, out_dtype=out_dtype)  # noqa: E731
                t_block = median_ms(block)
                ref = gemm.emulated_block_scaled_mm(a, sa, gemm.ROW, b.t(), sb.t(), (bt_block[1], bt_block[0]),
                                                    out_dtype)
                err = check(block(), ref)
                rows.append(dict(shape=shape_name, linear=lname, gemm=role, m=m, k=k, n=n, bf16_ms=t_bf16,
                                 tensor_ms=t_tensor, block_ms=t_block, block_err=err))
                print(f"{shape_name:6} {lname:8} {role:6} {f'{m}x{k}x{n}':>18} {t_bf16 * 1e3:8.1f} {t_tensor * 1e3:8.1f} "
                      f"{t_block * 1e3:8.1f} {t_block / t_tensor:12.2f} {t_tensor / t_bf16:11.2f} {err:9.1e}",
                      flush=True)
    for shape_name in args.shapes.split(","):
        for role in ("fprop", "dgrad", "wgrad", None):
            sel = [r for r in rows if r["shape"] == shape_name and role in (None, r["gemm"])]
            for key in ("bf16_ms", "tensor_ms", "block_ms"):
                sep, stk = (sum(r[key] * count.get(r["linear"], 0) for r in sel)
                            for count in (LAYER_SEPARATE, LAYER_STACKED))
                print(f"== {shape_name} {role or 'all'} {key[:-3]}: one layer's GEMMs, separate siblings "
                      f"{sep * 1e3:.1f} us, stacked {stk * 1e3:.1f} ({stk / sep:.2f}x)")
            sel = [r for r in sel if r["linear"] in LAYER_SEPARATE]
            bf16, tensor, block = (sum(r[key] for r in sel) for key in ("bf16_ms", "tensor_ms", "block_ms"))
            print(f"== {shape_name} {role or 'all'}: one layer's distinct GEMMs bf16 {bf16 * 1e3:.1f} us, tensor "
                  f"{tensor * 1e3:.1f} ({tensor / bf16:.2f}x bf16), block {block * 1e3:.1f} ({block / tensor:.2f}x tensor)")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), torch=torch.__version__,
                triton=triton.__version__, device=torch.cuda.get_device_name())
    Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
