import sys
import zlib
from pathlib import Path

import pytest
import torch

# The benchmark scripts are importable by name (`import hf_llama`): tests build the models they
# time and run their entry points on CPU.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytest_plugins = ["tiers"]  # the make test / make test-all tiers


def fp8_gpu_reason():
    """Why GPU tests cannot run here, or None when they can (one capability check)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"{torch.cuda.get_device_name()} has no FP8 tensor cores (needs sm_89+)"
    return None


def pytest_collection_modifyitems(config, items):
    # A failed CUDA graph capture leaves the CUDA RNG and allocator in capture state and would
    # fail every later GPU test: run captures last.
    items.sort(key=lambda item: "cuda_graph" in item.name)
    reason = fp8_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded(request):
    # Different random inputs for every test, reproducible per test id.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Run a test on CPU (reference kernels, emulated GEMMs) and, as a `gpu` test, on CUDA."""
    return torch.device(request.param)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test (its frame counters are cumulative)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def native_extension():
    """The C++ extension, built: a test of the C++ nodes fails (not skips) where it did not build."""
    from fp8train.kernels import native
    ext = native.extension()
    if ext is None:
        pytest.fail(f"the C++ extension did not build: {native.failure()}")
    return ext
