"""benchmarks/hf_llama.py's code path on the CPU (tiny shape, eager variants): it runs, converts
the Llama's projections (not lm_head) and writes one row per variant. Times on the CPU mean
nothing and are not checked (the benchmark runs on the GPU machine)."""
import argparse
import json

import pytest
import torch

pytest.importorskip("transformers")
import hf_llama  # noqa: E402
import fp8train  # noqa: E402
from fp8train.modules import gated_mlp, rms_norm  # noqa: E402

pytestmark = pytest.mark.slow  # a GPU benchmark's CPU smoke run: make test-all


def test_hf_llama_benchmark_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "hf_llama.json"
    variants = ["bf16 eager", "fp8 eager delayed", "fp8 eager delayed unshared"]
    hf_llama.main(["--device", "cpu", "--shapes", "tiny", "--variants", ",".join(variants),
                   "--rounds", "2", "--steps", "1", "--profile-steps", "1", "--host-top", "2", "--device-top", "2",
                   "--python-top", "3", "--json", str(out)])
    rows = json.loads(out.read_text())["shapes"]["tiny"]["rows"]
    assert [r["variant"] for r in rows] == variants
    # each round's times printed as it ends (a run stopped by a time limit keeps them in its log)
    printed = capsys.readouterr().out
    assert all(f"round {r}: bf16 eager " in printed for r in (1, 2)), printed
    assert all("error" not in r and r["wall_ms"] > 0 for r in rows), rows
    # the profiled steps ran (host columns on the CPU; device time is the GPU's)
    assert all(len(r["host_top"]) == 2 and r["device_ms"] is None for r in rows), rows
    # the Python functions by self time (cProfile): the step's own, per step, largest first
    for r in rows:
        ms = [t for _, t, _ in r["python_top"]]
        assert len(ms) == 3 and ms == sorted(ms, reverse=True) and ms[0] > 0, r["python_top"]
    assert "  py   fp8 eager delayed" in printed
    # 2 layers x 7 projections (q, k, v, o, gate, up, down); lm_head stays high precision
    assert rows[0]["fp8train_layers"] == 0 and rows[1]["fp8train_layers"] == 14
    assert abs(rows[1]["loss"] - rows[0]["loss"]) < 0.05  # same weights and batches, ~log(256)
    # the loss is the last round's mean, after the same optimizer steps in every eager variant:
    # 3 warm-up and 2 rounds of 1 (CUDA adds one for the peak)
    assert [r["loss_steps"] for r in rows] == [5, 5, 5]
    # shared input casts (the default): q/k/v and gate/up of each layer tied, and the same
    # training bit for bit as without
    assert rows[1]["shared_input_groups"] == 4 and rows[2]["shared_input_groups"] == 0
    assert rows[2]["loss"] == rows[1]["loss"]
    # which node the eager FP8 variants' Linears ran (on the CPU: the Python node, and why)
    assert rows[0]["linear_paths"] == {}
    assert rows[1]["linear_paths"] == {"Python node: the C++ node runs on CUDA tensors only": 14}
    # fp8train.RMSNorm (convert's fuse_norms): the 4 decoder norms cast for their tied readers, the
    # final one (lm_head's, high precision) has none; without ties no norm has readers
    assert rows[1]["norm_paths"] == {rms_norm.FUSED: 4, rms_norm._NO_READER: 1}
    assert rows[2]["norm_paths"] == {rms_norm._NO_READER: 5}
    # fp8train.GatedMLP (convert's fuse_mlps): both layers' silu(gate) * up in the fused kernels
    assert rows[1]["mlp_paths"] == rows[2]["mlp_paths"] == {gated_mlp.FUSED: 2} and rows[0]["mlp_paths"] == {}
    assert "path fp8 eager delayed" in printed
    # the rounds each FP8 variant beat BF16 eager in, out of the rounds run (none for BF16 itself)
    assert rows[0]["rounds_faster_than_bf16_eager"] == 0
    assert all(r["rounds_faster_than_bf16_eager"] in (0, 1, 2) for r in rows[1:]), rows


def test_within_rounds_pairs_each_round_with_its_own_base():
    # rounds drift 2x; within each round the variant takes 0.9x, 1.1x, 0.8x the base's time
    times, base = [9.0, 22.0, 8.0], [10.0, 20.0, 10.0]
    ratio, wins = hf_llama.within_rounds(times, base)
    assert ratio == pytest.approx(0.9) and wins == 2
    assert hf_llama._faster({"variant": "fp8 eager current", "rounds_ms": times,
                             "rounds_faster_than_bf16_eager": wins}) == "2/3"
    assert hf_llama._faster({"variant": "bf16 eager", "rounds_ms": base, "rounds_faster_than_bf16_eager": 0}) == ""


def test_combo_variant_compiles_with_combo_kernels_on_cpu(tmp_path, monkeypatch):
    """`combo` passes Inductor's combo_kernels option to torch.compile and trains (on the CPU
    Inductor's C++ backend has no combo kernels: this checks the wiring, the GPU measures it)."""
    calls = []
    real_compile = torch.compile

    def spy(model, **kwargs):
        calls.append(kwargs)
        return real_compile(model, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    out = tmp_path / "hf_llama.json"
    hf_llama.main(["--device", "cpu", "--shapes", "tiny", "--variants", "fp8 compile current combo",
                   "--rounds", "1", "--steps", "1", "--profile-steps", "0", "--json", str(out)])
    rows = json.loads(out.read_text())["shapes"]["tiny"]["rows"]
    assert "error" not in rows[0] and abs(rows[0]["loss"] - 5.55) < 0.1, rows  # ~log(256)
    assert calls == [{"options": {"combo_kernels": True}}]


def test_apart_variant_turns_stacking_off():
    """BlockScaling stacks siblings by default; `apart` is its A/B, and names no other recipe."""
    assert hf_llama.recipe_of(["block"]).stack_siblings is True
    assert hf_llama.recipe_of(["block", "apart"]) == fp8train.BlockScaling(stack_siblings=False)
    assert isinstance(hf_llama.recipe_of(["current"]), fp8train.CurrentScaling)
    assert hf_llama.recipe_of(["block", "hiwgrad"]) == fp8train.BlockScaling(fp8_wgrad=False)


def _one_step_rows(tmp_path, variants):
    """The JSON rows of one unprofiled round of one step of each variant at the tiny shape,
    none of them failed."""
    out = tmp_path / "hf_llama.json"
    hf_llama.main(["--device", "cpu", "--shapes", "tiny", "--variants", ",".join(variants),
                   "--rounds", "1", "--steps", "1", "--profile-steps", "0", "--json", str(out)])
    rows = json.loads(out.read_text())["shapes"]["tiny"]["rows"]
    assert all("error" not in r for r in rows), rows
    return rows


def test_ckpt_variants_train_with_checkpointed_layers_on_cpu(tmp_path):
    """`ckpt` turns on HF's activation checkpointing: every decoder layer is checkpointed, and
    the FP8 variant trains as without it (the same batches and weights: the same loss)."""
    rows = _one_step_rows(tmp_path, ["fp8 eager current", "fp8 eager current ckpt"])
    assert rows[1]["loss"] == rows[0]["loss"]
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    hf_llama.checkpointing(model)
    assert model.is_gradient_checkpointing


def test_block_stacked_variants_stack_gate_up_on_cpu(tmp_path, monkeypatch):
    """`stacked`: eager calls stack too, modules.stacked.EAGER set around the variant's steps
    only (left off after; the default recipe stacks in compiled calls alone). The tiny Llama's
    gate/up (128 wide) stack, its q/k/v (64, 32, 32) do not; the loss is the unstacked
    variant's to float32 summation order."""
    from fp8train import gemm
    from fp8train.modules import stacked

    calls = []
    mm = gemm.block_scaled_mm
    monkeypatch.setattr(gemm, "block_scaled_mm", lambda *a, **k: calls.append(a[0].shape) or mm(*a, **k))
    rows = _one_step_rows(tmp_path, ["fp8 eager block", "fp8 eager block stacked"])
    assert stacked.EAGER is False
    assert abs(rows[1]["loss"] - rows[0]["loss"]) < 1e-4 * rows[0]["loss"], rows
    # the stacked gate/up GEMMs: dgrad's dY (128 tokens, 256 wide) and wgrad's dY^T (256, 128);
    # apart no GEMM operand is 256 wide or tall
    shapes = set(map(tuple, calls))
    assert (128, 256) in shapes and (256, 128) in shapes, shapes


def test_compiled_ckpt_variant_is_one_graph_on_cpu(tmp_path):
    """A compiled `ckpt` variant traces the checkpointed layers into the graph (use_cache=False
    and Dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint, which the variant sets): no
    graph break, so BlockScaling's siblings stack in them as in the model without checkpointing."""
    from torch._dynamo.utils import counters
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):  # restored after
        counters.clear()
        rows = _one_step_rows(tmp_path, ["fp8 compile block ckpt"])
        breaks = dict(counters["graph_break"])
        assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    assert not breaks, breaks
    assert abs(rows[0]["loss"] - 5.55) < 0.1, rows  # ~log(256)


def test_forms_word_names_block_shapes_fields():
    """A block variant's forms: word is read field by field; bad words are refused."""
    assert hf_llama.split_forms("fp8 compile block forms:both_clamp=false+norm=8+gated=4x8+even=true") == \
        ("fp8 compile block", {"both_clamp": False, "norm": 8, "gated": (4, 8), "even": True})
    assert hf_llama.split_forms("fp8 compile block") == ("fp8 compile block", {})
    for word in ["forms:", "forms:norm", "forms:norm=8+norm=4", "forms:norm=eight", "forms:gated=4x", "forms:=8"]:
        with pytest.raises(ValueError):
            hf_llama.block_forms(word)
    p = argparse.ArgumentParser()
    assert hf_llama.checked_variants(p, ["fp8 eager block forms:norm=8"], hf_llama.VARIANTS) == \
        ["fp8 eager block forms:norm=8"]
    for bad in ["fp8 compile current forms:norm=8", "fp8 compile block forms:norm", "fp8 compile blok forms:norm=8"]:
        with pytest.raises(SystemExit):
            hf_llama.checked_variants(p, [bad], hf_llama.VARIANTS)
