"""Automatic per-layer precision: run a layer's GEMMs in FP8 only where FP8 is faster.

With `auto_precision=True` in the recipe, each fp8train layer asks this module, once per
shape, whether its FP8 step beats its high-precision step on this GPU. The answer comes from
a measured table, never from a guess:

* the table is keyed by the device name (one table per GPU model) and by a shape key: the
  layer kind and dims, the token count rounded up to a power of two, the activation dtype
  and the recipe kind (`ShapeKey`);
* a missing entry is measured on the spot: a throwaway copy of the layer (same kind, dims
  and parameter dtype, its own quantizers) runs forward + backward in FP8 and in high
  precision, in interleaved rounds (a drift in the machine's speed cancels: `time_pair`), and
  FP8 wins only where it is at least `FP8_MIN_GAIN` (5%) faster: closer than that the two
  are within the measurement's own spread (h 1024 in benchmarks/small.py measured 1.006 vs
  1.007 ms in one run and 1.114 vs 1.067 in the next), and a tie buys nothing for FP8's
  rounding, so high precision keeps it;
* the table is saved as JSON under `~/.cache/fp8train/precision/` (one file per device
  name) and loaded on first use, so each shape is measured once per GPU model;
* `PrecisionTable.override(pattern, "fp8" | "high")` pins a choice for every key that
  contains `pattern` (a user who knows better, or a test); overrides win over measurements
  and are saved with the table.

A layer that chose high precision runs exactly its high-precision path (the torch
composition in the activation dtype, as for dims FP8 cannot take). `report(model)` prints
what each layer chose and why.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

FP8, HIGH = "fp8", "high"
_CHOICES = (FP8, HIGH)
FP8_MIN_GAIN = 0.05  # FP8 is chosen where fp8_ms < (1 - FP8_MIN_GAIN) * high_ms (module docstring)


@dataclasses.dataclass(frozen=True)
class ShapeKey:
    """What the FP8-vs-high-precision decision depends on, as one string-able key."""

    kind: str          # "Linear", "LayerNormLinear", "LayerNormMLP"
    dims: Tuple        # the layer's own dims (and options that change its cost)
    tokens: int        # rows of the GEMMs, rounded up to a power of two
    dtype: str         # activation dtype, e.g. "bfloat16"
    recipe: str        # "DelayedScaling" or "CurrentScaling"

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.dims)
        return f"{self.kind}[{dims}] tokens<={self.tokens} {self.dtype} {self.recipe}"


def bucket(tokens: int) -> int:
    """Token counts share a decision up to the next power of two (>= 16)."""
    return max(16, 1 << max(0, math.ceil(math.log2(max(tokens, 1)))))


@dataclasses.dataclass
class Entry:
    choice: str                      # FP8 or HIGH
    fp8_ms: Optional[float] = None   # measured step times (None for an override)
    high_ms: Optional[float] = None
    source: str = "measured"         # "measured" or "override"

    def reason(self) -> str:
        if self.source == "override":
            return "override"
        close = self.choice == HIGH and self.fp8_ms < self.high_ms  # faster, not by FP8_MIN_GAIN
        note = f"; fp8 not {FP8_MIN_GAIN:.0%} faster" if close else ""
        return f"fp8 {self.fp8_ms:.3f} ms vs high {self.high_ms:.3f} ms (measured{note})"


class PrecisionTable:
    """Measured choices for one device name; JSON on disk (see the module docstring)."""

    def __init__(self, device_name: str, path: Optional[Path] = None):
        self.device_name = device_name
        self.path = path
        self.entries: Dict[str, Entry] = {}
        self.overrides: Dict[str, str] = {}  # pattern -> choice

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: ShapeKey) -> Optional[Entry]:
        text = str(key)
        for pattern, choice in self.overrides.items():
            if pattern in text:
                return Entry(choice, source="override")
        return self.entries.get(text)

    def record(self, key: ShapeKey, fp8_ms: float, high_ms: float) -> Entry:
        entry = Entry(FP8 if fp8_ms < (1 - FP8_MIN_GAIN) * high_ms else HIGH, fp8_ms, high_ms)
        self.entries[str(key)] = entry
        if self.path is not None:
            self.save()
        return entry

    def override(self, pattern: str, choice: str) -> None:
        """Pin `choice` for every key whose text contains `pattern` ("" pins all)."""
        if choice not in _CHOICES:
            raise ValueError(f"PrecisionTable.override: choice must be one of {_CHOICES}, got {choice!r}")
        self.overrides[pattern] = choice  # patterns are tried in the order they were first set
        if self.path is not None:
            self.save()
        refresh()  # layers drop the choices they cached

    # ------------------------------------------------------------------ disk
    def save(self, path: Optional[Path] = None) -> Path:
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"device": self.device_name, "overrides": self.overrides,
                "entries": {k: dataclasses.asdict(e) for k, e in self.entries.items()}}
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent processes never read half a file
        return path

    @classmethod
    def load(cls, path: Path, device_name: Optional[str] = None) -> "PrecisionTable":
        path = Path(path)
        data = json.loads(path.read_text())
        if device_name is not None and data.get("device") != device_name:
            raise ValueError(f"precision table {path} was measured on {data.get('device')!r}, not {device_name!r}")
        table = cls(data["device"], path)
        table.overrides = {str(k): str(v) for k, v in data.get("overrides", {}).items()}
        for k, e in data.get("entries", {}).items():
            table.entries[k] = Entry(**e)
        for choice in list(table.overrides.values()) + [e.choice for e in table.entries.values()]:
            if choice not in _CHOICES:
                raise ValueError(f"precision table {path}: unknown choice {choice!r}")
        return table


# ---------------------------------------------------------------------- the active tables

_TABLES: Dict[str, PrecisionTable] = {}
_generation = 0  # bumped whenever the tables change under the layers' cached decisions


def generation() -> int:
    return _generation


def cache_dir() -> Path:
    return Path.home() / ".cache" / "fp8train" / "precision"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{os.cpu_count()}cores"


def table_for(device: torch.device) -> PrecisionTable:
    """The table of this device's model: loaded from the cache directory, or a new one."""
    name = device_name(device)
    table = _TABLES.get(name)
    if table is None:
        path = cache_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".json")
        table = PrecisionTable.load(path, name) if path.exists() else PrecisionTable(name, path)
        _TABLES[name] = table
    return table


def use_table(table: PrecisionTable) -> None:
    """Use `table` for its device name from now on (your own, or a test's). Layers forget
    the choices they cached, so overrides made on the table before the next step count."""
    global _generation
    _TABLES[table.device_name] = table
    _generation += 1


def refresh() -> None:
    """Make layers look their choices up again (overrides do this themselves; call it after
    editing a table's entries by hand)."""
    global _generation
    _generation += 1


# ---------------------------------------------------------------------- deciding


def decide(layer, rows: int, dtype: torch.dtype, recipe, device: torch.device) -> Entry:
    """The table's entry for this layer at `rows` tokens, measured now if missing."""
    key = layer.precision_key(bucket(rows), dtype, recipe)
    table = table_for(device)
    entry = table.lookup(key)
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{layer.describe()}: auto precision has no measurement for {key} and cannot "
                               "measure during CUDA graph capture; run one eager step first")
        fp8_ms, high_ms = measure(layer.make_twin, (bucket(rows), layer.precision_in_features), dtype, device,
                                  recipe)
        entry = table.record(key, fp8_ms, high_ms)
    layer.precision_choices[str(key)] = entry
    return entry


# ---------------------------------------------------------------------- measuring


def time_pair(a: Callable[[], None], b: Callable[[], None], device: torch.device, warmup: int = 3,
              iters: int = 10, blocks: int = 3, clock: Callable[[], float] = time.perf_counter
              ) -> Tuple[float, float]:
    """Milliseconds per step of `a` and of `b` (each a whole fwd+bwd), host and device together.

    A round issues `iters` steps back to back and waits once, as training does. Each block
    times a round of a, two of b, then one of a (a b b a): the two steps' rounds are centred
    on the same moment, so a drift in the machine's speed that is linear across the block
    cancels from the block's ratio b / a. (A shared host's speed moves by 2x between minutes;
    the two were timed one after the other before, and at sizes where they differ by less than
    that drift the choice followed the drift.) Returns a's median round time and a's time
    times the median of the blocks' ratios as b's."""
    for _ in range(warmup):
        a()
        b()

    def timed(step) -> float:
        _sync(device)
        t0 = clock()
        for _ in range(iters):
            step()
        _sync(device)
        return (clock() - t0) * 1e3 / iters

    a_times, ratios = [], []
    for _ in range(blocks):
        a1, b1, b2, a2 = timed(a), timed(b), timed(b), timed(a)
        a_times += [a1, a2]
        ratios.append((b1 + b2) / (a1 + a2))
    a_ms = statistics.median(a_times)
    return a_ms, a_ms * statistics.median(ratios)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(make_layer: Callable[[], torch.nn.Module], x_shape, dtype: torch.dtype, device: torch.device,
            recipe) -> Tuple[float, float]:
    """(fp8_ms, high_ms) of forward + backward of a fresh layer from `make_layer`: in FP8
    under `recipe` (auto precision off) and on the layer's high-precision path, on random
    input of `x_shape`. The fresh layer has its own quantizers: the measured layer's
    scaling state is not touched."""
    from .autocast import recipe_without_step

    layer = make_layer()
    x = torch.randn(x_shape, device=device, dtype=dtype, requires_grad=True)
    fixed = dataclasses.replace(recipe, auto_precision=False)

    def fp8_step():
        with recipe_without_step(fixed):  # not a step: no scale update of the model's quantizers
            y = layer(x)
        _backward_from_ones(y)

    def high_step():
        _backward_from_ones(layer.high_precision_forward(x, dtype))

    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        return time_pair(fp8_step, high_step, device)


def _backward_from_ones(out) -> None:
    """Backward with all-ones gradients; `out` a tensor or a tuple (LayerNormLinear's parts)."""
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


# ---------------------------------------------------------------------- reporting


def report(model: torch.nn.Module) -> str:
    """One line per fp8train layer and shape it has run: the choice and why."""
    from .modules.base import FP8Module

    lines = []
    for name, module in model.named_modules():
        if not isinstance(module, FP8Module):
            continue
        label = name or type(module).__name__
        if not module.precision_choices:
            lines.append(f"{label}: no auto-precision decision yet")
        for key, entry in module.precision_choices.items():
            lines.append(f"{label}: {entry.choice} for {key}: {entry.reason()}")
    return "\n".join(lines)


__all__ = ["ShapeKey", "PrecisionTable", "Entry", "bucket", "table_for", "use_table", "refresh", "decide",
           "measure", "time_pair", "report", "FP8", "HIGH"]
