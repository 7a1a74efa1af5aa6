"""fp8train.make_graphed_callables where no GPU is: a clear error (the graphs themselves are
tested on the GPU, tests/gpu/test_graphs_gpu.py)."""
import pytest
import torch

import fp8train


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        fp8train.make_graphed_callables(fp8train.Linear(16, 16), (torch.randn(2, 16),))
