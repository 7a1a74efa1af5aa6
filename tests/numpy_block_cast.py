"""The block-scaled FP8 cast (kernels/block_reference.py's specification) written again in
numpy, block by block, with ml_dtypes for the rounding: the independent reference of the
block-cast and block-scaling tests (CPU only: ml_dtypes is a dev dependency)."""
import ml_dtypes
import numpy as np
import torch

from fp8train import scaling

FORMATS = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}


def numpy_block_cast(x: torch.Tensor, dtype, block, power_of_two=False):
    """The specification written again in numpy, block by block: (bytes, scale_inv)."""
    xf = x.float().numpy()
    m = np.float32(scaling.fp8_max(dtype))
    rows, cols = xf.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    out = np.empty(xf.shape, dtype=np.uint8)
    scale_inv = np.empty((nr, nc), dtype=np.float32)
    for i in range(nr):
        for j in range(nc):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            with np.errstate(invalid="ignore"):
                a = np.abs(xf[sl]).astype(np.float64)
            amax = np.inf if np.isnan(a).any() else a.max()
            if 0 < amax < np.inf:
                with np.errstate(over="ignore"):
                    s = np.float32(m / np.float32(amax))  # IEEE float32 division
                s = np.float32(min(max(s, np.float32(2.0**-126)), np.float32(2.0**126)))
                if power_of_two:
                    s = np.float32(2.0 ** (np.frexp(s)[1] - 1))
            else:
                s = np.float32(1.0)
            with np.errstate(all="ignore"):
                y = np.clip(xf[sl] * s, -m, m)
            out[sl] = y.astype(FORMATS[dtype]).view(np.uint8)
            scale_inv[i, j] = np.float32(1.0) / s
    return out, scale_inv


def numpy_dequantized(x: torch.Tensor, dtype, block, power_of_two: bool = False) -> torch.Tensor:
    """x (rows, cols) cast by numpy_block_cast and multiplied back by its scale_inv, in float64:
    what a block-scaled GEMM operand stands for."""
    q, scale_inv = numpy_block_cast(x, dtype, block, power_of_two)
    values = q.view(FORMATS[dtype]).astype(np.float64)
    per_element = np.repeat(np.repeat(scale_inv.astype(np.float64), block[0], 0), block[1], 1)
    return torch.from_numpy(values * per_element[: x.shape[0], : x.shape[1]])
