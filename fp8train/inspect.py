"""`fp8train.inspect`: numerics statistics of FP8 training, per layer and tensor role.

    inspector = fp8train.inspect.Inspector(model, every=50, path="numerics.jsonl")
    for step in range(steps):
        with inspector.step(step):              # hooks exist only inside inspection steps
            with fp8train.autocast(recipe=recipe):
                loss = model(x, y)[1]
            loss.backward()
    inspector.close()
    records = fp8train.inspect.load("numerics.jsonl")   # or: fp8train inspect numerics.jsonl --plot out.png

On an inspection step the inspector hooks every fp8train layer (forward hooks and full
backward hooks), takes the INPUT, WEIGHT and GRAD_OUTPUT tensor of each FP8 GEMM, and
computes with the scale the layer's quantizer applied (`quantization_stats`). On other
steps it adds no hook and no work. Nothing in the kernels or autograd functions changes.

Note: the GEMM inputs inside fused modules are not visible to hooks: LayerNormLinear's and
LayerNormMLP's norm output, LayerNormMLP's activation output (fc2 INPUT) and fc1's
GRAD_OUTPUT are recomputed in high precision from the module's input on inspection steps.
They differ from what the kernels cast by the FP8 error of the GEMMs in front of them.
Block scaling: the statistics are those of the cast each tensor's forward or dgrad GEMM
reads (its q.block blocks: 1 x 128 for INPUT and GRAD_OUTPUT, 128 x 128 for WEIGHT); the
second, 128 x 1 cast the wgrad GEMM reads is not recorded.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import scaling
from .autocast import active_recipe
from .coverage import Coverage, Reason, coverage  # noqa: F401  (fp8train.inspect.coverage)
from .kernels import block_reference
from .kernels.reference import abs_max, saturating_cast
from .modules.base import QUANTIZER_NAMES, FP8Module
from .modules.layernorm_linear import LayerNormLinear
from .modules.layernorm_mlp import LayerNormMLP, activation_high_precision
from .modules.linear import Linear
from .modules.gated_mlp import GatedMLP
from .modules.rms_norm import RMSNorm
from .modules.norm import norm_high_precision
from .quantizer import CurrentScalingQuantizer, Quantizer
from .roles import TensorRole

# Columns of the per-record statistics tensor, in order.
FIELDS = ("amax", "scale", "saturated", "underflow", "sqnr_db", "numel")
# Magnitudes above which rounding to nearest would leave the finite FP8 range, so that the
# cast's clamp changes the result: fp8_max plus half the step of the top binade (e4m3: 448
# + 16, e5m2: 57344 + 4096). Between fp8_max and these the cast rounds to fp8_max anyway,
# which is what a scale of exactly fp8_max / amax produces up to float32 rounding.
CLAMP_FROM = {torch.float8_e4m3fn: 464.0, torch.float8_e5m2: 61440.0}


def quantization_stats(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                       sample: Optional[int] = None) -> torch.Tensor:
    """Statistics of casting `x` to `dtype` with `scale` (q = fp8(x * scale), saturating),
    as a (6,) float64 tensor on x's device (no host sync), columns FIELDS:

    amax       max |x| over the whole tensor (NaN counts as inf)
    scale      the scale applied; with per-element scales (`scale` of x's shape: a block-
               scaled cast's block scales, expanded), the smallest: that of the block
               holding the tensor's amax
    saturated  fraction of elements the cast clamps: |x * scale| beyond fp8_max by more than
               half a rounding step (> 464 for e4m3, > 61440 for e5m2; see CLAMP_FROM)
    underflow  fraction of the nonzero elements whose cast is zero (flushed); 0 if none
    sqnr_db    10 log10(sum x^2 / sum (x - dequant(q))^2); inf when the round trip is
               exact, NaN when x is all zero
    numel      elements the three statistics above were computed on

    sample: at most this many elements, evenly strided over the flattened tensor, enter
    saturated / underflow / sqnr_db (None: all of them); amax always sees every element.
    """
    clamp_from = CLAMP_FROM[dtype] if dtype in CLAMP_FROM else scaling.fp8_max(dtype)  # the latter raises
    amax = abs_max(x)
    flat = x.detach().reshape(-1)
    per_element = scale.numel() != 1
    scale = scale.detach().float().to(flat.device).reshape(-1 if per_element else ())
    shown = scale.min() if per_element else scale
    if sample is not None and flat.numel() > sample:
        step = -(-flat.numel() // sample)
        flat = flat[::step]
        scale = scale[::step] if per_element else scale
    flat = flat.float()
    q = saturating_cast(flat, scale, dtype).float()
    dequant = q * scaling.scale_inverse(scale)
    nonzero = flat != 0
    n = max(flat.numel(), 1)
    saturated = ((flat * scale).abs() > clamp_from).sum() / n
    underflow = (nonzero & (q == 0)).sum() / nonzero.sum().clamp_min(1)
    signal = flat.double().square().sum()
    noise = (flat.double() - dequant.double()).square().sum()
    sqnr = 10 * torch.log10(signal / noise)
    numel = torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device)
    return torch.stack([amax.double(), shown.double(), saturated.double(), underflow.double(), sqnr, numel])


def applied_scale(q: Quantizer, x: torch.Tensor) -> torch.Tensor:
    """The scale `q` uses to cast `x`: a delayed quantizer's current scale (fixed for the
    step), or for current scaling the scale computed from x's own amax, as the kernels do;
    for block scaling each element's block scale (of x's shape), from x's rows (x.shape[-1]
    columns) cut in q.block blocks as the layer casts them."""
    if q.blockwise:
        rows = x.detach().reshape(-1, x.shape[-1])
        per_block = block_reference.block_scale(block_reference.block_amax(rows, q.block), scaling.fp8_max(q.dtype),
                                                q.power_of_two)
        return block_reference.expand(per_block, rows.shape, q.block).reshape(x.shape)
    if isinstance(q, CurrentScalingQuantizer):
        return scaling.compute_scale(abs_max(x), q.scale, scaling.fp8_max(q.dtype), power_of_two=q.power_of_two)
    return q.scale


@dataclass
class _Pending:
    """What a forward hook leaves for the backward hook of the same module call."""

    x: torch.Tensor
    act_dtype: torch.dtype


class Inspector:
    """Collects `quantization_stats` of every FP8 GEMM tensor of `model` every `every`
    steps and appends them to `path` as JSON lines (one record per step, layer and role):

        {"step": 100, "layer": "blocks.0.mlp.fc1", "role": "input", "dtype": "float8_e4m3fn",
         "amax": ..., "scale": ..., "saturated": ..., "underflow": ..., "sqnr_db": ..., "numel": ...}

    JSON has no inf or NaN: a non-finite value is written as null. Layers that ran outside
    fp8train.autocast on a step (or in high precision) give no records for it. The
    statistics are computed on the device as the hooks fire; one host transfer per
    inspection step writes them out. `records` keeps them in memory too.
    """

    def __init__(self, model: nn.Module, every: int = 100, sample: Optional[int] = 1 << 16,
                 path: Optional[str] = None):
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(f"Inspector: every must be a positive int, got {every!r}")
        if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample <= 0):
            raise ValueError(f"Inspector: sample must be a positive int or None, got {sample!r}")
        self.every, self.sample = every, sample
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Module)]
        if not self.layers:
            raise ValueError("Inspector: the model has no fp8train layers to inspect (see fp8train.convert)")
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
        self.records: List[dict] = []
        self._handles: list = []
        self._pending: Dict[int, _Pending] = {}
        self._stats: List[Tuple[str, TensorRole, torch.dtype, torch.Tensor]] = []
        self._step: Optional[int] = None

    def step(self, step: int) -> "_StepContext":
        """Context for training step `step`: hooks are added only when step % every == 0."""
        return _StepContext(self, step if step % self.every == 0 else None)

    def close(self) -> None:
        self._detach()

    # -- hooks -----------------------------------------------------------------------

    def _attach(self, step: int) -> None:
        self._step = step
        for name, module in self.layers:
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
            self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._pending = [], {}

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            if active_recipe() is None or not args or not torch.is_tensor(args[0]):
                return
            x = args[0].detach()
            out = output[0] if isinstance(output, tuple) else output
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                for gemm, role, t in _forward_tensors(module, x):
                    self._record(name, module, gemm, role, t)
            self._pending[id(module)] = _Pending(x, out.dtype)
        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            pending = self._pending.pop(id(module), None)
            dy = _output_grad(module, grad_output)
            if pending is None or dy is None:
                return
            dy = dy.detach().to(pending.act_dtype)
            with torch.no_grad(), torch.autocast(dy.device.type, enabled=False):
                for gemm, t in _grad_outputs(module, pending.x, dy):
                    self._record(name, module, gemm, TensorRole.GRAD_OUTPUT, t)
        return hook

    def _record(self, name: str, module: nn.Module, gemm: str, role: TensorRole, t: torch.Tensor) -> None:
        q = getattr(module, gemm + QUANTIZER_NAMES[role], None)
        if q is None:  # the layer ran in high precision (dims not multiples of 16)
            return
        layer = f"{name}.{gemm.rstrip('_')}" if gemm else name
        self._stats.append((layer, role, q.dtype, quantization_stats(t, applied_scale(q, t), q.dtype, self.sample)))

    def _flush(self) -> None:
        if not self._stats:
            return
        values = torch.stack([s for *_, s in self._stats]).cpu().tolist()  # the one sync of the step
        lines = []
        for (layer, role, dtype, _), row in zip(self._stats, values):
            rec = {"step": self._step, "layer": layer, "role": role.value, "dtype": str(dtype).replace("torch.", "")}
            rec.update({k: (v if math.isfinite(v) else None) for k, v in zip(FIELDS, row)})
            rec["numel"] = int(rec["numel"])
            lines.append(rec)
        self._stats = []
        self.records.extend(lines)
        if self.path is not None:
            with self.path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in lines)


class _StepContext:
    def __init__(self, inspector: Inspector, step: Optional[int]):
        self.inspector, self.active_step = inspector, step

    @property
    def active(self) -> bool:
        return self.active_step is not None

    def __enter__(self):
        if self.active:
            self.inspector._attach(self.active_step)
        return self

    def __exit__(self, *exc):
        if self.active:
            self.inspector._detach()
            if exc[0] is None:
                self.inspector._flush()
            else:
                self.inspector._stats = []
        return False


def _forward_tensors(module: nn.Module, x: torch.Tensor):
    """(gemm prefix, role, tensor) for every forward-role tensor the module's GEMMs cast."""
    if isinstance(module, LayerNormMLP):
        ln = norm_high_precision(x.float(), module.layer_norm_weight.float(), _maybe_float(module.layer_norm_bias),
                                 module.normalization, module.eps)
        h = _fc1(module, ln, x.dtype)
        yield "fc1_", TensorRole.INPUT, ln
        yield "fc1_", TensorRole.WEIGHT, module.fc1_weight.detach()
        yield "fc2_", TensorRole.INPUT, activation_high_precision(h.float(), module.activation)
        yield "fc2_", TensorRole.WEIGHT, module.fc2_weight.detach()
        return
    if isinstance(module, LayerNormLinear):
        x = norm_high_precision(x.float(), module.layer_norm_weight.float(), _maybe_float(module.layer_norm_bias),
                                module.normalization, module.eps)
    yield "", TensorRole.INPUT, x
    yield "", TensorRole.WEIGHT, module.weight.detach()


def _output_grad(module: nn.Module, grad_output: tuple) -> Optional[torch.Tensor]:
    """The gradient the module's backward casts (None if none): its output's, or for a
    LayerNormLinear with out_features=(q, k, v) the parts' gradients side by side, as the
    backward of their split builds it (zeros for a part without one)."""
    parts = module.local_out_parts if isinstance(module, LayerNormLinear) else None
    if parts is None:
        return grad_output[0]
    grads = grad_output[:len(parts)]
    some = next((g for g in grads if g is not None), None)
    if some is None:
        return None
    return torch.cat([some.new_zeros(*some.shape[:-1], n) if g is None else g for g, n in zip(grads, parts)], -1)


def _grad_outputs(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """(gemm prefix, tensor) for every GRAD_OUTPUT the module's backward casts."""
    if not isinstance(module, LayerNormMLP):
        yield "", dy
        return
    yield "fc2_", dy
    ln = norm_high_precision(x.float(), module.layer_norm_weight.float(), _maybe_float(module.layer_norm_bias),
                             module.normalization, module.eps)
    h = _fc1(module, ln, x.dtype)
    da = dy @ module.fc2_weight.detach().to(dy.dtype)  # (..., ffn) gradient of the activation output
    yield "fc1_", activation_grad(h.float(), da.float(), module.activation).to(dy.dtype)


def _fc1(module: LayerNormMLP, ln: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b = module.fc1_bias.detach().to(dtype) if module.fc1_bias is not None else None
    return F.linear(ln.to(dtype), module.fc1_weight.detach().to(dtype), b)


def _maybe_float(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.detach().float() if t is not None else None


def activation_grad(h: torch.Tensor, da: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(h) / dh applied to `da`, with plain ops (a backward hook must not re-enter autograd)."""
    if activation in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(da, h, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "relu":
        return da * (h > 0)
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], dim=-1)


def execution_paths(model: nn.Module) -> Dict[str, str]:
    """Which autograd node each fp8train.Linear of `model` ran its last eager FP8 call with:
    "C++ node", or "Python node: <why>" (a float8 input, a profiler's launch hook, a dtype
    or device the C++ node does not take, the first call of a shape, no extension, ...);
    "no eager FP8 call yet" for layers that have not run one (compiled calls are not noted:
    Inductor runs them). By module name, for users who want to know why a layer is slow."""
    return {name: m._path[0] or "no eager FP8 call yet" for name, m in model.named_modules() if isinstance(m, Linear)}


def norm_paths(model: nn.Module) -> Dict[str, str]:
    """How each fp8train.RMSNorm of `model` (fp8train.convert's fuse_norms) ran its last eager
    call inside fp8train.autocast: "kernel: normalizes and casts its output for its readers"
    (the sibling Linears that read it cast nothing), "kernel: ..." without the cast and why, or
    "formula: <why>" (HF's torch ops); "no eager FP8 call yet" before one. By module name."""
    return {name: m._path[0] or "no eager FP8 call yet" for name, m in model.named_modules() if isinstance(m, RMSNorm)}


def mlp_paths(model: nn.Module) -> Dict[str, str]:
    """How each fp8train.GatedMLP of `model` (fp8train.convert's fuse_mlps) ran act(gate) * up
    in its last eager call inside fp8train.autocast: "kernel: ..." (one fused launch each way)
    or "formula: <why>" (torch's ops); "no eager FP8 call yet" before one. By module name."""
    return {name: m._path[0] or "no eager FP8 call yet" for name, m in model.named_modules()
            if isinstance(m, GatedMLP)}


def shared_input_casts(model: nn.Module) -> List[List[str]]:
    """The groups of fp8train.Linear layers of `model` that share one input quantizer (sibling
    layers that read the same tensor, tied on their first FP8 call: their input is cast once
    per step), by module name, in module order; layers with their own input quantizer are left out."""
    groups: Dict[int, List[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.input_quantizer is not None:
            groups.setdefault(id(m.input_quantizer), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def load(path) -> List[dict]:
    """The records of an Inspector's JSON-lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["FIELDS", "Inspector", "quantization_stats", "applied_scale", "activation_grad", "execution_paths",
           "norm_paths", "mlp_paths", "shared_input_casts", "load"]
