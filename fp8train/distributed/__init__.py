"""Tensor/sequence-parallel building blocks in FP8 over torch.distributed (docs/distributed.md).

groups.py             AmaxReduction (which groups scales agree over), ring neighbours
fp8_comm.py           FP8 all-gather, amax reduction, group-consistent cast, gather + cast
amax_sync.py          delayed scaling: pending amaxes of many quantizers in one collective
ring.py               one ring step's P2P transfers (side stream and events on CUDA)
collective_matmul.py  ring all-gather matmul and matmul reduce-scatter (overlapped)
tp_config.py          TPConfig: how one GEMM is sharded (mode, SP, overlap), validated once
tp_comm.py            each TP mode's FP8 GEMMs with their communication (column / row, +SP)
tp_mappings.py        TP layers outside fp8train.autocast: torch GEMMs, the same communication
tp_state.py           checkpoints: full (unsharded) and sharded (DTensor, for DCP) state dicts
parallel_linear.py    the tensor-parallel FP8 Linear (fp8train.Linear(parallel_mode=...))
parallel_fused.py     the tensor-parallel LayerNormLinear (column) and LayerNormMLP (fc1 column, fc2 row)
"""
from .amax_sync import delayed_quantizers, reduce_delayed_amaxes
from .collective_matmul import (all_gather_dgrad, all_gather_fprop, all_gather_matmul, dgrad_reduce_scatter,
                                fprop_reduce_scatter, matmul_reduce_scatter)
from .fp8_comm import all_gather_fp8, cast_consistent, gather_cast, reduce_amax, transpose_rows
from .fsdp import FP8GatherWeight, fp8_all_gather, precompute_fp8_weight_scales
from .groups import AmaxReduction
from .tp_config import ParallelMode, TPConfig
from .tp_state import ShardSpec, TPLayout

__all__ = [
    "all_gather_dgrad", "all_gather_fprop", "all_gather_matmul", "dgrad_reduce_scatter", "fprop_reduce_scatter",
    "matmul_reduce_scatter", "AmaxReduction", "all_gather_fp8", "cast_consistent", "delayed_quantizers", "gather_cast", "reduce_amax",
    "reduce_delayed_amaxes", "transpose_rows", "ParallelMode", "TPConfig", "ShardSpec", "TPLayout", "FP8GatherWeight",
    "fp8_all_gather", "precompute_fp8_weight_scales",
]
