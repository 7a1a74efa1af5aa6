"""Which of a model's matrix parameters its FP8 GEMMs use, and why the others do not.

`fp8train.convert` swaps exactly `torch.nn.Linear`. Models keep matrices elsewhere too: the
experts of a Hugging Face MoE (Mixtral, Qwen3-MoE in transformers 5: one module holding 3-D
expert weights), GPT-2's `Conv1D`, embeddings. Those stay in high precision, which `convert`
says once (a warning) and `fp8train.inspect.coverage(model)` lists module by module.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List

from torch import nn

from . import gemm
from .modules.base import FP8Module


class Reason(enum.Enum):
    """Why a module's matrix parameters run (or do not run) FP8 GEMMs."""
    FP8 = "an fp8train module: FP8 GEMMs inside fp8train.autocast"
    LEFT = "an nn.Linear that convert left (filter_fn)"
    DIMS = "an nn.Linear whose in/out features are not both multiples of 16 (FP8 GEMMs need them)"
    SUBCLASS = "a subclass of nn.Linear with its own forward (convert swaps exactly nn.Linear)"
    EMBEDDING = "an embedding: a lookup, no GEMM"
    NOT_LINEAR = "not an nn.Linear: its matrices stay in high precision"


@dataclass(frozen=True)
class Coverage:
    """One module that owns parameters of two or more dims (counted once if shared)."""
    name: str
    kind: str  # the module's type name
    params: int  # elements of those parameters
    reason: Reason

    @property
    def fp8(self) -> bool:
        return self.reason is Reason.FP8


def coverage(model: nn.Module) -> List[Coverage]:
    """Every module of `model` that owns matrix parameters, in module order, with the reason
    its GEMMs run in FP8 or not (fp8train.inspect.coverage)."""
    seen, out = set(), []
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.dim() >= 2 and id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for p in own)
        out.append(Coverage(name, type(m).__name__, sum(p.numel() for p in own), _reason(m)))
    return out


def _reason(m: nn.Module) -> Reason:
    if isinstance(m, FP8Module):
        return Reason.FP8
    if type(m) is nn.Linear:
        return Reason.LEFT if gemm.dims_ok(m.in_features, m.out_features) else Reason.DIMS
    if isinstance(m, nn.Linear):
        return Reason.SUBCLASS
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        return Reason.EMBEDDING
    return Reason.NOT_LINEAR


def not_linear_summary(model: nn.Module) -> str:
    """A sentence for `convert`'s warning when modules that are not nn.Linear hold matrix
    parameters (embeddings aside), or "" when none do."""
    rows = [c for c in coverage(model) if c.reason is not Reason.EMBEDDING]
    others = [c for c in rows if c.reason is Reason.NOT_LINEAR]
    if not others:
        return ""
    kinds = sorted({c.kind for c in others})
    share = sum(c.params for c in others) / sum(c.params for c in rows)
    return (f"{len(others)} module(s) of type {', '.join(kinds)} hold {share:.0%} of the model's matrix parameters "
            "(embeddings aside) and are not nn.Linear: their GEMMs stay in high precision "
            "(fp8train.inspect.coverage(model) lists every module)")


__all__ = ["Coverage", "Reason", "coverage"]
