"""Checkpoints of tensor-parallel layers: how each parameter shard relates to the unsharded
layer's tensor (ShardSpec), and the state dicts built from that.

  full_state_dict         the unsharded layer's state_dict (collective: gathers the shards)
  load_full_state_dict    slices an unsharded state_dict into this rank's shards (local)
  sharded_state_dict      this rank's state as DTensors over the TP group's DeviceMesh, for
                          torch.distributed.checkpoint (DCP) save / load
  load_sharded_state_dict copies such a state dict back into the layer

DTensor layout (what a DCP checkpoint holds):
  a sharded parameter     DTensor [Shard(dim)] whose global shape is the unsharded tensor's;
                          a parameter of `parts` equal blocks (swiglu's fc1 [gate; up]) is
                          viewed as (parts, rows / parts, ...) and sharded on dim 1, so the
                          global tensor is the unsharded one with its dim 0 unflattened; one of
                          blocks of given sizes (LayerNormLinear's [Q; K; V]) is a list of
                          DTensors [Shard(dim)], one per block, each block's global tensor the
                          unsharded block (DCP stores them as `name.0`, `name.1`, ...)
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
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .tp_config import TPConfig


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one parameter of a TP layer is cut from the unsharded layer's tensor.

    dim    the dim split over the ranks; None: replicated, every rank holds the full tensor
    parts  the unsharded tensor is made of blocks along `dim`, each split over the ranks on its
           own; a rank's shard is the concatenation of its slice of every block. An int: that
           many equal blocks (2 for swiglu's fc1 weight and bias: rows [gate; up] -> rank r
           holds [gate_r; up_r]); a tuple: the blocks' sizes in the unsharded tensor
           (LayerNormLinear's out_features=(q, k, v): rows [Q; K; V] -> [Q_r; K_r; V_r])
    """

    dim: Optional[int] = None
    parts: Union[int, Tuple[int, ...]] = 1

    def __post_init__(self):
        sizes = self.parts if isinstance(self.parts, tuple) else (self.parts,)
        if not sizes or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in sizes):
            raise ValueError(f"ShardSpec: parts must be a positive int or a tuple of positive ints, got {self.parts!r}")
        if self.dim is None and self.parts != 1:
            raise ValueError("ShardSpec: a replicated tensor (dim=None) has parts=1")

    def blocks(self, n: int) -> List[int]:
        """The blocks' sizes along `dim` in a tensor with n rows there: the unsharded tensor,
        or a shard (every block splits evenly over the ranks, so a shard's blocks are in the
        same proportions)."""
        if isinstance(self.parts, int):
            return [n // self.parts] * self.parts
        total = sum(self.parts)
        return [p * n // total for p in self.parts]

    def shard(self, full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
        """This rank's shard of the unsharded tensor `full` (a new contiguous tensor, or
        `full` itself when replicated)."""
        if self.dim is None:
            return full
        blocks = full.split(self.blocks(full.shape[self.dim]), self.dim)
        return torch.cat([b.chunk(world, self.dim)[rank] for b in blocks], self.dim).contiguous()

    def unshard(self, shards) -> torch.Tensor:
        """The unsharded tensor from every rank's shard, in rank order (inverse of `shard`)."""
        blocks = [s.split(self.blocks(s.shape[self.dim]), self.dim) for s in shards]
        return torch.cat([b[p] for p in range(len(blocks[0])) for b in blocks], self.dim)

    def full_shape(self, local_shape, world: int) -> tuple:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= world
        return tuple(shape)

    def to_dtensor(self, local: torch.Tensor, mesh):
        """This rank's shard as what sharded_state_dict holds (the module docstring): a
        DTensor, or for blocks of given sizes a list of DTensors (a list, not a tuple: DCP
        looks into lists only). Their local tensors are views of `local`."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.dim is None:
            return DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        if self.parts == 1:
            return DTensor.from_local(local, mesh, [Shard(self.dim)], run_check=False)
        if isinstance(self.parts, tuple):  # no one DTensor has [Q_r; K_r; V_r] as its local part
            return [DTensor.from_local(b, mesh, [Shard(self.dim)], run_check=False)
                    for b in local.split(self.blocks(local.shape[self.dim]), self.dim)]
        view = local.unflatten(self.dim, (self.parts, -1))  # (.., parts, rows / parts, ..): a view
        return DTensor.from_local(view, mesh, [Shard(self.dim + 1)], run_check=False)

    def from_dtensor(self, value) -> torch.Tensor:
        """This rank's shard from what to_dtensor returned (after dcp.load filled it)."""
        if isinstance(value, list):
            return torch.cat([b.to_local() for b in value], self.dim)
        local = value.to_local()
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
        if not all(isinstance(b, DTensor) for b in (t if isinstance(t, list) else [t])):
            raise ValueError(f"load_sharded_state_dict: {name} is a {type(t).__name__}, expected a DTensor "
                             "(a state dict from sharded_state_dict(), filled by torch.distributed.checkpoint.load)")
        spec = layout.specs.get(name)
        local[name] = spec.from_dtensor(t) if spec is not None else t.to_local().squeeze(0)
    return module.load_state_dict(local, strict=strict)
