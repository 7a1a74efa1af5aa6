"""Probe (delete when answered): why fp8-gather's device time doubles at N=1 (torchrun, 1 GPU)."""
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fsdp, hf_llama  # noqa: E402
from fp8train.data import ByteCorpus  # noqa: E402
import fp8train  # noqa: E402

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
shape = hf_llama.SHAPES["h1024"]
corpus = ByteCorpus.from_stdlib(max_bytes=2_000_000)
g = torch.Generator().manual_seed(1000)
batches = [tuple(t.to(dev) for t in corpus.batch("train", shape.batch, shape.seq, g)) for _ in range(4)]
for v in sys.argv[1:]:
    r = fsdp.Runner(v, shape, dev, batches)
    paths = fp8train.inspect.execution_paths(r.model) if v.startswith("fp8") else {}
    print("==", v, sorted(set(paths.values())))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            r.step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:30]
    for e in rows:
        print(f"  {e.key[:60]:60s} self {e.self_cpu_time_total / 3e3:7.2f} ms  total {e.cpu_time_total / 3e3:7.2f} ms  n {e.count // 3}")
    del r
dist.destroy_process_group()
