"""A small GPT built from fp8train modules (nanoGPT's shape): pre-norm blocks with a
LayerNormLinear for Q/K/V, attention through scaled_dot_product_attention in the activation
dtype, a Linear output projection and a LayerNormMLP; byte vocabulary, tied embeddings.

Outside fp8train.autocast every layer computes what its torch.nn counterpart computes, so
the same model trains in BF16 or FP8 from the same weights.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import LayerNormLinear, LayerNormMLP, Linear


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    ffn_mult: int = 4
    activation: str = "gelu_tanh"
    normalization: str = "LayerNorm"

    def __post_init__(self):
        for f in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "ffn_mult"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{f} must be a positive int, got {v!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}")

    @classmethod
    def named(cls, name: str, **overrides) -> "GPTConfig":
        """Presets: "tiny" (CPU demo), "small" (~11M), "gpt125m" (GPT-2 small's shape on bytes)."""
        presets = {
            "tiny": cls(seq_len=128, n_layer=2, n_head=4, d_model=64),
            "small": cls(seq_len=512, n_layer=6, n_head=8, d_model=384),
            "gpt125m": cls(seq_len=1024, n_layer=12, n_head=12, d_model=768),
        }
        if name not in presets:
            raise ValueError(f"unknown GPT config {name!r}; choose one of {sorted(presets)}")
        return dataclasses.replace(presets[name], **overrides)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None, dtype=None):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.qkv = LayerNormLinear(d, 3 * d, normalization=cfg.normalization, params_dtype=dtype, device=device)
        self.proj = Linear(d, d, params_dtype=dtype, device=device)
        self.mlp = LayerNormMLP(d, cfg.ffn_mult * d, normalization=cfg.normalization, activation=cfg.activation,
                                params_dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).unbind(2)  # (B, T, H, Dh) each
        dtype = x.dtype if x.dtype != torch.float32 or not x.is_cuda else torch.bfloat16
        att = F.scaled_dot_product_attention(q.transpose(1, 2).to(dtype), k.transpose(1, 2).to(dtype),
                                             v.transpose(1, 2).to(dtype), is_causal=True)  # (B, H, T, Dh)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c).to(x.dtype))
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        factory = {"device": device, "dtype": dtype}
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, **factory)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model, **factory)
        self.blocks = nn.ModuleList(Block(cfg, device=device, dtype=dtype) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, **factory)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's scheme: weights N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer),
        # biases zero; norms keep gamma = 1, beta = 0.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 2:
                    residual = name.endswith(("proj.weight", "fc2_weight"))
                    p.normal_(0.0, 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """idx (B, T) int64 bytes -> logits (B, T, V); with targets, (logits, mean cross-entropy)."""
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        act = torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type) else None
        if act is not None:
            x = x.to(act)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight.to(x.dtype))  # tied embeddings, high precision
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


__all__ = ["GPT", "GPTConfig", "Block"]
