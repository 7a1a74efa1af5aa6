"""A model no one here wrote: Hugging Face's GPT-2, converted to fp8train and trained in FP8.

    pip install 'fp8train[hf]'        # transformers
    python examples/hf_gpt2.py        # 1-2 minutes on 2 CPU cores

The GPT-2 is built from a `transformers.GPT2Config` (random initialisation, nothing is
downloaded) and trained on bytes of the Python standard library (fp8train.data), three
times from the same weights on the same batches: BF16, FP8 with DelayedScaling, FP8 with
CurrentScaling. The printed table shows that the FP8 losses track BF16.

GPT-2 keeps its projections in `transformers.pytorch_utils.Conv1D`, a linear layer whose
weight is stored transposed, (in, out). `fp8train.convert` swaps only `torch.nn.Linear`
(it keeps the very same Parameter objects, and a Conv1D weight has the wrong layout for
that), so this example first rewrites each Conv1D as an `nn.Linear` holding a transposed
copy of its weight (`conv1d_to_linear`), then converts. Build the optimizer after both.
"""
from __future__ import annotations

import copy
from typing import List, Optional

import torch
from torch import nn

import fp8train
from fp8train.data import ByteCorpus


def build_gpt2(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_positions: int = 64, seed: int = 0):
    """A small randomly initialised GPT-2 over bytes (vocab 256), without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace every transformers Conv1D (weight (in, out), y = x @ W + b) by an nn.Linear
    computing the same (weight (out, in) = W^T, a contiguous copy; the bias is shared), in
    place. New weight Parameters: build optimizers afterwards."""
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.nx, child.nf, device="meta")
                linear.weight = nn.Parameter(child.weight.detach().t().contiguous(), child.weight.requires_grad)
                linear.bias = child.bias
                setattr(parent, name, linear)
    return model


def to_fp8train(model: nn.Module) -> nn.Module:
    """Conv1D -> nn.Linear -> fp8train.Linear; the tied LM head stays in high precision."""
    conv1d_to_linear(model)
    return fp8train.convert(model, filter_fn=lambda name, m: not name.endswith("lm_head"))


def train(model: nn.Module, corpus: ByteCorpus, recipe: Optional[fp8train.recipe.Recipe], steps: int = 60,
          batch: int = 8, seq: int = 64, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> List[float]:
    """AdamW, constant lr 2e-3; FP32 master weights, activations in `dtype` (torch.autocast
    for bf16), FP8 GEMMs inside fp8train.autocast when `recipe` is given. Returns every
    step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = corpus.batch("train", batch, seq, gen)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), \
                fp8train.autocast(enabled=recipe is not None, recipe=recipe or fp8train.DelayedScaling()):
            # GPT-2 shifts labels itself: the label of position t is the input byte t + 1.
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    corpus = ByteCorpus.from_stdlib(max_bytes=2_000_000)
    base = to_fp8train(build_gpt2())
    print(base.transformer.h[0])
    results = {name: train(copy.deepcopy(base), corpus, recipe) for name, recipe in
               (("bf16", None), ("fp8 delayed", fp8train.DelayedScaling()), ("fp8 current", fp8train.CurrentScaling()))}
    tail = {name: sum(v[-10:]) / 10 for name, v in results.items()}
    print(f"\n{'run':<13}{'first loss':>11}{'last-10 mean':>14}{'gap vs bf16':>13}")
    for name, v in results.items():
        print(f"{name:<13}{v[0]:>11.4f}{tail[name]:>14.4f}{(tail[name] - tail['bf16']) / tail['bf16']:>+13.2%}")


if __name__ == "__main__":
    main()
