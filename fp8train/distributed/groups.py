"""Process-group helpers: the amax reduction option (which groups scales agree over) and
the ring neighbours the collective matmuls talk to.

Note: every function here takes `torch.distributed` process groups; `None` means the
default (world) group, as in torch.distributed itself.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclasses.dataclass(frozen=True)
class AmaxReduction:
    """The process groups an amax is MAX-reduced over, one collective per group, in order.

    `AmaxReduction.tensor_parallel(tp_group)`
        scales agree within the tensor-parallel group: what an FP8 all-gather needs (every
        rank's rows are decoded with one scale_inv after the gather).
    `AmaxReduction.tensor_and_data_parallel(tp_group, dp_group)`
        scales also agree across data-parallel replicas, so every replica casts with the same
        scales (replicas stay numerically identical step for step). Two collectives. MAX is
        associative, so reducing over TP and then over DP gives the max over the whole TP x DP
        grid whenever each DP group meets each TP group of the grid once (the usual layout).
    `AmaxReduction((tp_dp_group,))`
        a single group that already spans TP x DP (for example the world group when there is
        no pipeline parallelism): one collective.
    """

    groups: Tuple[Optional[ProcessGroup], ...]

    def __post_init__(self):
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ValueError(f"AmaxReduction.groups must be a non-empty tuple of process groups, got {self.groups!r}")
        for g in self.groups:
            if g is not None and not isinstance(g, ProcessGroup):
                raise ValueError(f"AmaxReduction.groups: {g!r} is not a torch.distributed ProcessGroup")

    @classmethod
    def tensor_parallel(cls, tp_group: Optional[ProcessGroup]) -> "AmaxReduction":
        return cls((tp_group,))

    @classmethod
    def tensor_and_data_parallel(cls, tp_group: Optional[ProcessGroup],
                                 dp_group: Optional[ProcessGroup]) -> "AmaxReduction":
        return cls((tp_group, dp_group))


GroupsLike = Union[AmaxReduction, ProcessGroup, None]


def as_reduction(groups: GroupsLike) -> AmaxReduction:
    """An AmaxReduction from itself or from one process group (None: the world group)."""
    if isinstance(groups, AmaxReduction):
        return groups
    return AmaxReduction((groups,))


def group_size(group: Optional[ProcessGroup]) -> int:
    if not dist.is_initialized():
        raise RuntimeError("fp8train.distributed: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (torchrun sets up its environment)")
    return dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    return dist.get_rank(group)


def ring_peers(group: Optional[ProcessGroup]) -> Tuple[int, int]:
    """(next, previous) in the ring of `group`, as *global* ranks (what isend/irecv take).

    The ring order is the group's rank order: group rank r sends to r + 1 and receives from
    r - 1 (mod size)."""
    size, rank = group_size(group), group_rank(group)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    if group is None:
        return nxt, prev
    return dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
