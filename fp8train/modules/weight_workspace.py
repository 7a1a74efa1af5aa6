"""The FP8 copy of a weight that a layer owns and rewrites in place."""
from __future__ import annotations

from typing import Optional

import torch

from ..quantizer import Quantizer
from ..tensor import Float8Tensor


class WeightWorkspace:
    """One Float8Tensor per weight, allocated once and re-cast in place.

    is_first_microbatch  True: cast (and transpose) and keep the result;
                         False: reuse what was kept, no cast at all;
                         None: cast on every call.
    The Float8Tensor carries its own scale_inv, written by the same kernel as its data, so a
    later scale update of the quantizer can never desynchronise the cached payload.
    """

    def __init__(self):
        self.fp8: Optional[Float8Tensor] = None

    def get(self, weight: torch.Tensor, quantizer: Quantizer, is_first_microbatch: Optional[bool],
            need_transpose: bool, skip: Optional[torch.Tensor] = None) -> Float8Tensor:
        """skip: the device flag of a graphed layer with FP8 weight caching (graphs.py): the
        cast is issued on every call and the kernels skip it while the flag is nonzero."""
        ws = self.fp8
        fits = (ws is not None and ws.shape == weight.shape and ws.device == weight.device
                and ws.dtype == weight.dtype and ws.fp8_dtype == quantizer.dtype)
        if is_first_microbatch is False and fits:
            return ws  # the transposed copy, if missing, is built from the FP8 payload on demand
        if fits:
            quantizer.requantize(weight, ws, transpose=need_transpose, skip=skip)
        else:
            self.fp8 = quantizer.quantize(weight, transpose=need_transpose)
        return self.fp8
