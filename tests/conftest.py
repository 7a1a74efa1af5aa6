import subprocess
import sys
import zlib

import pytest
import torch

pytest_plugins = ["tiers"]  # the make test / make test-all tiers


def pytest_sessionstart(session):
    # Under xdist, the C++ extension's first build (~45 s on CI's two cores, cold) held one
    # worker while the other waited on torch's build lock: the controller starts the build
    # at once in a process of its own, beside the workers' first tests, and the workers that
    # need the extension load what it built (or wait on the same lock for the rest of it).
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    from fp8train.kernels import native
    if native._needs_build():
        config._fp8train_build = subprocess.Popen(
            [sys.executable, "-c", "from fp8train.kernels import native; native.extension()"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session):
    build = getattr(session.config, "_fp8train_build", None)
    if build is not None:
        build.wait()


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

