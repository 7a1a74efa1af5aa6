"""benchmarks/gemm.py on the CPU: its block operands are what gemm.block_scaled_mm takes and
multiply out to x @ w^T, and its problems are a Llama layer's GEMMs (it times on the GPU only)."""
from __future__ import annotations


import pytest
import torch

import gemm as gemm_bench  # noqa: E402

from fp8train import gemm  # noqa: E402


@pytest.mark.parametrize("bt_block", [gemm.TILE, gemm.ROW])
@pytest.mark.parametrize("m,k,n", [(256, 384, 200), (72, 300, 128)])
def test_block_operands_multiply_out_to_the_product(bt_block, m, k, n):
    torch.manual_seed(0)
    x, w, a, sa, b, sb = gemm_bench.operands(m, k, n, bt_block, torch.device("cpu"))
    y = gemm.block_scaled_mm(a, sa, b, sb, bt_block, out_dtype=torch.float32)
    ref = x.double() @ w.double().t()
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (y.double() - ref).pow(2).sum())
    assert sqnr > 25, sqnr  # e4m3 operands: ~30 dB on Gaussian data (docs/user-guide.md, 28.7-29.0 dB)
    assert gemm_bench.check(y, y) == 0 and gemm_bench.check(y * 1.01, y) == pytest.approx(0.01, rel=1e-3)


def test_problems_are_a_layers_gemms():
    t = gemm_bench.TOKENS
    for hidden, ffn, kv in gemm_bench.SHAPES.values():
        layer = gemm_bench.linears(hidden, ffn, kv)
        assert {(i, o) for _, i, o in layer} == {(hidden, hidden), (hidden, kv), (hidden, ffn), (ffn, hidden),
                                                  (hidden, hidden + 2 * kv), (hidden, 2 * ffn)}
        names = {name: (i, o) for name, i, o in layer}
        # a layer's seven Linears, separate or with the siblings that read one input stacked
        for count in (gemm_bench.LAYER_SEPARATE, gemm_bench.LAYER_STACKED):
            ins, outs = {}, 0
            for name, n in count.items():
                outs += n * names[name][1]
                ins[names[name][0]] = ins.get(names[name][0], 0) + n * names[name][1]
            assert outs == 2 * hidden + 2 * kv + 2 * ffn + hidden
            assert ins == {hidden: 2 * hidden + 2 * kv + 2 * ffn, ffn: hidden}
        for _, k_in, n_out in layer:
            problems = {role: (m, k, n, block) for role, m, k, n, block, _ in gemm_bench.gemms(k_in, n_out)}
            assert problems == {"fprop": (t, k_in, n_out, gemm.TILE), "dgrad": (t, n_out, k_in, gemm.TILE),
                                "wgrad": (n_out, t, k_in, gemm.ROW)}
