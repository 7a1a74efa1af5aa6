"""Host (Python) overhead of one FP8 Linear fwd+bwd, measured on the CPU.

CPU only: the FP8 GEMM is torch._scaled_mm's CPU path and the casts run the pure-torch
twins (kernels/reference.py), so absolute times are not the GPU's. With a 64 x 64 layer on
16 tokens every op is tiny and what is left is Python: use it to find and remove our own
overhead. With --stub-kernels the casts, scale updates and FP8 GEMMs do no work (outputs
are left uninitialised): what is left is our Python, the allocations and autograd, as on a
GPU where launches are asynchronous. Prints us per iteration (median of rounds) for nn.Linear and fp8train.Linear under
DelayedScaling and CurrentScaling (autocast entered per iteration, as a training step
does), then cProfile's top functions by tottime restricted to fp8train code, and the
tottime per iteration of fp8train code with and without the CPU-only twins.

    PYTHONPATH=. python tools/host_profile_cpu.py [--stub-kernels] [--json out.json]
"""
import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import fp8train

IN, OUT, TOKENS = 64, 64, 16
WARMUP, ITERS, ROUNDS = 50, 300, 7
PROFILE_ITERS = 500
# fp8train code that also runs on the GPU machine (pstats takes a regex over "file:line(function)").
_OWN_HOST_CODE = r"/fp8train/(?!kernels/(\w+_)?reference\.py|kernels/__init__\.py|scaling\.py)"


def make_step(kind: str):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, IN, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, OUT, dtype=torch.bfloat16)
    if kind == "nn.Linear":
        layer = torch.nn.Linear(IN, OUT, dtype=torch.bfloat16)

        def step():
            layer(x).backward(dy)
        return step
    layer = fp8train.Linear(IN, OUT, params_dtype=torch.bfloat16)
    recipe = fp8train.DelayedScaling() if kind == "fp8 delayed" else fp8train.CurrentScaling()

    def step():
        with fp8train.autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)
    return step


def stub_kernels() -> None:
    """Make the CPU twins and torch._scaled_mm no-ops (timing only: results are garbage)."""
    from fp8train.kernels import reference

    for name in ("amax", "cast_amax", "cast_transpose_amax", "scale_update"):
        setattr(reference, name, lambda *args, **kwargs: None)

    def scaled_mm(a, b, *, out_dtype, out=None, **kwargs):
        return out if out is not None else torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)
    torch._scaled_mm = scaled_mm


def time_step(step) -> float:
    """Median over ROUNDS of the mean us per iteration."""
    for _ in range(WARMUP):
        step()
    rounds = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(ITERS):
            step()
        rounds.append((time.perf_counter() - t) / ITERS * 1e6)
    return statistics.median(rounds)


def _cpu_only(path: str) -> bool:
    """Code that runs only on the CPU: the kernels' pure-torch twins, the scale math they
    call and the CPU dispatch in kernels/__init__.py (on the GPU, prepared Triton launches
    from kernels/cast.py and friends do this work)."""
    return path.endswith(("/reference.py", "_reference.py", "/fp8train/scaling.py", "/fp8train/kernels/__init__.py"))


def own_tottime(step):
    """(stats, us/iter of fp8train tottime, us/iter of it outside the CPU-only code)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PROFILE_ITERS):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    own = twins = 0.0
    for (path, _, _), (_, _, tt, _, _) in stats.stats.items():
        if "/fp8train/" in path:
            own += tt
            if _cpu_only(path):
                twins += tt
    per = 1e6 / PROFILE_ITERS
    return stats, own * per, (own - twins) * per


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the table here")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--stub-kernels", action="store_true", help="time our host code alone (see above)")
    args = parser.parse_args()
    if args.stub_kernels:
        stub_kernels()
    torch.set_num_threads(1)  # tiny ops: threads only add noise

    kinds = ("nn.Linear", "fp8 delayed", "fp8 current")
    rows = {}
    for kind in kinds:
        step = make_step(kind)
        rows[kind] = {"us_per_iter": time_step(step)}
        if kind != "nn.Linear":
            stats, own, own_no_twins = own_tottime(step)
            rows[kind].update(fp8train_tottime_us=own, fp8train_tottime_no_twins_us=own_no_twins)
            print(f"\n== cProfile, {kind} (CPU), {PROFILE_ITERS} iterations: top {args.top} fp8train "
                  "functions by tottime (CPU twins left out)")
            stats.sort_stats("tottime").print_stats(_OWN_HOST_CODE, args.top)

    base = rows["nn.Linear"]["us_per_iter"]
    stubbed = ", kernels stubbed" if args.stub_kernels else ""
    print(f"\nCPU host time per fwd+bwd{stubbed}, Linear({IN}, {OUT}) on ({TOKENS}, {IN}) bf16, torch {torch.__version__}")
    print(f"{'':14}{'us/iter':>10}{'x nn.Linear':>13}{'fp8train tottime':>18}{'  (no CPU-only)':>17}")
    for kind in kinds:
        r = rows[kind]
        own = f"{r['fp8train_tottime_us']:18.1f}{r['fp8train_tottime_no_twins_us']:17.1f}" \
            if "fp8train_tottime_us" in r else ""
        print(f"{kind:14}{r['us_per_iter']:10.1f}{r['us_per_iter'] / base:13.2f}{own}")
    print("(CPU: casts are the pure-torch twins and _scaled_mm is emulated; not GPU numbers. "
          "tottime is under cProfile, which inflates small Python functions.)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
