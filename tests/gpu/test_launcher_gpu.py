"""DirectKernel (fp8train/kernels/launcher.py) on the GPU: launches through the cached binary
must compute exactly what Triton's own launch path computes, for every specialization Triton
makes (pointer alignment, integers equal to 1 or divisible by 16), and step aside for hooks."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fp8train.kernels import cast, reference  # noqa: E402
from fp8train.kernels.launcher import DirectKernel  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
E4M3 = torch.float8_e4m3fn


def cast_both(x: torch.Tensor):
    """Triton (via DirectKernel) and the reference twin on the same input: (got, want) fp8."""
    scale = torch.tensor(3.0, device=DEV)
    got = torch.full(x.shape, 0x5A, dtype=torch.uint8, device=DEV).view(E4M3)
    want = torch.empty_like(got)
    cast.cast_amax(x, got, scale, torch.empty((), device=DEV))
    reference.cast_amax(x, want, scale.clone(), torch.empty((), device=DEV))
    return got.view(torch.uint8), want.view(torch.uint8)


@pytest.mark.parametrize("n", [1, 16, 17, 4096, 4097 * 3])
def test_direct_launches_match_the_reference_at_every_alignment(n):
    """The same sizes from 16-byte-aligned and misaligned addresses, aligned first, so a
    binary specialized for alignment would be reused wrongly if the key missed it."""
    base = torch.randn(n + 8, device=DEV).to(torch.bfloat16)
    for offset in (0, 1, 3, 8, 0, 1):  # bf16 elements: 0 and 8 are 16-byte aligned
        got, want = cast_both(base[offset:offset + n])
        assert torch.equal(got, want), f"n={n} offset={offset}"


def test_binaries_are_cached_per_specialization():
    """A fresh DirectKernel: one binary per alignment class, reused on repeated launches."""
    k = DirectKernel(cast._flat_kernel, num_warps=4, FP8_MAX=448.0, CAST=True, AMAX=False, FROM_AMAX=False,
                     FROM_ROWS=False, COUNT=False, POW2=False, SKIP=False, OWN_AMAX=False, BLOCK=64)
    base = torch.randn(4096 + 8, device=DEV).to(torch.bfloat16)
    scale, scale_inv = torch.tensor(2.0, device=DEV), torch.empty((), device=DEV)
    for offset in (0, 0, 8, 1, 1, 3):  # 0 and 8: 16-byte aligned; 1 and 3: not
        x = base[offset:offset + 4096]
        out = torch.empty(4096, dtype=E4M3, device=DEV)
        # amax, from_amax, count, skip, rows_amax and the barrier unused
        k(4, x, out, scale, scale_inv, scale, scale, scale, scale, 4096, scale, 0, scale)
        want = torch.empty_like(out)
        reference.cast_amax(x, want, scale.clone(), torch.empty((), device=DEV))
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"offset={offset}"
    assert len(k._binaries) == 2


def test_launch_hooks_see_every_launch():
    """With a profiler hook installed, launches go through Triton, which calls the hook."""
    knobs = pytest.importorskip("triton.knobs")
    seen = []
    x = torch.randn(1000, device=DEV).to(torch.bfloat16)
    cast_both(x)  # binary cached
    saved = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = lambda metadata: seen.append(metadata)
    try:
        got, want = cast_both(x)
    finally:
        knobs.runtime.launch_enter_hook = saved
    assert torch.equal(got, want) and len(seen) == 1


def test_constexprs_must_be_the_trailing_parameters():
    with pytest.raises(ValueError, match="trailing"):
        DirectKernel(cast._flat_kernel, num_warps=4, BLOCK=64)
    k = DirectKernel(cast._flat_kernel, num_warps=4, FP8_MAX=448.0, CAST=True, AMAX=False, FROM_AMAX=False,
                     FROM_ROWS=False, COUNT=False, POW2=False, SKIP=False, OWN_AMAX=False, BLOCK=64)
    with pytest.raises(TypeError, match="runtime arguments"):
        k(1, torch.empty(1, device=DEV))


def test_launches_on_a_side_stream_run_on_that_stream():
    x = torch.randn(1 << 20, device=DEV).to(torch.bfloat16)
    cast_both(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the side stream is busy; a cast on the wrong stream would run first
        out = torch.zeros(x.shape, dtype=E4M3, device=DEV)
        cast.cast_amax(x, out, torch.tensor(1.0, device=DEV), torch.empty((), device=DEV))
        done = out.view(torch.uint8).ne(0).sum()
    torch.cuda.current_stream().wait_stream(side)
    assert done.item() > 0  # zero if the cast ran on another stream, before the side stream's zeros


@pytest.mark.parametrize("transpose", [False, True], ids=["rowmajor", "transposed"])
@pytest.mark.parametrize("shape", [(256, 1024), (37, 48)], ids=str)
def test_prepared_cast_matches_the_reference_on_every_call(shape, transpose):
    """A PreparedCast fixed at the first call, then fed fresh inputs at other alignments and
    fresh output buffers: every call equals the reference cast, delayed and current scaling."""
    m, n = shape
    mp = -(-m // 16) * 16
    base = torch.randn(m * n + 8, device=DEV).to(torch.bfloat16)
    history = torch.full((4,), -1.0, device=DEV)
    for mode in ("delayed", "current"):
        scale = torch.tensor(0.75, device=DEV)
        amax_buf = torch.zeros((), device=DEV)
        count = torch.zeros((), dtype=torch.int32, device=DEV)

        def buffers():
            return (torch.empty(m, n, dtype=E4M3, device=DEV),
                    torch.empty(n, mp, dtype=E4M3, device=DEV) if transpose else None,
                    torch.empty(1, device=DEV))
        x0 = base[:m * n].view(m, n)
        out, out_t, si = buffers()
        if mode == "delayed":
            fixed = dict(amax_out=history[0])
        else:
            fixed = dict(from_amax=amax_buf, nonfinite_count=count)
        prepared = cast.PreparedCast(x0, out, out_t, scale, si, **fixed)
        for offset in (0, 1, 8, 3, 0):
            x = base[offset:offset + m * n].view(m, n)
            out, out_t, si = buffers()
            want = torch.empty_like(out)
            want_t = torch.empty_like(out_t) if transpose else None
            want_scale, want_si = scale.clone(), torch.empty(1, device=DEV)
            if mode == "current":
                amax_buf.zero_()
                cast.amax(x, amax_buf)
                assert amax_buf.item() == reference.abs_max(x).item()
                from_amax = amax_buf.clone()
            else:
                from_amax = None
            if transpose:
                reference.cast_transpose_amax(x, want, want_t, want_scale, want_si, from_amax=from_amax)
            else:
                reference.cast_amax(x, want, want_scale, want_si, from_amax=from_amax)
            prepared(x, out, out_t, si)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"{mode} offset={offset}"
            if transpose:
                assert torch.equal(out_t.view(torch.uint8), want_t.view(torch.uint8)), f"{mode} offset={offset}"
            assert torch.equal(si, want_si) and torch.equal(scale, want_scale)
        if mode == "delayed":
            assert history[0].item() == reference.abs_max(base).item()  # every call max-accumulated


def _inputs(shape, dtype, seed):
    """Fresh inputs of one shape: random, with NaN, with +-inf, all zeros, one huge value."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=DEV) * 7
    nan, inf, huge = x.clone(), x.clone(), x.clone()
    nan.view(-1)[nan.numel() // 3] = float("nan")
    inf.view(-1)[-1] = -float("inf")
    huge.view(-1)[0] = 3e38 if dtype == torch.float32 else 6e4
    return [t.to(dtype) for t in (x, nan, x * 0, inf, huge, x / 1000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape, transpose, dbias", [
    ((256, 1024), True, False), ((37, 48), True, False), ((333, 48), True, True), ((8192, 1024), True, False),
    ((77, 4096), False, False), ((1000, 272), False, True), ((1, 16), False, False), ((8192, 2816), False, False),
], ids=str)
def test_one_launch_current_cast_matches_the_reference(shape, transpose, dbias, dtype):
    """PreparedCast(own_amax=True): current scaling's amax and cast in one cooperative launch
    (a grid-wide barrier between them) against the twin's amax, then cast, call after call
    on fresh inputs (the barrier resets itself), with NaN, inf, zero and huge inputs: data,
    transposed copy, scale_inv, dbias, and the state (amax, scale, nonfinite count) bit for bit."""
    m, n = shape
    mp = -(-m // 16) * 16
    scale, amax_buf = torch.tensor(0.75, device=DEV), torch.full((), -5.0, device=DEV)
    count = torch.zeros((), dtype=torch.int32, device=DEV)
    want_scale, want_amax, want_count = scale.clone(), amax_buf.clone(), count.clone()

    def buffers():
        return (torch.empty(m, n, dtype=E4M3, device=DEV),
                torch.empty(n, mp, dtype=E4M3, device=DEV) if transpose else None, torch.empty(1, device=DEV),
                torch.empty(n, device=DEV) if dbias else None)
    xs = _inputs(shape, dtype, seed=m + n)
    out, out_t, si, _ = buffers()
    prepared = cast.PreparedCast(xs[0], out, out_t, scale, si, from_amax=amax_buf, nonfinite_count=count,
                                 dbias=dbias, own_amax=True)
    assert prepared._binary is not None and prepared._binary.metadata.launch_cooperative_grid
    for i, x in enumerate(xs + xs[:2]):
        out, out_t, si, db = buffers()
        prepared(x, out, out_t, si, db)
        want, want_t, want_si, want_db = buffers()
        want_amax.copy_(reference.abs_max(x))
        if transpose:
            reference.cast_transpose_amax(x, want, want_t, want_scale, want_si, from_amax=want_amax,
                                          nonfinite_count=want_count, dbias_out=want_db)
        else:
            reference.cast_amax(x, want, want_scale, want_si, from_amax=want_amax, nonfinite_count=want_count,
                                dbias_out=want_db)
        for name, g, w in (("data", out, want), ("data_t", out_t, want_t), ("scale_inv", si, want_si),
                           ("amax", amax_buf, want_amax), ("scale", scale, want_scale), ("count", count, want_count)):
            if w is not None:
                assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), \
                    f"{name}, input {i}"
        if dbias:
            torch.testing.assert_close(db, want_db, rtol=1e-5, atol=1e-3, equal_nan=True)
    assert count.item() == 3  # NaN twice, -inf once
    sync = prepared._make_args(x, out, out_t, si, prepared.partial)[-1]  # the barrier's arrivals
    assert sync.dtype == torch.int64 and sync.item() == len(xs + xs[:2]) * prepared._grid


def test_one_launch_current_cast_replays_in_a_cuda_graph():
    """The cooperative launch captured in a CUDA graph and replayed on new contents of its
    input: each replay computes that input's amax and scale (the barrier's state survives
    replays)."""
    x = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16)
    scale, amax_buf = torch.ones((), device=DEV), torch.zeros((), device=DEV)
    out, out_t, si = (torch.empty(4096, 1024, dtype=E4M3, device=DEV), torch.empty(1024, 4096, dtype=E4M3, device=DEV),
                      torch.empty(1, device=DEV))
    prepared = cast.PreparedCast(x, out, out_t, scale, si, from_amax=amax_buf, own_amax=True)
    prepared(x, out, out_t, si)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared(x, out, out_t, si)
    for k in range(1, 5):
        x.copy_(torch.randn_like(x) * k)
        graph.replay()
        want, want_t, want_si, want_scale = torch.empty_like(out), torch.empty_like(out_t), torch.empty(1, device=DEV), \
            scale.clone()
        reference.cast_transpose_amax(x, want, want_t, want_scale, want_si, from_amax=reference.abs_max(x))
        assert amax_buf.item() == reference.abs_max(x).item()
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)) and torch.equal(si, want_si)
        assert torch.equal(out_t.view(torch.uint8), want_t.view(torch.uint8))
