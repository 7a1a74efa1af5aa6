"""Probe (one GPU): what the activation kernels' float32 math costs, and what a cheaper
division would change.

Builds variants of fp8train/kernels/activation.py by editing its source (written next to
it as _probe_act_<name>.py, imported, deleted at exit) and times act_fwd_fp8 and
act_bwd_fp8 (with and without dbias and amax) per variant, side by side, at M x F =
4096 x 4096 (the small MLP step's) and 8192 x 16384. For each variant it also counts the
fp8 bytes that differ from the pure-torch twin (activation_reference) on inputs spread
over [-8, 8], and their largest distance in fp8 ulps (byte order), so a faster variant's
numerics are seen beside its time.

    PYTHONPATH=. python3 tools/probe_act_math.py [--acts gelu_tanh,swiglu]
"""
import argparse
import atexit
import importlib
import os

import torch
import triton.testing

from fp8train.kernels import activation_reference as ref

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fp8train", "kernels")
SOURCE = open(os.path.join(HERE, "activation.py")).read()
# name -> [(old, new)] source edits
VARIANTS = {
    "base": [],
    # div.full.f32 (approximate, <= 2 ulp) instead of IEEE div.rn for the sigmoid's reciprocal
    "approx_div": [("tl.math.div_rn(1.0, 1.0 + e)", "1.0 / (1.0 + e)"),
                   ("tl.math.div_rn(1.0, 1.0 + 0.5 * tl.abs(x * _SQRT1_2))", "1.0 / (1.0 + 0.5 * tl.abs(x * _SQRT1_2))")],
}


def load(name, edits):
    src = SOURCE
    for old, new in edits:
        assert old in src, (name, old)
        src = src.replace(old, new)
    path = os.path.join(HERE, f"_probe_act_{name}.py")
    with open(path, "w") as fh:
        fh.write(src)
    atexit.register(os.remove, path)
    return importlib.import_module(f"fp8train.kernels._probe_act_{name}")


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def fp8_distance(a, b):
    """elementwise distance in fp8 values (signed byte order), NaN bytes excluded."""
    def ordered(t):
        i = t.view(torch.uint8).to(torch.int32)
        return torch.where(i >= 128, 128 - i, i)
    ok = ~(a.float().isnan() | b.float().isnan())
    return (ordered(a) - ordered(b)).abs()[ok]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--acts", default="gelu_tanh,swiglu,relu")
    p.add_argument("--sizes", default="4096x4096,8192x16384")
    args = p.parse_args()
    mods = {name: load(name, edits) for name, edits in VARIANTS.items()}
    fp8, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    print(f"{'act':<10} {'M x F':<12} {'variant':<11} {'fwd':>8} {'bwd+db':>8} {'bwd':>8} {'bwd noamax':>10}"
          f" {'fwd diff':>10} {'bwd diff':>10} {'max':>4} {'dbias rel':>10}")
    for act in args.acts.split(","):
        for size in args.sizes.split(","):
            m, f = (int(v) for v in size.split("x"))
            fh = 2 * f if act == "swiglu" else f
            torch.manual_seed(0)
            h = (torch.rand(m, fh, device="cuda") * 16 - 8).bfloat16()
            da = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
            scale = torch.tensor(16.0, device="cuda")
            sinv, amax = torch.empty((), device="cuda"), torch.zeros((), device="cuda")
            # the twin, once per size (float32 on the GPU)
            ref_fwd = torch.empty(m, f, device="cuda", dtype=fp8)
            ref.act_fwd_fp8(h, act, ref_fwd, None, scale, sinv)
            ref_bwd = torch.empty(m, fh, device="cuda", dtype=e5)
            ref_db = torch.empty(fh, device="cuda", dtype=torch.float32)
            ref.act_bwd_fp8(da, h, act, ref_bwd, None, scale, sinv, dbias_out=ref_db)
            for name, mod in mods.items():
                out_f = torch.empty(m, f, device="cuda", dtype=fp8)
                out_b = torch.empty(m, fh, device="cuda", dtype=e5)
                db = torch.empty(fh, device="cuda", dtype=torch.float32)
                t_fwd = ms(lambda: mod.act_fwd_fp8(h, act, out_f, None, scale, sinv, amax))
                t_bwd_db = ms(lambda: mod.act_bwd_fp8(da, h, act, out_b, None, scale, sinv, amax, dbias_out=db))
                t_bwd = ms(lambda: mod.act_bwd_fp8(da, h, act, out_b, None, scale, sinv, amax))
                t_bwd_na = ms(lambda: mod.act_bwd_fp8(da, h, act, out_b, None, scale, sinv))
                mod.act_fwd_fp8(h, act, out_f, None, scale, sinv)
                mod.act_bwd_fp8(da, h, act, out_b, None, scale, sinv, dbias_out=db)
                df, dbw = fp8_distance(out_f, ref_fwd), fp8_distance(out_b, ref_bwd)
                rel = ((db - ref_db).abs().max() / ref_db.abs().max()).item()
                print(f"{act:<10} {size:<12} {name:<11} {t_fwd:>8.4f} {t_bwd_db:>8.4f} {t_bwd:>8.4f} {t_bwd_na:>10.4f}"
                      f" {int((df > 0).sum()):>10} {int((dbw > 0).sum()):>10}"
                      f" {int(max(df.max(), dbw.max())):>4} {rel:>10.2e}")


if __name__ == "__main__":
    main()
