"""Every entry point of the C++ extension, called with bad arguments; run as a script (in its
own process) by tests/test_extension_errors.py: `python extension_error_cases.py DEVICE`.

Each case prints "START name" first, then "RAISED name<TAB><type>: <first line>" when the call
raised as it must, or "RETURNED name" when it did not. A case that ends the process (the
segmentation faults this file was written for) leaves its START line last. Messages that
carry a number go through the ostream formatting that crashed on the GPU machine's builds.
"""
import sys

import torch

from fp8train.kernels import native


def cases(ext, dev):
    """name -> a call that must raise. `dev`: where the tensors live (cpu or cuda)."""
    bf16 = torch.bfloat16
    dev_index = torch.device(dev).index or 0
    launch = ext.Launch(0, 1, 128, 0, [0, 0], [0, -1])
    plan = ext.CastPlan(dev_index, 1, False, [2, 16], [], [], None, None, 0, [])
    group = ext.Group(dev_index, 2, [], [], [], [True, True], [])
    fwd_groups = (ext.Group(dev_index, 9, [], [], [], [False] * 9, []), ext.Group(dev_index, 4, [], [], [], [False] * 4, []))
    mlp_plan = ext.MlpPlan(dev_index, [4, 16, 16, 16, 16], True, False, [False] * 7, [1, 4, 4, 5, 0],
                           [True, False, False], *fwd_groups, None, None, None)
    tile_plan = ext.CastPlan(dev_index, 1, False, [16, 16], [], [launch], None, None, 0, [], True, False, True)
    tile_plan_t = ext.CastPlan(dev_index, 1, False, [16, 16], [16, 16], [launch], None, None, 0, [], True, False,
                               True)
    x = torch.zeros(3, 16, dtype=bf16, device=dev)
    w = torch.zeros(16, 16, dtype=bf16, device=dev)
    w8 = torch.zeros(16, 16, dtype=torch.float8_e4m3fn, device=dev)
    one = torch.ones((), device=dev)
    ln_w = torch.ones(16, device=dev)
    return {
        "Launch: bad hole": lambda: ext.Launch(0, 1, 128, 0, [0], [-5]),
        "Launch: holes and values differ": lambda: ext.Launch(0, 1, 128, 0, [0, 0], [0]),
        "CastPlan: dbias without its colsum launch": lambda: ext.CastPlan(
            0, 1, True, [2, 16], [], [], torch.zeros(1, 16), None, 0, []),
        "CastPlan: a launch's hole beyond the table": lambda: ext.CastPlan(
            0, 1, True, [2, 16], [], [ext.Launch(0, 1, 128, 0, [0], [7])], None, None, 0, []),
        "CastPlan: bad dtype code": lambda: ext.CastPlan(0, 9, True, [2, 16], [], [], None, None, 0, []),
        "CastPlan: a block plan of two launches": lambda: ext.CastPlan(
            0, 1, False, [4, 16], [], [launch, launch], None, None, 0, [], True, False),
        "CastPlan: a block plan whose transposed copy is not padded to whole blocks": lambda: ext.CastPlan(
            0, 1, False, [4, 16], [16, 16], [launch], None, None, 0, [], True, False),
        "CastPlan: block_dbias without block scaling": lambda: ext.CastPlan(
            0, 1, False, [4, 16], [], [launch], None, None, 0, [], False, True),
        "CastPlan: a tile plan without block scaling": lambda: ext.CastPlan(
            0, 1, False, [4, 16], [], [launch], None, None, 0, [], False, False, True),
        "CastPlan: a tile plan with dbias": lambda: ext.CastPlan(
            0, 1, False, [4, 16], [], [launch], None, None, 0, [], True, True, True),
        "cast_with: a tile plan": lambda: ext.cast_with(tile_plan, w),
        "recast_with: a tile plan with per-tensor scales": lambda: ext.recast_with(tile_plan, w, w8, None, one),
        "recast_with: a tile plan without the transposed scales": lambda: ext.recast_with(
            tile_plan_t, w, w8, w8, torch.ones(4, 1, device=dev)),
        "recast_with: per-tensor plan with transposed scales": lambda: ext.recast_with(
            plan, w[:2], w8[:2], None, one, one),
        "linear_forward: a tile plan for a per-tensor layer": lambda: ext.linear_forward(
            x, w, None, w8, one, None, plan, None, True, False, False, 1, False, tile_plan, None, None, None),
        "Group: flags of the wrong count": lambda: ext.Group(0, 2, [], [], [], [True], []),
        "Group: a launch's hole beyond the table": lambda: ext.Group(
            0, 1, [ext.Launch(0, 1, 128, 0, [0], [3])], [], [], [True], []),
        "MlpPlan: wrong dims": lambda: ext.MlpPlan(0, [1, 2], False, False, [], [], [], None, None, None, None, None),
        "MlpPlan: no forward groups": lambda: ext.MlpPlan(
            0, [4, 16, 16, 16, 16], True, False, [False] * 7, [1, 4, 4, 5, 0], [True] * 3, None, None, None, None, None),
        "MlpPlan: bad dtype code": lambda: ext.MlpPlan(
            dev_index, [4, 16, 16, 16, 16], True, False, [False] * 7, [7, 4, 4, 5, 0], [True] * 3, *fwd_groups,
            None, None, None),
        "run_group: wrong tensor count": lambda: ext.run_group(group, [x]),
        "launch: a hole without its tensor": lambda: ext.launch(launch, dev_index, None, None, None, None),
        "launch: hole beyond the table": lambda: ext.launch(
            ext.Launch(0, 1, 128, 0, [0], [6]), dev_index, x, None, None, None),
        "cast_with: no plan": lambda: ext.cast_with(None, x),
        "cast_with: wrong shape": lambda: ext.cast_with(plan, x),
        "recast_with: the weight does not fit": lambda: ext.recast_with(plan, w, w8, None, one),
        "linear_forward: no input plan": lambda: ext.linear_forward(
            x, w, None, w8, one, None, None, None, True, False, False, 1, False, None, None, None, None),
        "linear_forward: bad dtype code": lambda: ext.linear_forward(
            x, w, None, w8, one, None, plan, None, True, False, False, 9, False, None, None, None, None),
        "linear_forward: a pre-cast input that does not fit": lambda: ext.linear_forward(
            x, w, None, w8, one, None, None, None, True, False, False, 1, False, None, w8, None, one),
        "linear_forward: a pre-cast input without its scale_inv": lambda: ext.linear_forward(
            x, w, None, w8, one, None, None, None, True, False, False, 1, False, None, w8[:3], None, None),
        "linear_forward: a block-scaled input with a per-tensor grad plan": lambda: ext.linear_forward(
            x, w, None, w8, one, None, None, plan, True, False, False, 1, False, None, w8[:3], None,
            torch.ones(1, 3, device=dev).t()),
        "linear_forward: a block-scaled pre-cast input without its scale_inv_t": lambda: ext.linear_forward(
            x, w, None, w8, one, None, None, None, True, False, False, 1, True, None, w8[:3], w8,
            torch.ones(1, 3, device=dev).t()),
        "mlp_forward: no plan": lambda: ext.mlp_forward(
            None, x, ln_w, None, w, None, w, None, w8, one, None, w8, one, None, None, None),
        "mlp_forward: wrong input shape": lambda: ext.mlp_forward(
            mlp_plan, x, ln_w, None, w, None, w, None, w8, one, None, w8, one, None, None, None),
        "scaled_mm: not FP8 operands": lambda: ext.scaled_mm(x, one, w.t(), one, True, 1, None, None),
        "scaled_mm: bad output dtype code": lambda: ext.scaled_mm(w8, one, w8.t(), one, True, 9, None, None),
        "block_scaled_mm: not e4m3 operands": lambda: ext.block_scaled_mm(
            x, torch.ones(1, 3, device=dev).t(), w.t(), torch.ones(4, 1, device=dev), True, 1, None),
        "block_scaled_mm: M not a multiple of 4": lambda: ext.block_scaled_mm(
            w8[:3], torch.ones(1, 3, device=dev).t(), w8.t(), torch.ones(4, 1, device=dev), True, 1, None),
        "block_scaled_mm: scales of the wrong shape": lambda: ext.block_scaled_mm(
            w8, torch.ones(16, 2, device=dev), w8.t(), torch.ones(4, 1, device=dev), True, 1, None),
        "block_scaled_mm: bad output dtype code": lambda: ext.block_scaled_mm(
            w8, torch.ones(1, 16, device=dev).t(), w8.t(), torch.ones(4, 1, device=dev), True, 9, None),
        "high_mlp_forward: bad activation code": lambda: ext.high_mlp_forward(
            x, ln_w, None, w, None, w, None, 1e-5, 99),
        "high_mlp_forward: 4-D input": lambda: ext.high_mlp_forward(
            x.view(1, 1, 3, 16), ln_w, None, w, None, w, None, 1e-5, 1),
        "high_ln_linear_forward: mismatched weight": lambda: ext.high_ln_linear_forward(
            x, ln_w, None, torch.zeros(16, 8, dtype=bf16, device=dev), None, 1e-5),
    }


def main(dev: str) -> None:
    ext = native.extension()
    assert ext is not None, native.failure()
    for name, call in cases(ext, dev).items():
        print(f"START {name}", flush=True)
        try:
            call()
        except Exception as e:  # noqa: BLE001 (any Python exception is what the case wants)
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"RAISED {name}\t{type(e).__name__}: {first[:200]}", flush=True)
        else:
            print(f"RETURNED {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
