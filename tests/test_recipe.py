import dataclasses

import pytest
import torch

import fp8train
from fp8train import CurrentScaling, DelayedScaling, Format, GemmConfig, GemmRole, TensorRole


def test_defaults():
    r = DelayedScaling()
    assert (r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin) == (Format.HYBRID, 1024, "max", 0)
    assert r.gemm == GemmConfig(fprop_fast_accum=True, dgrad_fast_accum=False, wgrad_fast_accum=False)
    assert CurrentScaling().fp8_format is Format.HYBRID
    assert not DelayedScaling().power_of_two_scales and not CurrentScaling().power_of_two_scales
    assert fp8train.autocast().recipe == CurrentScaling()  # N1: level with torchao's loss
    assert fp8train.autocast(recipe=DelayedScaling()).recipe == DelayedScaling()


def test_formats_per_role():
    assert Format.HYBRID.dtype(TensorRole.INPUT) == torch.float8_e4m3fn
    assert Format.HYBRID.dtype(TensorRole.WEIGHT) == torch.float8_e4m3fn
    assert Format.HYBRID.dtype(TensorRole.GRAD_OUTPUT) == torch.float8_e5m2
    assert all(Format.E4M3.dtype(r) == torch.float8_e4m3fn for r in TensorRole)


def test_gemm_config_per_role():
    c = GemmConfig(fprop_fast_accum=False, dgrad_fast_accum=True, wgrad_fast_accum=False)
    assert [c.fast_accum(r) for r in GemmRole] == [False, True, False]


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling(), GemmConfig()], ids=type)
def test_frozen(recipe):
    field = dataclasses.fields(recipe)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(recipe, field, None)


@pytest.mark.parametrize("make, match", [
    (lambda: DelayedScaling(fp8_format="hybrid"), "fp8_format"),
    (lambda: DelayedScaling(amax_history_len=0), "amax_history_len"),
    (lambda: DelayedScaling(amax_history_len=2.0), "amax_history_len"),
    (lambda: DelayedScaling(amax_history_len=True), "amax_history_len"),
    (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
    (lambda: DelayedScaling(margin=-1), "margin"),
    (lambda: DelayedScaling(margin=0.5), "margin"),
    (lambda: DelayedScaling(gemm={"fprop_fast_accum": True}), "gemm"),
    (lambda: CurrentScaling(fp8_format=None), "fp8_format"),
    (lambda: DelayedScaling(power_of_two_scales=1), r"DelayedScaling\.power_of_two_scales must be a bool"),
    (lambda: CurrentScaling(power_of_two_scales="yes"), r"CurrentScaling\.power_of_two_scales must be a bool"),
    (lambda: CurrentScaling(power_of_two_scales=None), "power_of_two_scales"),
    (lambda: CurrentScaling(auto_precision=1), r"CurrentScaling\.auto_precision must be a bool"),
    (lambda: GemmConfig(fprop_fast_accum=1), "fprop_fast_accum"),
    (lambda: fp8train.autocast(recipe="delayed"), "recipe"),
    (lambda: fp8train.autocast(enabled="yes"), "enabled"),
], ids=["format", "hist0", "histfloat", "histbool", "algo", "margin-neg", "margin-float", "gemm", "cur-format",
        "pow2-int", "cur-pow2-str", "cur-pow2-none", "cur-auto-int", "gemm-field", "autocast-recipe",
        "autocast-enabled"])
def test_bad_values_are_clear_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()
