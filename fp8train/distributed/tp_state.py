"""Checkpoints of tensor-parallel layers: how each parameter shard relates to the unsharded
layer's tensor (ShardSpec), and the state dicts built from that.

  full_state_dict         the unsharded layer's state_dict (collective: gathers the shards)
  load_full_state_dict    slices an unsharded state_dict into this rank's shards (local)
  sharded_state_dict      this rank's state as DTensors over the TP group's DeviceMesh, for
                          torch.distributed.checkpoint (DCP) save / load
  load_sharded_state_dict copies such a state dict back into the layer

DTensor layout (what a DCP checkpoint holds):
  a sharded parameter     DTensor [Shard(dim)] whose global shape is the unsharded tensor's;
                          a `parts` > 1 parameter (swiglu's fc1 [gate; up]) is viewed as
                          (parts, rows / parts, ...) and sharded on dim 1, so the global tensor
                          is the unsharded one with its dim 0 unflattened
  a replicated parameter  DTensor [Replicate()] (norm weight and bias, a row-parallel bias)
  quantizer state         per rank: each buffer b as DTensor [Shard(0)] of b[None], global
                          (W, *b.shape); a quantizer belongs to its rank's shard (a weight
                          shard's scale is its own), so it is restored rank by rank, and only
                          into a layer of the same TP size (load without those keys otherwise:
                          the quantizers then calibrate afresh)
The DTensors' local tensors share storage with the layer's parameters and buffers, so
`dcp.load(sd)` writes straight into the layer; `load_sharded_state_dict(sd)` then runs the
layer's load hooks (a resumed delayed-scaling quantizer is marked calibrated).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from .tp_config import TPConfig


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one parameter of a TP layer is cut from the unsharded layer's tensor.

    dim    the dim split over the ranks; None: replicated, every rank holds the full tensor
    parts  the unsharded tensor is `parts` equal blocks along `dim`, each split over the ranks
           on its own; a rank's shard is the concatenation of its slice of every block (2 for
           swiglu's fc1 weight and bias: rows [gate; up] -> rank r holds [gate_r; up_r])
    """

    dim: Optional[int] = None
    parts: int = 1

    def __post_init__(self):
        if self.dim is None and self.parts != 1:
            raise ValueError("ShardSpec: a replicated tensor (dim=None) has parts=1")
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"ShardSpec: parts must be a positive int, got {self.parts!r}")

    def shard(self, full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
        """This rank's shard of the unsharded tensor `full` (a new contiguous tensor, or
        `full` itself when replicated)."""
        if self.dim is None:
            return full
        blocks = full.chunk(self.parts, self.dim)
        return torch.cat([b.chunk(world, self.dim)[rank] for b in blocks], self.dim).contiguous()

    def unshard(self, shards) -> torch.Tensor:
        """The unsharded tensor from every rank's shard, in rank order (inverse of `shard`)."""
        blocks = [s.chunk(self.parts, self.dim) for s in shards]
        return torch.cat([blocks[r][p] for p in range(self.parts) for r in range(len(shards))], self.dim)

    def full_shape(self, local_shape, world: int) -> tuple:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= world
        return tuple(shape)

    def to_dtensor(self, local: torch.Tensor, mesh):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.dim is None:
            return DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        if self.parts == 1:
            return DTensor.from_local(local, mesh, [Shard(self.dim)], run_check=False)
        view = local.unflatten(self.dim, (self.parts, -1))  # (.., parts, rows / parts, ..): a view
        return DTensor.from_local(view, mesh, [Shard(self.dim + 1)], run_check=False)

    def from_local(self, local: torch.Tensor) -> torch.Tensor:
        """The shard from a DTensor's local tensor (inverse of to_dtensor's view)."""
        return local if self.dim is None or self.parts == 1 else local.flatten(self.dim, self.dim + 1)


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """A TP layer's sharding for checkpoints: its group (any of its TPConfigs) and the spec
    of every parameter (state_dict names; every other entry is per-rank quantizer state)."""

    tp: TPConfig
    specs: Dict[str, ShardSpec]


def _mesh(tp: TPConfig, module: nn.Module):
    from torch.distributed.device_mesh import DeviceMesh

    device_type = next(module.parameters()).device.type
    return DeviceMesh.from_group(tp.group, device_type)


def full_state_dict(module: nn.Module, layout: TPLayout) -> dict:
    """The unsharded layer's state_dict: sharded parameters gathered over the group (a
    collective: every rank calls it); replicated ones and quantizer state are this rank's."""
    state = module.state_dict()
    for name, spec in layout.specs.items():
        if spec.dim is None or name not in state:
            continue
        local = state[name].detach().contiguous()
        shards = [torch.empty_like(local) for _ in range(layout.tp.world)]
        dist.all_gather(shards, local, group=layout.tp.group)
        state[name] = spec.unshard(shards)
    return state


def load_full_state_dict(module: nn.Module, state_dict: dict, layout: TPLayout, strict: bool = True):
    """Load an unsharded layer's state_dict: sharded parameters are sliced into this rank's
    shards (no communication, shapes checked); everything else is loaded as is."""
    own = dict(module.named_parameters())
    state = dict(state_dict)
    for name, spec in layout.specs.items():
        if name not in state or spec.dim is None:
            continue
        want = spec.full_shape(own[name].shape, layout.tp.world)
        if tuple(state[name].shape) != want:
            raise ValueError(f"load_full_state_dict: expected an unsharded {name} of shape {want}, "
                             f"got {tuple(state[name].shape)}")
        state[name] = spec.shard(state[name], layout.tp.world, layout.tp.rank)
    return module.load_state_dict(state, strict=strict)


def sharded_state_dict(module: nn.Module, layout: TPLayout) -> dict:
    """This rank's state as DTensors over the TP group (layout: the module docstring); the
    local tensors share storage with the module's."""
    mesh = _mesh(layout.tp, module)
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        t = t.detach()
        spec = layout.specs.get(name)
        if spec is not None:
            out[name] = spec.to_dtensor(t, mesh)
        else:  # quantizer state, per rank
            from torch.distributed.tensor import DTensor, Shard

            out[name] = DTensor.from_local(t.unsqueeze(0), mesh, [Shard(0)], run_check=False)
    return out


def load_sharded_state_dict(module: nn.Module, state_dict: dict, layout: TPLayout, strict: bool = True):
    """Copy a state dict of `sharded_state_dict`'s layout (after dcp.load) into the module."""
    from torch.distributed.tensor import DTensor

    local = {}
    for name, t in state_dict.items():
        if not isinstance(t, DTensor):
            raise ValueError(f"load_sharded_state_dict: {name} is a {type(t).__name__}, expected a DTensor "
                             "(a state dict from sharded_state_dict(), filled by torch.distributed.checkpoint.load)")
        spec = layout.specs.get(name)
        part = t.to_local()
        local[name] = spec.from_local(part) if spec is not None else part.squeeze(0)
    return module.load_state_dict(local, strict=strict)
