"""fp8train.make_graphed_callables: forward and backward of fp8train modules as CUDA graphs.

Built on torch.cuda.make_graphed_callables (static inputs, one autograd node per callable,
a shared memory pool); what this adds is the FP8 part:

* each module's forward runs inside the recipe's FP8 region while it is captured, and the
  first module's graph also captures the delayed-scaling update that `fp8train.autocast`
  runs on entry, so one replay of the graphs is one eager step under `autocast`
  (amax recording, the scale update, current-scaling amax passes: all in the graphs);
* torch's warm-up iterations (run eagerly, on random gradients) would move the scaling
  state; it is put back afterwards, so the first replay starts where eager training was;
* parameter gradients are kept from aliasing the graphs' static buffers across replays
  (`_GradAliasGuard`), so microbatches add up as in eager training, while a step of one
  microbatch per `zero_grad(set_to_none=True)` copies nothing;
* fp8_weight_caching=True: the weight casts are captured, and each cast kernel first reads
  a device flag (`FP8Module.weight_cast_skip`) and returns at once while it is nonzero. The
  graphed forward takes `is_first_microbatch` and sets the flag before the replay: False
  skips the casts (the FP8 weights and their transposed copies keep the values cast on the
  first microbatch), True/None casts. No Python branch is baked in at capture.

Modules must have run one eager training step under `fp8train.autocast` with the same
recipe first (quantizers exist and are calibrated; the delayed update knows them).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .autocast import autocast, recipe_without_step
from .modules.base import FP8Module
from .quantizer import _REGISTRY, DelayedScalingQuantizer, Quantizer
from .recipe import BlockScaling, Recipe, check_recipe, default_recipe


class _FP8Region(nn.Module):
    """Runs `forward` (the wrapped module's own bound forward, kept before it is replaced)
    inside the recipe's FP8 region; the first callable's region is a step (scale update)."""

    def __init__(self, module: nn.Module, recipe: Recipe, first: bool, amax_reduction=None):
        super().__init__()
        self.inner = module  # registered, so torch sees its parameters as graph inputs
        self._forward = module.forward
        self._recipe = recipe
        self._first = first
        self._amax_reduction = amax_reduction
        self.captured_update: list = []  # scale-update batches the first region's graph replays

    def forward(self, *args):
        region = (autocast(recipe=self._recipe, amax_reduction=self._amax_reduction) if self._first
                  else recipe_without_step(self._recipe))
        with region:
            return self._forward(*args)


def make_graphed_callables(modules: Union[nn.Module, Tuple[nn.Module, ...]],
                           sample_args: Union[Tuple[torch.Tensor, ...], Tuple[Tuple[torch.Tensor, ...], ...]],
                           fp8_weight_caching: bool = False, num_warmup_iters: int = 3,
                           recipe: Optional[Recipe] = None, amax_reduction=None):
    """Capture the forward and backward of `modules` (one module, or a tuple run in that order
    each step) in CUDA graphs; returns them (a module or a tuple) with `forward` replaced.

    sample_args  like torch.cuda.make_graphed_callables: a tuple of tensors per module, in
                 the shapes, dtypes and requires_grad of every later call
    recipe       the FP8 recipe of the graphed steps (default: recipe.default_recipe(), as autocast)
    fp8_weight_caching  the graphed forwards take `is_first_microbatch` (see the module doc)
    amax_reduction  as fp8train.autocast's (tensor / data parallelism): the first graph also
                 captures the all-reduce of the pending delayed-scaling amaxes before the
                 update, so every rank replays to the same scales (NCCL collectives capture)

    The graphed forward of a module is `forward(*tensors, is_first_microbatch=None)`.
    Replays need no `fp8train.autocast` around them (the region is in the graph); a module in
    another training/eval mode than at capture runs its eager forward instead.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("fp8train.make_graphed_callables needs a CUDA device (CUDA graphs)")
    recipe = check_recipe(recipe) if recipe is not None else default_recipe()
    if isinstance(recipe, BlockScaling):
        raise NotImplementedError("fp8train.make_graphed_callables does not take BlockScaling yet (its casts "
                                  "allocate per call); use DelayedScaling or CurrentScaling, or run eagerly")
    single = not isinstance(modules, tuple)
    mods = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    if len(args) != len(mods):
        raise ValueError(f"make_graphed_callables: {len(mods)} modules but {len(args)} sample_args tuples")
    for m in mods:
        if not isinstance(m, nn.Module):
            raise TypeError(f"make_graphed_callables: expected nn.Modules, got {type(m).__name__}")
        _check_ready(m, recipe)

    flags = []
    for m in mods:
        flag = torch.zeros((), dtype=torch.int32, device=_device_of(m)) if fp8_weight_caching else None
        for layer in _fp8_layers(m):
            layer.weight_cast_skip = flag
        flags.append(flag)

    regions = tuple(_FP8Region(m, recipe, first=i == 0, amax_reduction=amax_reduction) for i, m in enumerate(mods))
    saved = _snapshot(mods)
    torch.cuda.make_graphed_callables(regions, tuple(args), num_warmup_iters=num_warmup_iters)
    _restore(saved)  # the warm-up iterations ran eagerly on random gradients
    # The first graph replays the scale-update launches it captured: keep their pointer
    # tables alive for as long as the graphs are (a later eager update may rebuild them).
    regions[0].captured_update = _REGISTRY.batches()

    guard = _GradAliasGuard([p for m in mods for p in m.parameters()])  # one pool: one guard
    for m, region, flag in zip(mods, regions, flags):
        m.forward = _graphed_forward(region, flag, guard)
    return mods[0] if single else mods


class _GradAliasGuard:
    """Keeps `.grad` from aliasing the graphs' static gradient buffers across a replay.

    The graphed backward hands out its static gradient buffers (detached views). A parameter
    without a `.grad` adopts the incoming gradient without a copy, so `.grad` then aliases
    the static buffer. That buffer is only valid until the next replay of *any* graph of the
    call: they share one memory pool, and a forward graph's temporaries may lie where a
    static gradient does. So before every graphed forward, each `.grad` that still aliases a
    static buffer is replaced by a copy (a GPU test saw the first step's gradients turn to
    garbage when the copy waited for the next backward, and twice the last microbatch when
    there was no copy at all).

    Cost: one copy per parameter per step when microbatches accumulate, none for one
    microbatch per `zero_grad(set_to_none=True)` (earlier versions copied every gradient of
    every backward). Where the static buffers lie is learned on the first backward, by a
    hook per parameter that is removed once every parameter has been seen.
    """

    def __init__(self, params):
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]  # shared ones once
        self.static: set = set()  # data_ptr of each static gradient buffer
        self._learning = [p.register_hook(self._learn) for p in self.params]

    def _learn(self, grad: torch.Tensor) -> torch.Tensor:
        self.static.add(grad.data_ptr())
        if len(self.static) >= len(self.params):
            for h in self._learning:
                h.remove()
            self._learning = []
        return grad

    def before_replay(self) -> None:
        for p in self.params:
            g = p.grad
            if g is not None and g.data_ptr() in self.static:
                p.grad = g.clone()


def _graphed_forward(region: nn.Module, flag: Optional[torch.Tensor], guard: _GradAliasGuard):
    last = [0]  # the flag's value on the device, so a fill is issued only on a change

    def forward(*tensors, is_first_microbatch: Optional[bool] = None):
        guard.before_replay()
        if flag is not None:
            want = 1 if is_first_microbatch is False else 0
            if want != last[0]:
                flag.fill_(want)
                last[0] = want
        return region(*tensors)
    return forward


def _fp8_layers(module: nn.Module):
    return [m for m in module.modules() if isinstance(m, FP8Module)]


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cuda", torch.cuda.current_device())


def _check_ready(module: nn.Module, recipe: Recipe) -> None:
    layers = _fp8_layers(module)
    if not layers:
        raise ValueError(f"make_graphed_callables: {type(module).__name__} holds no fp8train layer")
    for layer in layers:
        for name in layer._quantizer_names():
            q = getattr(layer, name)
            ready = q is not None and q.matches(recipe, q.role) and \
                (not isinstance(q, DelayedScalingQuantizer) or q.calibrated)
            if not ready:
                raise ValueError(f"make_graphed_callables: {layer.describe()} has not run a training step with "
                                 f"{type(recipe).__name__} ({name} missing or uncalibrated); run one eager "
                                 "forward and backward under fp8train.autocast(recipe=...) first")


def _snapshot(mods: Sequence[nn.Module]):
    """Copies of every scaling buffer the warm-up can move (restored in place: the graphs
    hold their addresses): the modules' quantizers, and every live delayed-scaling one,
    since each warm-up forward of the first module runs the update of all of them."""
    quantizers = {id(q): q for m in mods for q in m.modules() if isinstance(q, Quantizer)}
    quantizers.update((id(q), q) for q in _REGISTRY.live())
    return [(b, b.clone()) for q in quantizers.values() for b in q._buffers.values() if b is not None]


def _restore(saved) -> None:
    with torch.no_grad():
        for buf, copy in saved:
            buf.copy_(copy)


__all__ = ["make_graphed_callables"]
