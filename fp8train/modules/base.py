"""What every fp8train layer shares: its quantizers (created per recipe, restored from
checkpoints), input checks, activation dtype and warn-once messages."""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .. import gemm, precision
from ..autocast import active_recipe, call_recipe, region
from ..kernels import forms, native
from ..quantizer import Quantizer
from ..quantizer_factory import make_quantizer, quantizer_from_state
from ..recipe import BlockScaling, Format, Recipe
from ..roles import TensorRole
from ..tensor import Float8Tensor, version_of
from .rms_norm import note_reader

# Submodule name of each role's quantizer, after the GEMM's prefix; these names appear in
# state_dict keys ("input_quantizer" for Linear, "fc1_input_quantizer" in LayerNormMLP).
QUANTIZER_NAMES: Dict[TensorRole, str] = {
    TensorRole.INPUT: "input_quantizer",
    TensorRole.WEIGHT: "weight_quantizer",
    TensorRole.GRAD_OUTPUT: "grad_output_quantizer",
}

# Shared inputs (docs/design.md): sibling layers that read the same tensor (attention's q, k, v
# projections; an MLP's gate and up) share one input quantizer, so that the tensor is cast
# once per step (Quantizer.cast_shared). Read when a layer checks its quantizers (its first
# FP8 call, a recipe change, quantizers replaced by a load); False: no new ties (an A/B
# switch for benchmarks/hf_llama.py; existing ties stay).
SHARE_INPUT_CASTS = True

# The last input seen there: (weakref to x, x._version, x.shape, recipe, autocast region,
# weakrefs to the layer's input quantizer and to the layer). Weak references only: it keeps
# no tensor or layer alive. The region keeps layers of separate steps (two models fed one
# tensor in turn) apart.
_last_input: list = [None]


class FP8Module(nn.Module):
    """Base of fp8train layers. Quantizers are created on the first FP8 forward (the recipe
    decides their kind) or when a checkpoint holding them is loaded.

    GEMMS names the prefix of each FP8 GEMM layer the module runs; each has an input, a
    weight and a grad-output quantizer (QUANTIZER_NAMES after its prefix).
    """

    GEMMS: Tuple[str, ...] = ("",)
    # Whether forward(x) passes x, its one GEMM's input, to quantizers(): sibling layers that
    # read the same x then share one input quantizer (Linear; SHARE_INPUT_CASTS).
    SHARES_INPUT = False

    def __init__(self):
        super().__init__()
        for name in self._quantizer_names():
            self.register_module(name, None)
        self._warned: set = set()
        self._matched: Dict[str, tuple] = {}  # per GEMM: (recipe, quantizers) of the last quantizers() call
        # Submodule names per GEMM, computed once (a plain dict: torch.compile traces the lookup).
        self._names = {gemm: tuple(gemm + name for name in QUANTIZER_NAMES.values()) for gemm in self.GEMMS}
        self.name: Optional[str] = None  # set by the user or fp8train.convert for messages
        # Auto precision (recipe.auto_precision): the table entries this layer ran by, per
        # shape key, and its cached choices per (rows, dtype, recipe kind) for the hot path.
        self.precision_choices: Dict[str, precision.Entry] = {}
        self._precision: dict = {}
        self._precision_gen = -1
        # Set by fp8train.make_graphed_callables(fp8_weight_caching=True): a () int32 device
        # flag the weight casts read; nonzero skips them (is_first_microbatch=False on replay).
        self.weight_cast_skip: Optional[torch.Tensor] = None

    # torch.compile's protocol for lazy modules, used here to create quantizers outside the
    # trace: before it traces a module that has `_initialize_hook`, Dynamo calls
    # `_infer_parameters(module, args, kwargs)` eagerly (OptimizedModule._call_lazy_check, on
    # every call of `torch.compile(module)`; layers nested in a compiled model are not reached
    # in torch 2.13: fp8train.convert gives the model it converts a hook of its own,
    # convert._first_compiled_call). Quantizers created inside a trace would have buffers that
    # are temporaries of the graph, which the backward graph cannot update. The hook is
    # never registered as a real hook: nothing else reads it.
    _initialize_hook = None

    # The recipe (None: high precision) of this layer's last forward outside a backward pass:
    # what activation checkpointing's recomputation runs by (call_recipe).
    _forward_recipe: Optional[Recipe] = None

    def _infer_parameters(self, module, args, kwargs=None) -> None:
        """Create (or rebuild) the quantizers the active recipe needs; runs outside any trace."""
        recipe = active_recipe()
        if recipe is None or not getattr(self, "_fp8_dims", False):
            return
        device = next(self.parameters()).device
        x = args[0] if self.SHARES_INPUT and args and isinstance(args[0], torch.Tensor) else None
        for prefix in self.GEMMS:
            self.quantizers(recipe, device, prefix, x=x)

    def _quantizer_names(self):
        return [prefix + name for prefix in self.GEMMS for name in QUANTIZER_NAMES.values()]

    def describe(self) -> str:
        raise NotImplementedError

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{self.describe()}: {message}", stacklevel=3)

    def quantizers(self, recipe: Recipe, device: torch.device, gemm: str = "",
                   x: Optional[torch.Tensor] = None) -> Tuple[Quantizer, Quantizer, Quantizer]:
        """The (input, weight, grad_output) quantizers of GEMM `gemm` (a GEMMS prefix) for
        `recipe`, rebuilt if the recipe kind, format or history length changed since they
        were made (their scaling state resets). x: the GEMM's input, given by layers whose
        input quantizer may be shared with siblings reading the same tensor (_share_input)."""
        if torch.compiler.is_compiling() and forms.KEY:
            pass  # a test of the launch-shape overrides in force, so the traced graph is guarded on them
        mods = self._modules
        names = self._names[gemm]
        current = (mods[names[0]], mods[names[1]], mods[names[2]])
        if self._matched.get(gemm) == (recipe, current):  # the usual call: same recipe, same quantizers
            return current
        if isinstance(recipe, BlockScaling):
            self._check_block_scaling(recipe, device)
        out = []
        for role, name in zip(QUANTIZER_NAMES, names):
            q = mods[name]
            if q is None or not q.matches(recipe, role):
                if torch.compiler.is_compiling():
                    raise RuntimeError(
                        f"{self.describe()}: its FP8 quantizers for {type(recipe).__name__} do not exist yet and "
                        "cannot be created inside a torch.compile trace; call the module once eagerly inside "
                        "fp8train.autocast with this recipe, or compile the module itself or the model "
                        "fp8train.convert converted (torch.compile(model): its first call makes them)")
                if q is not None:
                    self.warn_once("recipe", f"recipe changed to {type(recipe).__name__}; its FP8 scaling state was reset")
                    if role is TensorRole.INPUT:
                        _leave_tie(q, self)
                with torch.inference_mode(False):  # state that training steps update in place later
                    q = make_quantizer(recipe, role, device=device)
                setattr(self, name, q)
                if device.type == "cuda" and native.ENABLED:
                    native.extension()  # loaded before any trace: compiled GEMMs call its operator
            else:
                q.configure(recipe)  # the recipe's scale rules (margin, algo, power of two)
            out.append(q)
        if x is not None:
            out[0] = self._share_input(x, recipe, out[0], names[0])
        elif self.SHARES_INPUT and SHARE_INPUT_CASTS and not torch.compiler.is_compiling():
            return tuple(out)  # made without x (convert(model, recipe)): the first forward checks for siblings
        self._matched[gemm] = (recipe, tuple(out))
        return self._matched[gemm][1]

    def _share_input(self, x: torch.Tensor, recipe: Recipe, q: Quantizer, name: str) -> Quantizer:
        """This layer's input quantizer: the one of the last layer that checked its quantizers
        on this same x (same object, unchanged since) under an equal recipe in the same
        autocast region, made this layer's own too (a tie: one module under both layers, for
        good), or else q; noted for the next."""
        if not SHARE_INPUT_CASTS or isinstance(x, Float8Tensor) or torch.compiler.is_compiling():
            return q
        last = _last_input[0]
        if last is not None:
            ref, version, shape, last_recipe, last_region, q_ref, layer_ref = last
            other = q_ref()
            if (ref() is x and version == version_of(x) and shape == x.shape and last_recipe == recipe
                    and last_region == region()
                    and other is not None and other is not q and type(other) is type(q)
                    and other.matches(recipe, TensorRole.INPUT) and other.fp8_max.device == q.fp8_max.device):
                _leave_tie(q, self)  # if it was in another
                _join_tie(other, layer_ref(), self)
                setattr(self, name, other)
                q = other
        note_reader(x, q)  # x an RMSNorm's output: q is what its fused path casts for
        _last_input[0] = (weakref.ref(x), version_of(x), x.shape, recipe, region(), weakref.ref(q), weakref.ref(self))
        return q

    def takes_block_scaling(self) -> bool:
        """Whether this layer runs fp8train.BlockScaling (Linear, LayerNormLinear, LayerNormMLP
        without tensor parallelism)."""
        return False

    def _check_block_scaling(self, recipe: BlockScaling, device: torch.device) -> None:
        if not self.takes_block_scaling():
            raise NotImplementedError(
                f"{self.describe()}: fp8train.BlockScaling runs in fp8train.Linear, LayerNormLinear and "
                "LayerNormMLP without tensor parallelism only, so far; use DelayedScaling or CurrentScaling for "
                "this layer (or keep it outside fp8train.autocast)")
        if device.type == "cuda" and recipe.fp8_format is not Format.E4M3:
            raise NotImplementedError(
                f"{self.describe()}: BlockScaling(fp8_format={recipe.fp8_format}) casts gradients to e5m2, which "
                "torch's blockwise GEMM on CUDA does not take; use Format.E4M3 (BlockScaling's default)")

    def fp8_plan(self, x: torch.Tensor, in_features: int) -> Tuple[Optional[Recipe], Optional[torch.dtype]]:
        """How this call runs, after checking x: (recipe, activation dtype) for the FP8 path;
        (None, dtype) for the layer's high-precision path in `dtype` - outside autocast
        (dtype None: the torch composition as is), for dims FP8 cannot take (with a one-time
        warning), or where auto precision chose high precision."""
        recipe = self.call_recipe()
        self.check_input(x, in_features, fp8=recipe is not None)
        if recipe is None:
            return None, None
        act_dtype = activation_dtype(x)
        if not self._fp8_dims:
            self.warn_once("dims", f"FP8 GEMMs need dims that are multiples of 16; this layer runs in {act_dtype}")
            return None, act_dtype
        if recipe.auto_precision and not self.runs_fp8(x, recipe, act_dtype):
            return None, act_dtype
        gemm.check_tensor_device(x)
        return recipe, act_dtype

    def call_recipe(self) -> Optional[Recipe]:
        """The recipe this forward runs by (None: high precision); autocast.call_recipe says
        why a recomputation inside a backward pass runs by its forward's."""
        return call_recipe(self)

    # ------------------------------------------------------------------ auto precision
    def runs_fp8(self, x: torch.Tensor, recipe: Recipe, act_dtype: torch.dtype) -> bool:
        """Whether this call runs in FP8 under an auto-precision recipe (precision.py): the
        table's choice for this layer at x's token count, looked up once per count."""
        if self._precision_gen != precision.generation():
            self._precision, self._precision_gen = {}, precision.generation()
        rows = x.numel() // x.shape[-1]
        key = (rows, act_dtype, type(recipe))
        fp8 = self._precision.get(key)
        if fp8 is None:
            if len(self._precision) >= 256:  # many token counts (variable lengths): start over
                self._precision.clear()
            last = _last_input[0]
            entry = precision.decide(self, rows, act_dtype, recipe, x.device)
            _last_input[0] = last  # a measurement's twin layers are no siblings of the next layer
            fp8 = self._precision[key] = entry.choice == precision.FP8
        return fp8

    def precision_key(self, tokens: int, dtype: torch.dtype, recipe: Recipe) -> precision.ShapeKey:
        return precision.ShapeKey(type(self).__name__, self.precision_dims(), tokens,
                                  str(dtype).replace("torch.", ""), type(recipe).__name__)

    def precision_dims(self) -> tuple:
        """The dims and options that set this layer's cost (auto-precision table keys)."""
        raise NotImplementedError

    @property
    def precision_in_features(self) -> int:
        raise NotImplementedError

    def make_twin(self) -> "FP8Module":
        """A fresh layer of the same kind, dims, options, parameter dtype and device, with its
        own quantizers (auto precision measures it instead of this layer)."""
        raise NotImplementedError

    def high_precision_forward(self, x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        """The layer's output computed without FP8, in `dtype` (None: the torch composition)."""
        raise NotImplementedError

    def check_input(self, x, in_features: int, fp8: bool) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.describe()}: input must be a tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{self.describe()}: input must be a floating-point tensor, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != in_features:
            raise ValueError(f"{self.describe()}: input's last dim must be in_features={in_features}, "
                             f"got shape {tuple(x.shape)}")
        if isinstance(x, Float8Tensor) and not fp8:
            raise TypeError(f"{self.describe()}: got a Float8Tensor input outside fp8train.autocast; "
                            "call .dequantize() or run inside fp8train.autocast")
        if fp8 and x.dtype == torch.float64:
            raise TypeError(f"{self.describe()}: float64 input cannot run in FP8; FP8 layers take bfloat16, "
                            "float16 or float32 activations (cast the input, or run outside fp8train.autocast)")

    def check_fp8_input(self, x: Float8Tensor, expected: Quantizer) -> None:
        """A pre-quantized input must have been quantized for this layer's INPUT role."""
        if x.role not in (None, TensorRole.INPUT) or x.fp8_dtype != expected.dtype:
            role = x.role.name if x.role else "unknown"
            raise TypeError(f"{self.describe()}: got a Float8Tensor of role {role} in {x.fp8_dtype}; "
                            f"this layer's input must be quantized for role INPUT in {expected.dtype}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Quantizers are created lazily: materialise the ones the checkpoint holds so the
        # default loading below (which recurses into submodules after this) fills them.
        device = next((p.device for p in self.parameters(recurse=False)), None)
        for gemm_prefix in self.GEMMS:
            for role, base_name in QUANTIZER_NAMES.items():
                self._materialise(state_dict, prefix, role, gemm_prefix + base_name, device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _materialise(self, state_dict, prefix: str, role: TensorRole, name: str, device) -> None:
        sub = prefix + name + "."
        state = {k[len(sub):]: v for k, v in state_dict.items() if k.startswith(sub)}
        if not state:
            return
        current = getattr(self, name)
        if current is None or not _same_shape(current, state):
            setattr(self, name, quantizer_from_state(role, state, device=device))


def _join_tie(q: Quantizer, first: Optional[nn.Module], layer: nn.Module) -> None:
    """`layer` takes q, the input quantizer of `first` (the last layer that checked its
    quantizers on the same x), as its own: a tie, or one more member of it."""
    if q.sharing == 1:
        q.members = [] if first is None else [first]
    q.sharing += 1
    if isinstance(q.members, list) and all(m is not layer for m in q.members):
        q.members.append(layer)


def _leave_tie(q: Quantizer, layer: nn.Module) -> None:
    """`layer` no longer reads its input through q (another tie, a new recipe's quantizer)."""
    if q.sharing > 1:
        q.sharing -= 1
        q.members = [m for m in q.members if m is not layer] if q.sharing > 1 else ()


def _same_shape(q: Quantizer, state: dict) -> bool:
    own = q.state_dict()
    return own.keys() == state.keys() and all(own[k].shape == state[k].shape for k in own) \
        and float(state["fp8_max"]) == float(q.fp8_max)


def mark_calibrated(*quantizers: Quantizer) -> None:
    """After a traced forward: note that its delayed quantizers have calibrated.

    Eager casts flip `calibrated` themselves. Traced casts cannot: Dynamo refuses Python side
    effects inside an autograd.Function, so the layer's forward does it after the Function,
    for the forward and backward quantizers alike (the backward graph was traced with the
    flag as it was, so it calibrates when it runs). The next call sees the new flag, which
    the graph is guarded on, and compiles once more: one recompile per layer and recipe.
    """
    if torch.compiler.is_compiling():
        for q in quantizers:
            if not q.calibrated:
                q.calibrated = True


def unsafe_view(t: torch.Tensor, shape) -> torch.Tensor:
    """t reshaped without being a view for autograd (what F.linear returns for 3-D inputs):
    an output of an autograd.Function that is a view cannot be modified in place (autograd
    raises), and FSDP2 warns that in-place ops on it would drop its pre-backward hook. A
    2-D t of that shape comes back as it is."""
    if t.dim() == len(shape) and tuple(t.shape) == tuple(shape):
        return t
    return _UNSAFE_VIEW(t, shape)


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def in_dtype(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """t in dtype (None stays None). The high-precision paths call it per parameter per step,
    and most calls change nothing: a same-dtype `.to()` still costs a dispatch."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes in: torch.autocast's when it is on, else the input's."""
    # Note: torch.device.type builds a new string on every read (through a C++ ostringstream,
    # several us in a training loop), so the usual cases do not read it: no torch.autocast
    # at all, or a CUDA input.
    if not torch._C._is_any_autocast_enabled():
        return x.dtype
    device_type = "cuda" if x.is_cuda else x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


__all__ = ["FP8Module", "QUANTIZER_NAMES", "activation_dtype", "mark_calibrated", "unsafe_view"]
