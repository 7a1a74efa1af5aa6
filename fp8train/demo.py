"""`fp8train demo`: the same small MLP trained in BF16 and in FP8 (both recipes), side by side.

A fixed synthetic regression task: inputs x ~ N(0, 1), targets from a frozen random "teacher"
MLP plus noise. The student is LayerNorm -> Linear -> GELU -> Linear, FP32 master weights,
BF16 activations (torch.autocast), Adam. Every run starts from the same weights and sees the
same batches; the table compares final losses and throughput.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import List

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from . import CurrentScaling, DelayedScaling, Linear, autocast


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    hidden: int
    ffn: int
    tokens: int
    steps: int
    lr: float = 1e-3
    seed: int = 0


PRESETS = {
    "cpu": DemoConfig(hidden=128, ffn=512, tokens=256, steps=300),
    "cuda": DemoConfig(hidden=1024, ffn=4096, tokens=4096, steps=300),
}


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = Linear(hidden, ffn)
        self.fc2 = Linear(ffn, hidden)

    def forward(self, x):  # (T, H) -> (T, H)
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def make_task(cfg: DemoConfig, device: torch.device):
    """Frozen teacher and a generator of (x, y) batches, identical for every run."""
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    w1 = torch.randn(cfg.hidden, cfg.hidden, generator=g) / cfg.hidden**0.5
    w2 = torch.randn(cfg.hidden, cfg.hidden, generator=g) / cfg.hidden**0.5
    w1, w2 = w1.to(device), w2.to(device)

    def batch(step: int):
        gs = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + step)
        x = torch.randn(cfg.tokens, cfg.hidden, generator=gs).to(device)
        noise = 0.01 * torch.randn(cfg.tokens, cfg.hidden, generator=gs).to(device)
        return x, torch.tanh(x @ w1) @ w2 + noise

    return batch


@dataclasses.dataclass
class RunResult:
    name: str
    train_loss: float
    val_loss: float
    tokens_per_s: float
    losses: List[float]


def run(name: str, recipe, cfg: DemoConfig, device: torch.device, init_state: dict, batch) -> RunResult:
    model = MLP(cfg.hidden, cfg.ffn).to(device)
    model.load_state_dict(init_state)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    fp8 = recipe is not None
    losses = []
    val_x, val_y = batch(-1)
    start = time.perf_counter()
    for step in tqdm(range(cfg.steps), desc=f"{name:>14}", leave=False, dynamic_ncols=True):
        x, y = batch(step)
        with torch.autocast(device.type, dtype=torch.bfloat16), autocast(enabled=fp8, recipe=recipe):
            loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16), autocast(enabled=fp8, recipe=recipe):
        val = F.mse_loss(model(val_x).float(), val_y).item()
    losses = torch.stack(losses).tolist()
    tail = losses[-max(1, cfg.steps // 10):]
    return RunResult(name, sum(tail) / len(tail), val, cfg.steps * cfg.tokens / elapsed, losses)


def main(argv=None) -> List[RunResult]:
    p = argparse.ArgumentParser(prog="fp8train demo", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    preset = PRESETS["cuda" if device.type == "cuda" else "cpu"]
    cfg = dataclasses.replace(preset, **{k: v for k, v in vars(args).items()
                                         if k in ("steps", "hidden", "ffn", "tokens", "seed") and v is not None})
    torch.manual_seed(cfg.seed)
    init_state = MLP(cfg.hidden, cfg.ffn).to(device).state_dict()
    batch = make_task(cfg, device)
    print(f"fp8train demo: LayerNorm -> Linear({cfg.hidden}->{cfg.ffn}) -> GELU -> Linear({cfg.ffn}->{cfg.hidden}), "
          f"{cfg.tokens} tokens/step, {cfg.steps} steps, Adam lr={cfg.lr}, device={device}")
    results = [run(name, recipe, cfg, device, init_state, batch) for name, recipe in
               (("bf16", None), ("fp8 delayed", DelayedScaling()), ("fp8 current", CurrentScaling()))]
    print_table(results)
    if device.type == "cpu":
        print("(on CPU the FP8 GEMMs run as torch's float32 emulation: tokens/s and speedup say nothing about FP8)")
    return results


def print_table(results: List[RunResult]) -> None:
    base = results[0]
    print(f"\n{'run':<14}{'train loss':>12}{'val loss':>12}{'gap vs bf16':>13}{'tokens/s':>12}{'speedup':>9}")
    for r in results:
        gap = (r.val_loss - base.val_loss) / base.val_loss
        print(f"{r.name:<14}{r.train_loss:>12.5f}{r.val_loss:>12.5f}{gap:>+12.2%}{r.tokens_per_s:>12.0f}"
              f"{r.tokens_per_s / base.tokens_per_s:>8.2f}x")
    print("(train loss: mean of the last 10% of steps; gap: relative validation-loss difference to bf16)")
