"""Training a converted Hugging Face model with transformers' `Trainer`, in FP8.

    pip install 'fp8train[hf]'        # transformers and accelerate (the Trainer needs it)
    python examples/hf_trainer.py     # well under a minute on 2 CPU cores

`FP8Trainer` is the Trainer with every forward pass it makes (training and evaluation both
go through `compute_loss`) inside `fp8train.autocast`. The backward runs after the region
exits, as fp8train expects; each microbatch is one FP8 region (delayed scaling updates its
scales on each entry). The rest is the Trainer's own: FP32 master weights under
`bf16=True`, gradient accumulation, checkpoints (`save_pretrained` writes the FP8 scaling
state with the weights, and `resume_from_checkpoint` loads it back), `torch_compile=True`.

The model is a small Llama built from a `LlamaConfig` (random initialisation, nothing is
downloaded), trained on bytes of the Python standard library (fp8train.data).
"""
from __future__ import annotations

import tempfile
from typing import Optional

import torch

import fp8train
from fp8train.data import ByteCorpus


def fp8_trainer_class():
    """FP8Trainer (a function, so that importing this file needs no transformers)."""
    from transformers import Trainer

    class FP8Trainer(Trainer):
        """transformers.Trainer whose forward passes run inside fp8train.autocast(recipe)."""

        def __init__(self, *args, fp8_recipe: Optional[fp8train.recipe.Recipe] = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.fp8_recipe = fp8_recipe or fp8train.CurrentScaling()

        def compute_loss(self, model, inputs, *args, **kwargs):
            with fp8train.autocast(recipe=self.fp8_recipe):
                return super().compute_loss(model, inputs, *args, **kwargs)

    return FP8Trainer


def build_llama(hidden: int = 64, layers: int = 2, seed: int = 0):
    """A small randomly initialised LlamaForCausalLM over bytes (vocab 256), FP32 parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class ByteWindows(torch.utils.data.Dataset):
    """Fixed windows of `seq` bytes of one split, as {"input_ids", "labels"} (the model
    shifts the labels itself)."""

    def __init__(self, corpus: ByteCorpus, split: str, seq: int, count: int, seed: int = 0):
        stream = getattr(corpus, split)
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, stream.numel() - seq, (count,), generator=g)
        self.windows = torch.stack([stream[s:s + seq] for s in starts.tolist()]).long()

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def training_arguments(output_dir: str, steps: int, **overrides):
    """Trainer arguments for this example: batch 4 x 2 microbatches, AdamW lr 2e-3 with
    warm-up and cosine decay, bf16 autocast over FP32 master weights, no reporting."""
    from transformers import TrainingArguments

    options = dict(output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                   max_steps=steps, learning_rate=2e-3, warmup_steps=steps // 10, lr_scheduler_type="cosine",
                   logging_steps=max(1, steps // 10), save_strategy="no", report_to=[], bf16=True,
                   use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(**options)


def main(steps: int = 40) -> None:
    corpus = ByteCorpus.from_stdlib(max_bytes=1_000_000)
    train_data, val_data = ByteWindows(corpus, "train", 64, 8 * steps), ByteWindows(corpus, "val", 64, 32)
    model = fp8train.convert(build_llama(), filter_fn=lambda name, m: not name.endswith("lm_head"))
    with tempfile.TemporaryDirectory() as out:
        trainer = fp8_trainer_class()(model=model, args=training_arguments(out, steps), train_dataset=train_data,
                                      eval_dataset=val_data, fp8_recipe=fp8train.CurrentScaling())
        result = trainer.train()
        print(f"train loss {result.training_loss:.4f}, validation loss {trainer.evaluate()['eval_loss']:.4f}")
    print(f"FP8 modules: {sum(c.fp8 for c in fp8train.inspect.coverage(model))} "
          f"of {len(fp8train.inspect.coverage(model))} modules with matrix parameters")


if __name__ == "__main__":
    main()
