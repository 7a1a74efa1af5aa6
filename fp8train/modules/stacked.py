"""Sibling Linears stacked: the layers of one tie (modules/base.py; attention's q/k/v, an MLP's
gate/up) run as one GEMM each way under BlockScaling(stack_siblings=True), in compiled calls
(eager ones with EAGER on).

The tie's first member (`Quantizer.members[0]`, the first to be called) computes
x @ cat(W_i)^T once and splits it; each later member's call takes its slice, kept on the
tie's quantizer until taken. With each out_features a multiple of 128 the stacked weight's
128 x 128 tiles and the gradient's 1 x 128 blocks are each member's own, so the FP8 bytes
are the separate layers'; what changes is one dgrad summing over all members' N inside the
GEMM (float32) where autograd added the members' dX, and fewer, larger launches (the
fifty-third session's benchmarks/gemm.py: one h1024 layer's block GEMMs 0.92x).

A member called with another x than the first member's (a pre-hook, a model that calls
them apart) finds no slice and runs its own GEMMs: the result is the same, the first
member's GEMM for it was spent.
"""
from __future__ import annotations

import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..quantizer import Quantizer
from ..tensor import version_of

# The stacked weight's tiles must be each member's: every out_features a multiple of this
TILE = 128

# Whether eager calls stack too (compiled calls always do, under stack_siblings=True). Off:
# eagerly the stacked GEMM's savings come with copies that Inductor fuses away in a compiled
# step and eager code makes: the weights' concatenation (the C++ node re-casts one weight
# tensor), the members' strided outputs made contiguous by GatedMLP's kernels, and dY's
# concatenation in the backward (at HF Llama h1024 an estimated ~170 us a layer against
# ~54 us of GEMM time saved; not measured on the GPU yet). An A/B switch for tests and
# benchmarks/hf_llama.py ("stacked" variants).
EAGER = False


# Whether a stacked gate/up tie of a GatedMLP (modules/gated_mlp.py) computes the MLP's
# product inside its cast (linear.gated_stacked_forward): the product's two-way cast for the
# down projection comes out of the gate/up node, and its backward casts dg | du from the
# down projection's dX, g and u in one kernel; neither the product nor dg and du are stored.
# Wherever stacking runs (compiled calls; eager ones with EAGER). An A/B switch for tests and
# benchmarks/hf_llama.py ("ungated" variants).
GATED = True


# Whether a compiled fp8train.RMSNorm whose output a stacked tie reads (q/k/v, gate/up) casts
# that output for the tie in one kernel from the norm's input and rstd (rms_norm.py), so the
# output itself is never stored (Inductor drops the formula's, read by nothing else). An A/B
# switch likewise ("unnormed" variants).
NORMS = True


_PLAIN = (nn.Parameter, torch.Tensor)


class Parts(NamedTuple):
    weights: List[torch.Tensor]            # the members' weights, in member order
    biases: Optional[List[torch.Tensor]]   # their biases, or None where no member has one
    widths: List[int]                      # their out_features


def parts(layer: nn.Module, q: Quantizer) -> Optional[Parts]:
    """What `layer`, the first member of q's tie, stacks: every member's weight and bias,
    where all of them can run as one GEMM (the same layer type without tensor parallelism,
    q their input quantizer, weights of one dtype, device, in_features and requires_grad, each
    out_features a multiple of TILE, biases all or none, plain tensors: no FP8-gathered weight,
    no DTensor (an FSDP2 unit of its own, not gathered yet at the first member's call), no
    CUDA graph weight flag); else None."""
    members = q.members
    if len(members) != q.sharing or members[0] is not layer:
        return None
    w0 = layer._parameters["weight"]
    has_bias = layer._parameters.get("bias") is not None
    weights, biases, widths = [], [], []
    for m in members:
        w, b = m._parameters["weight"], m._parameters.get("bias")
        if (type(m) is not type(layer) or m.tp is not None or m._modules["input_quantizer"] is not q
                or m.weight_cast_skip is not None or type(w) not in _PLAIN
                or w.dtype != w0.dtype or w.device != w0.device or w.requires_grad != w0.requires_grad
                or w.dim() != 2 or w.shape[1] != w0.shape[1] or w.shape[0] % TILE or (b is not None) != has_bias):
            return None
        if has_bias and (type(b) not in _PLAIN or b.dtype != w0.dtype or b.requires_grad != w0.requires_grad):
            return None
        weights.append(w)
        widths.append(w.shape[0])
        biases.append(b)
    return Parts(weights, biases if has_bias else None, widths)


def keep(q: Quantizer, x: torch.Tensor, outs: Tuple[torch.Tensor, ...]) -> None:
    """Keep the later members' outputs (outs[1:]) for their calls on x."""
    rest = (None,) + tuple(outs[1:])
    if torch.compiler.is_compiling():
        # Dynamo replays the last write to this attribute after the graph: None once every
        # member has taken its slice, so no output is kept past the trace as module state
        q._traced_stack = (x, rest)
    else:
        q._stack_memo = (weakref.ref(x), version_of(x), rest)


def take(layer: nn.Module, q: Quantizer, x: torch.Tensor) -> Optional[torch.Tensor]:
    """`layer`'s output, computed by its tie's first member on this same x (unchanged since),
    or None; the memo is dropped once every member has taken its output."""
    traced = torch.compiler.is_compiling()
    memo = q._traced_stack if traced else q._stack_memo
    if memo is None:
        return None
    if traced:
        held, outs = memo
        if held is not x:
            return None
    else:
        ref, version, outs = memo
        if ref() is not x or version != version_of(x):
            return None
    index = next((i for i, m in enumerate(q.members) if m is layer), None)
    if index is None or index >= len(outs) or outs[index] is None:
        return None
    out = outs[index]
    rest = outs[:index] + (None,) + outs[index + 1:]
    done = all(o is None for o in rest)
    if traced:
        q._traced_stack = None if done else (x, rest)
    else:
        q._stack_memo = None if done else (ref, version, rest)
    return out


def offer(q: Quantizer, x: torch.Tensor, cast: Tuple[torch.Tensor, ...]) -> None:
    """Hand q's layer the cast of its next input x, made upstream (a gated MLP's product, cast
    inside the gate/up GEMM's node: GATED; an RMSNorm's output: NORMS): `cast` as _LinearFn's
    five shared-cast arguments (the last, x_hp, what a bf16 wgrad saves instead of x, or None)."""
    q._offered = (x, cast)


def take_offer(q: Quantizer, x: torch.Tensor) -> Optional[Tuple[torch.Tensor, ...]]:
    """The cast offered to q for this same x, now taken (dropped from q), or None."""
    memo = q._offered
    if memo is None or memo[0] is not x:
        return None
    q._offered = None
    return memo[1]


def offered(q: Quantizer) -> bool:
    """Whether a cast offered to q is still untaken."""
    return q._offered is not None


__all__ = ["EAGER", "GATED", "NORMS", "Parts", "TILE", "keep", "offer", "offered", "parts", "take", "take_offer"]
