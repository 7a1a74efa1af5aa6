"""Tensor and GEMM roles: the names every other module uses instead of strings or indices."""
from __future__ import annotations

import enum


class TensorRole(enum.Enum):
    """Which tensor of a linear layer a quantizer or Float8Tensor belongs to."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"

    @property
    def is_forward(self) -> bool:
        return self is not TensorRole.GRAD_OUTPUT


class GemmRole(enum.Enum):
    """The three GEMMs of a linear layer (see docs/design.md for their layouts).

    FPROP  Y  = X  @ W^T
    DGRAD  dX = dY @ W
    WGRAD  dW = dY^T @ X
    """

    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"
