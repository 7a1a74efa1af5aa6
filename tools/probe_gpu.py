"""One-off probe of torch._scaled_mm and Triton fp8 behaviour on the GPU machine."""
import torch, triton, triton.language as tl
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
dev = "cuda"
e4 = torch.float8_e4m3fn
def mk(m, k):
    return torch.randn(m, k, device=dev).to(e4)
one = torch.tensor(1.0, device=dev)
def tryit(name, fn):
    try:
        r = fn(); print("OK  ", name, getattr(r, "shape", r))
    except Exception as e:
        print("FAIL", name, str(e).splitlines()[0][:200])
tryit("M=24", lambda: torch._scaled_mm(mk(24, 64), mk(32, 64).t(), one, one, out_dtype=torch.bfloat16))
tryit("M=7", lambda: torch._scaled_mm(mk(7, 64), mk(32, 64).t(), one, one, out_dtype=torch.bfloat16))
tryit("K=40", lambda: torch._scaled_mm(mk(32, 40), mk(32, 40).t(), one, one, out_dtype=torch.bfloat16))
tryit("N=40", lambda: torch._scaled_mm(mk(32, 64), mk(40, 64).t(), one, one, out_dtype=torch.bfloat16))
tryit("N=24", lambda: torch._scaled_mm(mk(32, 64), mk(24, 64).t(), one, one, out_dtype=torch.bfloat16))
tryit("bias bf16 out bf16", lambda: torch._scaled_mm(mk(32, 64), mk(32, 64).t(), one, one, bias=torch.randn(32, device=dev, dtype=torch.bfloat16), out_dtype=torch.bfloat16))
tryit("bias fp32 out fp32", lambda: torch._scaled_mm(mk(32, 64), mk(32, 64).t(), one, one, bias=torch.randn(32, device=dev), out_dtype=torch.float32))
tryit("bias bf16 out fp32", lambda: torch._scaled_mm(mk(32, 64), mk(32, 64).t(), one, one, bias=torch.randn(32, device=dev, dtype=torch.bfloat16), out_dtype=torch.float32))
tryit("bias fp32 out bf16", lambda: torch._scaled_mm(mk(32, 64), mk(32, 64).t(), one, one, bias=torch.randn(32, device=dev), out_dtype=torch.bfloat16))
tryit("out fp16", lambda: torch._scaled_mm(mk(32, 64), mk(32, 64).t(), one, one, out_dtype=torch.float16))
tryit("e5m2 x e4m3", lambda: torch._scaled_mm(torch.randn(32, 64, device=dev).to(torch.float8_e5m2), mk(32, 64).t(), one, one, out_dtype=torch.bfloat16))
tryit("e4m3 x e5m2", lambda: torch._scaled_mm(mk(32, 64), torch.randn(32, 64, device=dev).to(torch.float8_e5m2).t(), one, one, out_dtype=torch.bfloat16))
tryit("e5m2 x e5m2", lambda: torch._scaled_mm(torch.randn(32, 64, device=dev).to(torch.float8_e5m2), torch.randn(32, 64, device=dev).to(torch.float8_e5m2).t(), one, one, out_dtype=torch.bfloat16))
tryit("A colmajor", lambda: torch._scaled_mm(mk(64, 32).t(), mk(32, 64).t(), one, one, out_dtype=torch.bfloat16))
tryit("B rowmajor", lambda: torch._scaled_mm(mk(32, 64), mk(64, 32), one, one, out_dtype=torch.bfloat16))
tryit("A rowslice stride", lambda: torch._scaled_mm(mk(32, 128)[:, :64], mk(32, 64).t(), one, one, out_dtype=torch.bfloat16))
tryit("scale 1-elem shape (1,)", lambda: torch._scaled_mm(mk(32, 64), mk(32, 64).t(), one.view(1), one.view(1), out_dtype=torch.bfloat16))
# fast accum numerics differ?
a = mk(256, 8192); b = mk(256, 8192)
f = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.float32, use_fast_accum=True)
s = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.float32, use_fast_accum=False)
ref = a.double() @ b.double().t()
print("fast vs slow equal:", torch.equal(f, s), "err fast", ((f.double()-ref).norm()/ref.norm()).item(), "err slow", ((s.double()-ref).norm()/ref.norm()).item())
# triton features
print("div_rn:", hasattr(tl.math, "div_rn"), "float8e4nv:", hasattr(tl, "float8e4nv"), "float8e5:", hasattr(tl, "float8e5"))
@triton.jit
def k(x_ptr, o_ptr, o2_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(o_ptr + offs, x.to(tl.float8e4nv), mask=m)
    tl.store(o2_ptr + offs, x.to(tl.float8e5), mask=m)
x = torch.arange(-2**15, 2**15, dtype=torch.int32, device=dev).to(torch.int16).view(torch.bfloat16).float()
x = torch.where(x.isfinite(), x.clamp(-448, 448), x)
o = torch.empty(x.shape, dtype=e4, device=dev); o2 = torch.empty(x.shape, dtype=torch.float8_e5m2, device=dev)
k[(triton.cdiv(x.numel(), 1024),)](x, o, o2, x.numel(), BLOCK=1024)
r = x.to(e4); r2 = x.clamp(-57344, 57344).to(torch.float8_e5m2)
print("triton e4m3 == torch:", torch.equal(o.view(torch.uint8), r.view(torch.uint8)), (o.view(torch.uint8) != r.view(torch.uint8)).sum().item())
print("triton e5m2 == torch:", torch.equal(o2.view(torch.uint8), r2.view(torch.uint8)), (o2.view(torch.uint8) != r2.view(torch.uint8)).sum().item())
bad = (o2.view(torch.uint8) != r2.view(torch.uint8)).nonzero().flatten()[:8]
print("e5m2 mismatches:", [(x[i].item(), o2[i].float().item(), r2[i].float().item()) for i in bad])
nan = torch.tensor([float('nan'), float('inf'), -float('inf')], device=dev)
print("torch nan/inf -> e4m3:", nan.to(e4).view(torch.uint8).tolist(), "e5m2:", nan.to(torch.float8_e5m2).view(torch.uint8).tolist())
o = torch.empty(3, dtype=e4, device=dev); o2 = torch.empty(3, dtype=torch.float8_e5m2, device=dev)
k[(1,)](nan, o, o2, 3, BLOCK=4)
print("triton nan/inf -> e4m3:", o.view(torch.uint8).tolist(), "e5m2:", o2.view(torch.uint8).tolist())
print(torch.cuda.get_device_properties(0))
