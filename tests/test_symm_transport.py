"""symm_transport on CPU: the copy-engine path is CUDA-only (usable() is False off CUDA, so the
gloo tests keep exercising the NCCL-style ring), and nccl_transport() nests and restores.
The copy-engine path itself runs in tests/gpu/test_distributed_gpu.py (two GPUs, beside the
NCCL ring) and in the TP layer tests with tp_overlap (tests/gpu/test_tp_nccl_gpu.py)."""
import torch

from fp8train.distributed import symm_transport


def test_off_cuda_the_ring_stays():
    assert not symm_transport.usable(None, torch.device("cpu"))


def test_nccl_transport_nests_and_restores():
    assert not symm_transport._forced_nccl
    with symm_transport.nccl_transport():
        assert symm_transport._forced_nccl
        with symm_transport.nccl_transport():
            assert symm_transport._forced_nccl
        assert symm_transport._forced_nccl
    assert not symm_transport._forced_nccl
