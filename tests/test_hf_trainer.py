"""examples/hf_trainer.py: transformers' Trainer training a converted Llama in FP8 (its
forward passes inside fp8train.autocast), on the CPU: the layers run FP8 and the losses
track the BF16 Trainer's; a run resumed from a Trainer checkpoint continues bit for bit,
the FP8 scaling state included (save_pretrained writes it; the ties' copies are what
safetensors takes)."""
import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fp8train  # noqa: E402

_spec = importlib.util.spec_from_file_location("hf_trainer", Path(__file__).parent.parent / "examples" / "hf_trainer.py")
hf_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_trainer)


class RandomBytes(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=64):
        self.x = torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(model, out, steps, recipe, **overrides):
    args = hf_trainer.training_arguments(str(out), steps, logging_steps=1, seed=0, **overrides)
    cls = hf_trainer.fp8_trainer_class() if recipe is not None else __import__("transformers").Trainer
    kwargs = {"fp8_recipe": recipe} if recipe is not None else {}
    return cls(model=model, args=args, train_dataset=RandomBytes(), **kwargs)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _model(recipe):
    model = hf_trainer.build_llama()
    return fp8train.convert(model, recipe, filter_fn=lambda name, m: not name.endswith("lm_head"))


@pytest.mark.parametrize("recipe", [fp8train.DelayedScaling(), fp8train.CurrentScaling()], ids=["delayed", "current"])
def test_trainer_trains_in_fp8_close_to_bf16(recipe, tmp_path):
    model = _model(recipe)
    bf16 = copy.deepcopy(model)
    fp8_run = _trainer(model, tmp_path / "fp8", 6, recipe)
    fp8_run.train()
    bf16_run = _trainer(bf16, tmp_path / "bf16", 6, None)  # the same converted model outside fp8train.autocast
    bf16_run.train()
    got, want = torch.tensor(_losses(fp8_run)), torch.tensor(_losses(bf16_run))
    assert len(got) == 6 and not torch.equal(got, want)  # FP8 ran: not the BF16 numbers
    assert ((got - want).abs() <= 0.02 * want).all(), (got, want)
    assert model.model.layers[0].self_attn.q_proj.input_quantizer.matches(recipe, fp8train.TensorRole.INPUT)
    assert fp8train.inspect.shared_input_casts(model)  # the tie formed inside the Trainer's forward


def test_resume_from_checkpoint_continues_bit_for_bit(tmp_path):
    recipe = fp8train.DelayedScaling()  # the recipe whose scaling state a resume must bring back
    model = _model(recipe)
    run = _trainer(model, tmp_path, 4, recipe, save_strategy="steps", save_steps=2)
    run.train()
    want_losses, want_state = _losses(run), copy.deepcopy(model.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    resumed_model = _model(recipe)
    resumed = _trainer(resumed_model, tmp_path, 4, recipe, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert _losses(resumed)[2:] == want_losses[2:]  # steps 3 and 4, after the two the checkpoint holds
    for name, a in resumed_model.state_dict().items():
        assert torch.equal(a, want_state[name]), name


@pytest.mark.slow  # Dynamo traces the model: ~20 s on a slow 2-core machine; make test keeps test_hf_llama_compile's case
def test_trainer_with_torch_compile_trains_as_eager(tmp_path):
    """TrainingArguments(torch_compile=True): the Trainer compiles the converted model (no eager
    step first: convert's first-call pass makes the quantizers). The first step's loss is the
    eager Trainer's bit for bit; later ones within 1e-3: the compiled Trainer's gradients differ
    in their last bits for the unconverted model too (BF16 compiled against eager, aot_eager:
    up to 2e-5 relative over these steps; transformers 5.25)."""
    recipe = fp8train.CurrentScaling()
    model = _model(recipe)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = _trainer(model, tmp_path / "compiled", 4, recipe, torch_compile=True, torch_compile_backend="aot_eager")
    compiled.train()
    eager = _trainer(twin, tmp_path / "eager", 4, recipe)
    eager.train()
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0
    # the compiled backward cast the gradients (convert's first-call pass runs no backward)
    assert model.model.layers[0].mlp.down_proj.grad_output_quantizer.amax > 0
    got, want = torch.tensor(_losses(compiled)), torch.tensor(_losses(eager))
    assert got[0] == want[0] and ((got - want).abs() <= 1e-3 * want).all(), (got, want)
