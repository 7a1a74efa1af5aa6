"""fp8train.distributed on CPU with gloo: FP8 all-gather, group-consistent scaling, delayed
amax reduction, and the collective matmuls against their non-overlapped references.

One process-group launch per world size (tests/gloo_harness.py: 2 and 4 processes, loopback
only) runs every case below; each rank records per case None or the traceback of its
failure, and each pytest test reads its case's records. Inputs are built from a seed per
case, so every rank can construct the full tensor and check its own share against it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fp8train import GemmConfig, gemm, scaling
from fp8train.distributed import (AmaxReduction, all_gather_dgrad, all_gather_fp8, all_gather_fprop,
                                  cast_consistent, dgrad_reduce_scatter, fprop_reduce_scatter, gather_cast,
                                  reduce_delayed_amaxes, transpose_rows)
from fp8train.quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer, update_delayed_scales
from fp8train.roles import TensorRole

import gloo_harness

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, F32 = torch.bfloat16, torch.float32
CFG = GemmConfig()
WORLDS = (2, 4)


# --------------------------------------------------------------------------- helpers


def _name(dtype) -> str:
    return {E4M3: "e4m3", E5M2: "e5m2", BF16: "bf16", F32: "fp32"}[dtype]


def _bytes_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _full(ctx, shape, dtype, *, loud_rank=None):
    """The same random tensor on every rank; rows of `loud_rank`'s chunk scaled up 8x so
    ranks' local amaxes differ."""
    g = torch.Generator().manual_seed(ctx.seed)
    t = torch.randn(shape, generator=g)
    if loud_rank is not None:
        m = shape[0] // ctx.world
        t[loud_rank * m:(loud_rank + 1) * m] *= 8
    return t.to(dtype)


def _mine(ctx, full):
    m = full.shape[0] // ctx.world
    return full[ctx.rank * m:(ctx.rank + 1) * m]


def _rank_tensor(ctx, shape, salt=0):
    """A different random tensor on every rank (weight shards)."""
    g = torch.Generator().manual_seed(ctx.seed + 7919 * (ctx.rank + 1) + salt)
    return torch.randn(shape, generator=g)


def _same_everywhere(t) -> bool:
    """t (a small tensor) is bit-identical on every rank."""
    flat = t.detach().reshape(-1).float().clone()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(flat, g) for g in gathered)


def _quantized(x, dtype, role=TensorRole.INPUT, transpose=False):
    return CurrentScalingQuantizer(role, dtype).cast(x, transpose=transpose)


def _reduce_scatter(t):
    out = torch.empty((t.shape[0] // dist.get_world_size(), *t.shape[1:]), dtype=t.dtype)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rs(out, t.contiguous())
    return out


class _CountAllReduce:
    """Counts torch.distributed.all_reduce calls while active (the library looks it up per call)."""

    def __enter__(self):
        self.count, self._orig = 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.count += 1
            return self._orig(*args, **kwargs)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _close(actual, reference, bound):
    """|actual - reference| <= bound elementwise (float64)."""
    err = (actual.double() - reference.double()).abs()
    excess = (err - bound).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess:.3g} (max error {err.max().item():.3g})"


def _magnitude(a, a_scale_inv, b, b_scale_inv):
    """|A| @ |B| of dequantized FP8 operands in float64: scales every rounding of A @ B."""
    return (a.float().abs() * a_scale_inv).double() @ (b.float().abs() * b_scale_inv).double()


def _out_rounding(reference, out_dtype):
    # one rounding of the result into out_dtype (bf16: 2^-8 relative), plus tiny absolute slack
    return (2.0**-8 if out_dtype == BF16 else 0.0) * reference.double().abs() + 1e-30


# --------------------------------------------------------------------------- cases


def case_all_gather_bytes(ctx, dtype, shape):
    # raw FP8 values; shape is one rank's, 2-D or 3-D (s, b, h) gathered along s
    full = (_full(ctx, (ctx.world * shape[0], *shape[1:]), F32) * 10).to(dtype)
    gathered = all_gather_fp8(_mine(ctx, full).contiguous())
    assert gathered.dtype == dtype and _bytes_equal(gathered, full)


def case_consistent_current_cast(ctx, dtype, in_dtype, m, k):
    full = _full(ctx, (ctx.world * m, k), in_dtype, loud_rank=ctx.world - 1)
    ref = _quantized(full, dtype)
    q = CurrentScalingQuantizer(TensorRole.INPUT, dtype)
    with _CountAllReduce() as calls:
        local = cast_consistent(_mine(ctx, full), q, transpose=True)
    assert calls.count == 1, f"{calls.count} all-reduces, expected 1"
    assert torch.equal(local.scale_inv, ref.scale_inv), "scale differs from the full tensor's"
    assert torch.equal(q.amax, full.float().abs().max()) and _same_everywhere(q.scale)
    assert _same_everywhere(local.scale_inv)
    assert _bytes_equal(local.data, _mine(ctx, ref.data))
    assert _bytes_equal(local.data_t, transpose_rows(local.data))  # this rank's padded transposed copy


def case_gather_cast(ctx, dtype, in_dtype, m, k, recipe):
    full = _full(ctx, (ctx.world * m, k), in_dtype, loud_rank=0)
    if recipe == "current":
        q, ref_q = CurrentScalingQuantizer(TensorRole.INPUT, dtype), CurrentScalingQuantizer(TensorRole.INPUT, dtype)
    else:  # fresh delayed quantizers: the first cast calibrates, from the group's amax here
        q, ref_q = (DelayedScalingQuantizer(TensorRole.INPUT, dtype, 4) for _ in range(2))
    ref = ref_q.cast(full, transpose=True)
    out = gather_cast(_mine(ctx, full), q, transpose=True)
    assert torch.equal(out.scale_inv, ref.scale_inv) and torch.equal(q.scale, ref_q.scale)
    assert _bytes_equal(out.data, ref.data), "gathered rows differ from the full tensor's cast"
    assert _bytes_equal(out.data_t, ref.data_t), "transposed gathered copy differs (padding included)"
    if recipe == "delayed":
        assert q.calibrated and torch.equal(q.amax_history[0], _mine(ctx, full).float().abs().max())


def case_delayed_reduction(ctx, two_groups):
    n, h = 5, 4
    qs = [DelayedScalingQuantizer(TensorRole.INPUT, E4M3, h) for _ in range(n)]
    table = torch.rand((ctx.world, n), generator=torch.Generator().manual_seed(ctx.seed)) * 100
    table[:, 0] = scaling.UNRECORDED           # nobody cast: stays unrecorded
    table[1:, 1] = scaling.UNRECORDED          # only rank 0 cast: its amax everywhere
    table[ctx.world - 1, 2] = torch.inf        # inf on one rank: discarded on every rank
    table[0, 3] = torch.nan                    # NaN counts as inf
    for q, v in zip(qs, table[ctx.rank]):
        q.amax_history[0] = v
        q.calibrated = True
    groups = None
    if two_groups:  # a 2 x 2 grid: TP {0,1} {2,3}, DP {0,2} {1,3}; every rank creates every group
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = AmaxReduction.tensor_and_data_parallel(tp[ctx.rank // 2], dp[ctx.rank % 2])
    with _CountAllReduce() as calls:
        reduce_delayed_amaxes(qs, groups)
    assert calls.count == (2 if two_groups else 1), f"{calls.count} all-reduces for {n} quantizers"
    expected = torch.where(torch.isnan(table), torch.inf, table).max(0).values
    got = torch.stack([q.amax_history[0] for q in qs])
    assert torch.equal(got, expected), f"{got} != {expected}"
    update_delayed_scales()
    assert _same_everywhere(torch.stack([q.scale for q in qs]))
    assert _same_everywhere(torch.stack([q.amax_history for q in qs]))


def case_delayed_steps_match_full_tensor(ctx, dtype):
    """Three steps of delayed scaling over the group give the scales a single process gets
    from casting the full tensor (history[0] = max of the local amaxes)."""
    m, k = 16, 32
    q, ref_q = (DelayedScalingQuantizer(TensorRole.INPUT, dtype, 3) for _ in range(2))
    for step in range(3):
        ctx_step = SimpleNamespace(**{**vars(ctx), "seed": ctx.seed + step})
        full = _full(ctx_step, (ctx.world * m, k), F32, loud_rank=step % ctx.world) * (step + 1)
        if step:
            reduce_delayed_amaxes([q])
            update_delayed_scales()  # both quantizers (and any other live ones) update
        local = cast_consistent(_mine(ctx, full), q)
        ref = ref_q.cast(full)
        assert torch.equal(local.scale_inv, ref.scale_inv), f"step {step}: scale differs from the full tensor's"
        assert _bytes_equal(local.data, _mine(ctx, ref.data))


def case_all_gather_fprop(ctx, m, k, n, out_dtype, bias):
    full = _full(ctx, (ctx.world * m, k), BF16, loud_rank=1)
    x = cast_consistent(_mine(ctx, full), CurrentScalingQuantizer(TensorRole.INPUT, E4M3))
    w = _quantized(_rank_tensor(ctx, (n, k)), E4M3, TensorRole.WEIGHT)
    b = _rank_tensor(ctx, (n,), salt=1).to(out_dtype) if bias else None
    y, x_all = all_gather_fprop(x.data, x.scale_inv, w.data, w.scale_inv, CFG, out_dtype, bias=b)
    ref_x = all_gather_fp8(x.data)
    ref = gemm.fprop(ref_x, x.scale_inv, w.data, w.scale_inv, CFG, out_dtype, b)
    assert _bytes_equal(x_all, ref_x) and y.dtype == out_dtype and y.shape == (ctx.world * m, n)
    magnitude = _magnitude(ref_x, x.scale_inv, w.data.t(), w.scale_inv)
    _close(y, ref, 2.0**-20 * magnitude + _out_rounding(ref, out_dtype))
    # wgrad reuses the gathered input: its transposed copy is the full tensor's (zero padded)
    assert _bytes_equal(transpose_rows(x_all), _quantized(full, E4M3, transpose=True).data_t)


def case_all_gather_dgrad(ctx, m, n, k, out_dtype):
    dy = cast_consistent(_mine(ctx, _full(ctx, (ctx.world * m, n), F32, loud_rank=0)),
                         CurrentScalingQuantizer(TensorRole.GRAD_OUTPUT, E5M2))
    w = _quantized(_rank_tensor(ctx, (n, k)), E4M3, TensorRole.WEIGHT, transpose=True)  # w.data_t (k, n)
    dx, dy_all = all_gather_dgrad(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, out_dtype)
    ref_dy = all_gather_fp8(dy.data)
    ref = gemm.dgrad(ref_dy, dy.scale_inv, w.data_t, w.scale_inv, CFG, out_dtype)
    assert _bytes_equal(dy_all, ref_dy) and dx.shape == (ctx.world * m, k)
    magnitude = _magnitude(ref_dy, dy.scale_inv, w.data, w.scale_inv)
    _close(dx, ref, 2.0**-20 * magnitude + _out_rounding(ref, out_dtype))


def _rs_bound(magnitude, ref, world, accum_dtype, out_dtype):
    """Each partial GEMM's own rounding (chunked rows may sum K in another order than the
    one full GEMM), then one rounding per reduce-scatter hop in accum_dtype."""
    eps = 2.0**-23 if accum_dtype == F32 else 2.0**-7
    abs_sum = _reduce_scatter(magnitude.float())
    return (2.0**-20 + world * eps) * abs_sum.double() + _out_rounding(ref, out_dtype)


def case_fprop_reduce_scatter(ctx, m, k, n, out_dtype, bias, accum_dtype):
    big_m = ctx.world * m
    x = _quantized(_rank_tensor(ctx, (big_m, k)), E4M3)
    w = _quantized(_rank_tensor(ctx, (n, k), salt=1), E4M3, TensorRole.WEIGHT)
    b = _full(ctx, (n,), out_dtype) if bias else None  # the same bias on every rank, added once
    y = fprop_reduce_scatter(x.data, x.scale_inv, w.data, w.scale_inv, CFG, out_dtype, bias=b,
                             accum_dtype=accum_dtype)
    partial = gemm.fprop(x.data, x.scale_inv, w.data, w.scale_inv, CFG, F32)
    ref32 = _reduce_scatter(partial) + (b.float() if bias else 0)
    assert y.dtype == out_dtype and y.shape == (m, n)
    magnitude = _magnitude(x.data, x.scale_inv, w.data.t(), w.scale_inv)
    _close(y, ref32, _rs_bound(magnitude, ref32, ctx.world, accum_dtype, out_dtype))


def case_dgrad_reduce_scatter(ctx, m, n, k, out_dtype):
    big_m = ctx.world * m
    dy = _quantized(_rank_tensor(ctx, (big_m, n)), E5M2, TensorRole.GRAD_OUTPUT)
    w = _quantized(_rank_tensor(ctx, (n, k), salt=1), E4M3, TensorRole.WEIGHT, transpose=True)
    dx = dgrad_reduce_scatter(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, out_dtype)
    partial = gemm.dgrad(dy.data, dy.scale_inv, w.data_t, w.scale_inv, CFG, F32)
    ref32 = _reduce_scatter(partial)
    assert dx.dtype == out_dtype and dx.shape == (m, k)
    magnitude = _magnitude(dy.data, dy.scale_inv, w.data, w.scale_inv)
    _close(dx, ref32, _rs_bound(magnitude, ref32, ctx.world, F32, out_dtype))


def case_rings_on_subgroup(ctx):
    """Both rings inside 2-rank subgroups of a 4-rank world ({0,1} and {2,3}): group ranks
    map to global ranks for the transfers, and results match the subgroup's collectives."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    tp = groups[ctx.rank // 2]
    m, k, n = 8, 32, 16
    x = _quantized(_rank_tensor(ctx, (m, k)), E4M3)
    w = _quantized(_rank_tensor(ctx, (n, k), salt=1), E4M3, TensorRole.WEIGHT)
    y, x_all = all_gather_fprop(x.data, x.scale_inv, w.data, w.scale_inv, CFG, F32, tp)
    ref_x = all_gather_fp8(x.data, tp)
    assert _bytes_equal(x_all, ref_x) and x_all.shape == (2 * m, k)
    ref = gemm.fprop(ref_x, x.scale_inv, w.data, w.scale_inv, CFG, F32)
    _close(y, ref, 2.0**-20 * _magnitude(ref_x, x.scale_inv, w.data.t(), w.scale_inv))
    y_rs = fprop_reduce_scatter(x.data, x.scale_inv, w.data, w.scale_inv, CFG, F32, tp)
    partial = gemm.fprop(x.data, x.scale_inv, w.data, w.scale_inv, CFG, F32)
    ref_rs = torch.empty((m // 2, n))
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rs(ref_rs, partial, group=tp)
    assert y_rs.shape == (m // 2, n)
    torch.testing.assert_close(y_rs, ref_rs, rtol=1e-5, atol=1e-4)


def case_reduce_scatter_needs_divisible_rows(ctx):
    x = _quantized(torch.randn(ctx.world * 4 + 1, 16), E4M3)
    w = _quantized(torch.randn(16, 16), E4M3, TensorRole.WEIGHT)
    with pytest.raises(ValueError, match="do not split evenly"):
        fprop_reduce_scatter(x.data, x.scale_inv, w.data, w.scale_inv, CFG, F32)


def _cases():
    """(id, function, kwargs, worlds) of every case."""
    out = []

    def add(fn, worlds=WORLDS, **kw):
        parts = [fn.__name__[len("case_"):]] + [
            _name(v) if isinstance(v, torch.dtype) else ("x".join(map(str, v)) if isinstance(v, tuple) else f"{k}{v}")
            for k, v in kw.items()]
        out.append(("-".join(parts), fn, kw, worlds))

    for dtype in (E4M3, E5M2):
        for shape in ((16, 32), (5, 48), (6, 3, 16)):
            add(case_all_gather_bytes, dtype=dtype, shape=shape)
    for dtype, in_dtype, m, k in ((E4M3, BF16, 16, 64), (E5M2, F32, 7, 32), (E4M3, F32, 33, 16)):
        add(case_consistent_current_cast, dtype=dtype, in_dtype=in_dtype, m=m, k=k)
    for recipe in ("current", "delayed"):
        for dtype, in_dtype, m, k in ((E4M3, BF16, 16, 32), (E5M2, F32, 5, 48)):
            add(case_gather_cast, dtype=dtype, in_dtype=in_dtype, m=m, k=k, recipe=recipe)
    add(case_delayed_reduction, two_groups=False)
    add(case_delayed_reduction, worlds=(4,), two_groups=True)
    for dtype in (E4M3, E5M2):
        add(case_delayed_steps_match_full_tensor, dtype=dtype)
    for m, k, n, out_dtype, bias in ((16, 32, 48, BF16, True), (5, 64, 16, F32, False), (24, 16, 32, BF16, False)):
        add(case_all_gather_fprop, m=m, k=k, n=n, out_dtype=out_dtype, bias=bias)
    for m, n, k, out_dtype in ((16, 48, 32, BF16), (7, 16, 64, F32)):
        add(case_all_gather_dgrad, m=m, n=n, k=k, out_dtype=out_dtype)
    for m, k, n, out_dtype, bias, accum in ((16, 32, 48, BF16, True, F32), (3, 16, 32, F32, False, F32),
                                            (8, 32, 16, BF16, False, BF16)):
        add(case_fprop_reduce_scatter, m=m, k=k, n=n, out_dtype=out_dtype, bias=bias, accum_dtype=accum)
    for m, n, k, out_dtype in ((16, 32, 48, BF16), (5, 16, 32, F32)):
        add(case_dgrad_reduce_scatter, m=m, n=n, k=k, out_dtype=out_dtype)
    add(case_rings_on_subgroup, worlds=(4,))
    add(case_reduce_scatter_needs_divisible_rows)
    return out


CASES = _cases()


# --------------------------------------------------------------------------- launch


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return gloo_harness.cached_launcher(tmp_path_factory, __name__, "METRICS")


@pytest.mark.parametrize("world, case_id", gloo_harness.world_params(CASES, WORLDS))
def test_case(launches, world, case_id):
    gloo_harness.check(launches(world)[0], case_id)
