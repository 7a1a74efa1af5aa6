"""Figures of the demo and of `fp8train inspect`: loss curves and numerics statistics.

Matplotlib (the `plot` extra) is imported only here, and only through `Figure` and the Agg
canvas, so drawing never touches a global backend or needs a display.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence

RUN_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")
RUN_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "v"))  # curves that coincide stay visible
ROLES = ("input", "weight", "grad_output")
# (record field, axis label, log scale?, factor)
METRICS = (
    ("amax", "amax", True, 1.0),
    ("scale", "scale", True, 1.0),
    ("saturated", "saturated (%)", False, 100.0),
    ("underflow", "flushed to zero (%)", False, 100.0),
    ("sqnr_db", "SQNR (dB)", False, 1.0),
)


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("fp8train plots need matplotlib: pip install 'fp8train[plot]'") from e
    return Figure(figsize=(width, height), layout="constrained")


def plot_losses(runs: Sequence[dict], path) -> None:
    """loss.png: train (thin, every step) and validation (markers) loss of every run, and
    the validation gap of each run to the first one (the BF16 baseline), in percent.

    runs: dicts with "name", "train_loss" [[step, loss], ...], "val_loss" [[step, loss], ...].
    """
    fig = _figure(13, 4.8)
    ax_loss, ax_gap = fig.subplots(1, 2, width_ratios=(3, 2))
    for run, color, (line, marker) in zip(runs, RUN_COLORS, RUN_STYLES):
        steps, losses = zip(*run["train_loss"]) if run["train_loss"] else ((), ())
        ax_loss.plot(steps, losses, color=color, alpha=0.25, linewidth=0.7)
        ax_loss.plot(steps, _smooth(losses), line, color=color, linewidth=1.4, label=f"{run['name']} train (smoothed)")
        if run["val_loss"]:
            vs, vl = zip(*run["val_loss"])
            ax_loss.plot(vs, vl, marker, color=color, markersize=6, fillstyle="none", linewidth=0,
                         label=f"{run['name']} validation")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    base = dict(map(tuple, runs[0]["val_loss"])) if runs else {}
    for run, color in list(zip(runs, RUN_COLORS))[1:]:
        pts = [(s, 100 * (v - base[s]) / base[s]) for s, v in run["val_loss"] if s in base and base[s]]
        if pts:
            ax_gap.plot(*zip(*pts), "o-", color=color, markersize=4, label=run["name"])
    ax_gap.axhline(0, color=RUN_COLORS[0], linewidth=1)
    for bound in (-1, 1):
        ax_gap.axhline(bound, color="grey", linestyle=":", linewidth=1, label="±1%" if bound > 0 else None)
    ax_gap.set(xlabel="step", ylabel="%", title=f"validation loss vs {runs[0]['name'] if runs else 'baseline'}")
    ax_gap.grid(alpha=0.3)
    ax_gap.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def _smooth(values: Sequence[float], weight: float = 0.9) -> List[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled to 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return out


def plot_numerics(records: Sequence[dict], path, title: str = "FP8 numerics") -> None:
    """One column per tensor role, one row per statistic (amax, scale, saturated, flushed
    to zero, SQNR) over steps; one line per layer, coloured by depth (dark = first)."""
    series: Dict[tuple, Dict[str, list]] = defaultdict(lambda: defaultdict(list))
    layers: List[str] = []
    for r in sorted(records, key=lambda r: r["step"]):
        if r["layer"] not in layers:
            layers.append(r["layer"])
        for field, *_ in METRICS:
            series[(r["layer"], r["role"])][field].append((r["step"], r[field]))
    roles = [role for role in ROLES if any(k[1] == role for k in series)] or list(ROLES)
    fig = _figure(4.2 * len(roles), 2.3 * len(METRICS))
    axes = fig.subplots(len(METRICS), len(roles), squeeze=False, sharex=True)
    from matplotlib import colormaps
    cmap = colormaps["viridis"]
    for col, role in enumerate(roles):
        axes[0][col].set_title(role.upper())
        for row, (field, label, log, factor) in enumerate(METRICS):
            ax = axes[row][col]
            for i, layer in enumerate(layers):
                pts = [(s, v * factor) for s, v in series.get((layer, role), {}).get(field, []) if v is not None]
                if pts and (not log or all(v > 0 for _, v in pts)):
                    ax.plot(*zip(*pts), ".-", color=cmap(i / max(len(layers) - 1, 1)), linewidth=1, markersize=3,
                            alpha=0.8, label=layer if row == col == 0 else None)
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            if row == len(METRICS) - 1:
                ax.set_xlabel("step")
    if 0 < len(layers) <= 16:
        fig.legend(loc="outside lower center", ncols=min(len(layers), 4), fontsize=8)
    fig.suptitle(f"{title}: {len(layers)} GEMMs ({layers[0]} dark ... {layers[-1]} light)" if layers else title,
                 fontsize=10)
    fig.savefig(path, dpi=100)


__all__ = ["plot_losses", "plot_numerics"]
