"""The checkpoint methods of layers that may be tensor-parallel (distributed/tp_state.py does
the work; docs/distributed.md describes the layouts)."""
from __future__ import annotations

from typing import Optional

from ..distributed import tp_state
from ..distributed.tp_state import TPLayout


class TPCheckpoints:
    """Mixin for FP8Module layers: full and sharded (DCP) state dicts. An unsharded layer
    (`tp_layout()` None) answers with its plain state_dict() / load_state_dict()."""

    def tp_layout(self) -> Optional[TPLayout]:
        """How this layer's parameters are sharded (None: not tensor-parallel)."""
        raise NotImplementedError

    def full_state_dict(self) -> dict:
        """The unsharded layer's state_dict (collective: call on every rank of the TP group).
        Sharded parameters are gathered; replicated ones and quantizer state are this rank's."""
        layout = self.tp_layout()
        return self.state_dict() if layout is None else tp_state.full_state_dict(self, layout)

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Load an unsharded layer's state_dict: sharded parameters are sliced into this
        rank's shards (no communication); everything else is loaded as is."""
        layout = self.tp_layout()
        if layout is None:
            return self.load_state_dict(state_dict, strict=strict)
        return tp_state.load_full_state_dict(self, state_dict, layout, strict)

    def sharded_state_dict(self) -> dict:
        """This rank's state for torch.distributed.checkpoint: sharded parameters as DTensors
        [Shard(dim)] over the TP group's DeviceMesh, replicated ones [Replicate()], quantizer
        state per rank. Their local tensors share storage with the layer, so dcp.load(sd)
        fills it in place; then call load_sharded_state_dict(sd). Quantizers are created by
        the first FP8 forward: only existing ones are in the dict (and restored)."""
        layout = self.tp_layout()
        return self.state_dict() if layout is None else tp_state.sharded_state_dict(self, layout)

    def load_sharded_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a state dict of sharded_state_dict()'s layout (filled by dcp.load)."""
        layout = self.tp_layout()
        if layout is None:
            return self.load_state_dict(state_dict, strict=strict)
        return tp_state.load_sharded_state_dict(self, state_dict, layout, strict)
