"""How one GEMM of a layer is sharded over a tensor-parallel group: the mode and the options
(ParallelMode, TPConfig), validated once at construction."""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Tuple

import torch
from torch.distributed import ProcessGroup

from .. import gemm
from .groups import group_rank, group_size


REDUCE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


class ParallelMode(enum.Enum):
    COLUMN = "column"  # out_features sharded: weight (out/W, in), bias (out/W)
    ROW = "row"        # in_features sharded: weight (out, in/W), bias full, added after the reduction


@dataclasses.dataclass(frozen=True)
class TPConfig:
    """How one GEMM (a Linear, or fc1 / fc2 of a LayerNormMLP) is sharded over a tensor-
    parallel group. `world` and `rank` are read from the group at construction
    (torch.distributed must be initialised); `owner` names the layer in error messages."""

    group: ProcessGroup
    mode: ParallelMode
    in_features: int
    out_features: int
    sequence_parallel: bool = False
    overlap: bool = False  # tp_overlap: ring collective matmuls for the SP gathers / reduce-scatters
    owner: str = "Linear"
    # tp_reduce_dtype: the dtype partial sums (row-parallel output, column-parallel dX) are
    # reduced in; None = the activation dtype (bf16 in bf16 training, as Megatron and BF16 TP
    # do), torch.float32 = the float32 sum whatever W, at twice the bytes (docs/distributed.md)
    reduce_dtype: Optional[torch.dtype] = None
    # column mode: out_features made of these blocks, each sharded over the ranks on its own
    # (LayerNormLinear's out_features=(q, k, v)); () for one block
    out_parts: Tuple[int, ...] = ()
    world: int = dataclasses.field(init=False)
    rank: int = dataclasses.field(init=False)

    def __post_init__(self):
        what = (f"{self.owner}(in={self.in_features}, out={self.out_parts or self.out_features}, "
                f"parallel_mode={self.mode.value!r})")
        if not isinstance(self.group, ProcessGroup):
            raise ValueError(f"{what}: tp_group must be a torch.distributed ProcessGroup (for the whole world: "
                             f"torch.distributed.group.WORLD), got {self.group!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"{what}: sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"{what}: tp_overlap must be a bool, got {self.overlap!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"{what}: tp_reduce_dtype must be one of {REDUCE_DTYPES}, got {self.reduce_dtype!r}")
        if self.overlap and not self.sequence_parallel:
            raise ValueError(f"{what}: tp_overlap=True overlaps the sequence-parallel all-gather / reduce-scatter "
                             "with the GEMMs; it needs sequence_parallel=True (without SP the layer's one "
                             "all-reduce has no ring form here)")
        object.__setattr__(self, "world", group_size(self.group))
        object.__setattr__(self, "rank", group_rank(self.group))
        if self.out_parts and (not self.column or sum(self.out_parts) != self.out_features):
            raise ValueError(f"{what}: out_parts are the blocks of a column-parallel layer's out_features")
        for i, part in enumerate(self.out_parts):  # first, so the error names the part
            if part % self.world or (part // self.world) % 16:
                raise ValueError(f"{what}: out_features part {i} ({part}) gives {part / self.world:g} rows per rank "
                                 f"over the {self.world} ranks of tp_group; each part is sharded on its own and "
                                 "must split into multiples of 16 per rank")
        name, dim = (("out_features", self.out_features) if self.mode is ParallelMode.COLUMN
                     else ("in_features", self.in_features))
        if dim % self.world:
            raise ValueError(f"{what}: {name}={dim} does not split evenly over the {self.world} ranks of tp_group")
        if not gemm.dims_ok(self.local_in_features, self.local_out_features):
            raise ValueError(f"{what}: each rank's shard is ({self.local_out_features}, {self.local_in_features}); "
                             "tensor-parallel FP8 layers need both shard dims to be multiples of 16")

    @classmethod
    def create(cls, tp_group, parallel_mode, sequence_parallel: bool, in_features: int,
               out_features: int, tp_overlap: bool = False, owner: str = "Linear",
               reduce_dtype: Optional[torch.dtype] = None, out_parts: Tuple[int, ...] = ()) -> Optional["TPConfig"]:
        """The config for a layer's constructor arguments; None for an unsharded layer."""
        if parallel_mode is None:
            if sequence_parallel or tp_overlap or reduce_dtype is not None:
                flag = ("sequence_parallel=True" if sequence_parallel else "tp_overlap=True" if tp_overlap
                        else "tp_reduce_dtype")
                raise ValueError(f"{owner}: {flag} needs parallel_mode='column' or 'row'")
            if tp_group is not None:
                raise ValueError(f"{owner}: tp_group given without parallel_mode; pass parallel_mode='column' or 'row'")
            return None
        try:
            mode = ParallelMode(parallel_mode)
        except ValueError:
            raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}") from None
        if tp_group is None:
            raise ValueError(f"{owner}: parallel_mode={parallel_mode!r} needs tp_group (a torch.distributed "
                             "ProcessGroup; torch.distributed.group.WORLD for all ranks)")
        return cls(tp_group, mode, in_features, out_features, sequence_parallel, tp_overlap, owner, reduce_dtype,
                   out_parts)

    def accum_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype this layer's partial sums are computed and reduced in."""
        return self.reduce_dtype or act_dtype

    @property
    def column(self) -> bool:
        return self.mode is ParallelMode.COLUMN

    @property
    def local_in_features(self) -> int:
        return self.in_features if self.column else self.in_features // self.world

    @property
    def local_out_features(self) -> int:
        return self.out_features // self.world if self.column else self.out_features

    @property
    def local_out_parts(self) -> Tuple[int, ...]:
        """This rank's rows of each out_features block (column mode), in order."""
        return tuple(p // self.world for p in self.out_parts)

    def weight_dim(self) -> int:
        """The weight dim that is sharded: 0 (out_features, column) or 1 (in_features, row)."""
        return 0 if self.column else 1
