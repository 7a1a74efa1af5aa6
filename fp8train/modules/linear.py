"""fp8train.Linear: nn.Linear whose three GEMMs run in FP8 inside fp8train.autocast."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import gemm
from ..distributed.parallel_linear import linear_layout, parallel_linear_forward
from ..distributed.tp_config import TPConfig
from ..distributed.tp_state import ShardSpec, TPLayout
from ..quantizer import Quantizer
from ..kernels import native
from ..recipe import GemmConfig
from ..tensor import Float8Tensor
from . import stacked
from .base import FP8Module, in_dtype, mark_calibrated, unsafe_view
from .tp_checkpoint import TPCheckpoints
from .weight_workspace import WeightWorkspace, high_precision_weight, weight_operands, weight_transposed


class Linear(FP8Module, TPCheckpoints):
    """y = x W^T + b, with x of any leading dims.

    Outside fp8train.autocast it computes exactly what torch.nn.Linear computes. Inside, the
    forward (fprop) and backward (dgrad, wgrad) GEMMs run in FP8 with the active recipe; a
    layer whose in/out features are not multiples of 16 runs in high precision and says so
    once. Parameters may be float32 (master weights, with bf16 activations) or bfloat16.

    forward(x, is_first_microbatch): see WeightWorkspace for the weight-cast semantics.

    Tensor parallelism (docs/distributed.md): parallel_mode="column" shards out_features
    (weight (out/W, in), bias (out/W)), "row" shards in_features (weight (out, in/W), bias
    full, added once after the reduction) over the W ranks of `tp_group`;
    sequence_parallel=True splits the activations' leading (sequence) dim over the ranks too
    (column: the input; row: the output); tp_overlap=True (with SP) runs those gathers and
    reduce-scatters as ring collective matmuls. `in_features` / `out_features` stay the full dims.

    BlockScaling (without tensor parallelism): the same Python node with block-scaled
    operands (gemm.py's blockwise GEMMs); the weight's block cast is kept in the workspace
    (`weight_fp8` stays None: a Float8Tensor holds one scale).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device=None, *, tp_group=None,
                 parallel_mode: Optional[str] = None, sequence_parallel: bool = False, tp_overlap: bool = False,
                 tp_reduce_dtype: Optional[torch.dtype] = None):
        super().__init__()
        for what, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Linear: {what} must be a positive int, got {v!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.tp: Optional[TPConfig] = TPConfig.create(tp_group, parallel_mode, sequence_parallel, in_features,
                                                      out_features, tp_overlap, reduce_dtype=tp_reduce_dtype)
        local_in, local_out = (in_features, out_features) if self.tp is None else \
            (self.tp.local_in_features, self.tp.local_out_features)
        factory = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.empty(local_out, local_in, **factory))
        self.bias = nn.Parameter(torch.empty(local_out if self.tp is None or self.tp.column else out_features,
                                             **factory)) if bias else None
        self.reset_parameters()
        self._workspace = WeightWorkspace()
        # How the last eager FP8 call ran: CPP_NODE, or why the Python node ran instead
        # (fp8train.inspect.execution_paths). A list: an item store is cheaper than a
        # Module attribute store on this per-call path.
        self._path = [None]
        self._fp8_dims = gemm.dims_ok(local_in, local_out)
        self.SHARES_INPUT = self.tp is None  # a TP layer's input is gathered or scattered first: no ties
        # The stacked weight's kept block cast, where this layer is the first of a stacked tie
        # (_stacked_forward). Made here, not on the first stacked call: one made inside a
        # trace would fail the next call's guard (a recompile).
        self._stack_workspace = WeightWorkspace()

    _stack_workspace: Optional[WeightWorkspace] = None  # layers pickled before it existed
    # Whether this layer's last forward outside a backward pass ran its tie's stacked GEMM
    # (what a recomputation does again: _stacked_forward)
    _stacked_last = False

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, so converted and fresh layers start alike (a TP layer:
        # init_linear_params keeps its shards of the unsharded layer's draws).
        layout = self.tp_layout()
        init_linear_params(self.weight, self.bias, self.in_features, self.out_features,
                           None if layout is None else (layout.tp, layout.specs["weight"], layout.specs["bias"]))

    def tp_layout(self) -> Optional[TPLayout]:
        return None if self.tp is None else linear_layout(self.tp)

    def describe(self) -> str:
        name = f" '{self.name}'" if self.name else ""
        tp = "" if self.tp is None else f", {self.tp.mode.value}-parallel over {self.tp.world} ranks"
        return f"Linear{name}(in={self.in_features}, out={self.out_features}{tp})"

    def extra_repr(self) -> str:
        tp = "" if self.tp is None else (f", parallel_mode={self.tp.mode.value!r}, tp_size={self.tp.world}"
                                         f", sequence_parallel={self.tp.sequence_parallel}")
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{tp}"

    def precision_dims(self) -> tuple:
        return self.in_features, self.out_features, int(self.bias is not None)

    def takes_block_scaling(self) -> bool:
        return self.tp is None

    @property
    def precision_in_features(self) -> int:
        return self.in_features

    def make_twin(self) -> "Linear":
        return Linear(self.in_features, self.out_features, bias=self.bias is not None,
                      params_dtype=self.weight.dtype, device=self.weight.device)

    def high_precision_forward(self, x, dtype):
        weight = high_precision_weight(self, self.weight)
        return F.linear(x, weight, self.bias) if dtype is None else _high_precision(x, weight, self.bias, dtype)

    @property
    def weight_fp8(self) -> Optional[Float8Tensor]:
        """The FP8 weight workspace of eager calls (None until the first eager FP8 forward, and
        after a compiled one: WeightWorkspace)."""
        return self._workspace.fp8

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        if self.tp is not None:
            return parallel_linear_forward(self, x, is_first_microbatch)
        weight = self.weight  # read once: each read of a parameter is a Module.__getattr__ call
        # x checked against the weight's in dim, not self.in_features (the same number): under
        # torch.compile a parameter's shape is static, but Dynamo makes an FSDP2 module's int
        # attributes dynamic when it recompiles its forward (another layer's call), and x's last
        # dim would be that symbol until _LinearFn's backward (dx.view) specialised it. Dynamo in
        # torch 2.11 fails an internal assertion on that (overwrite_tensor_vt_proxy: a forward
        # output traced as a symbol came back a constant); checked here, the dim is static first.
        recipe, act_dtype = self.fp8_plan(x, weight.shape[-1])
        if recipe is None:
            return self.high_precision_forward(x, act_dtype)
        q_input, q_weight, q_grad = self.quantizers(recipe, weight.device, x=x)
        grad = torch.is_grad_enabled()
        bias = self.bias
        if q_weight.blockwise:
            if q_input.sharing > 1 and recipe.stack_siblings and (stacked.EAGER or torch.compiler.is_compiling()):
                y = _stacked_forward(self, x, q_input, q_weight, q_grad, recipe.gemm, act_dtype, grad,
                                     is_first_microbatch, recipe.fp8_wgrad)
                if y is not None:
                    return y
            return _block_scaled_forward(self, x, weight, bias, q_input, q_weight, q_grad, recipe.gemm, act_dtype, grad,
                                         is_first_microbatch, recipe.fp8_wgrad)
        if x.is_cuda and native.ENABLED:
            y = _native_forward(self, x, weight, bias, q_input, q_weight, q_grad, recipe.gemm, act_dtype, grad,
                                is_first_microbatch)
            if y is not None:
                return y
        elif not torch.compiler.is_compiling():
            self._path[0] = _OFF_CUDA if not x.is_cuda else _SWITCHED_OFF
        if isinstance(x, Float8Tensor):
            self.check_fp8_input(x, q_input)
        w_fp8 = self._workspace.get(weight, q_weight, is_first_microbatch, need_transpose=grad and x.requires_grad,
                                    skip=self.weight_cast_skip)
        need_wgrad = grad and weight.requires_grad
        y = _LinearFn.apply(x, weight, bias, w_fp8, q_input, q_grad, recipe.gemm, act_dtype, need_wgrad,
                            *_shared_cast(x, q_input, need_wgrad))
        mark_calibrated(q_input, q_weight, q_grad)
        return y


def _init_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def init_linear_params(weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int, out_features: int,
                       sharding: Optional[Tuple[TPConfig, ShardSpec, ShardSpec]] = None) -> None:
    """nn.Linear's initialisation of one GEMM's weight and bias (in / out: the full dims).

    sharding (tp, weight spec, bias spec) of a TP layer: the *full* weight and bias are
    initialised with the unsharded layer's random draws (on every rank, with the same seed)
    and this rank keeps its shards, so each shard is exactly the unsharded layer's slice (at
    the cost of one full weight in memory, once)."""
    if sharding is None:
        _init_linear(weight, bias, in_features)
        return
    tp, weight_spec, bias_spec = sharding
    factory = {"dtype": weight.dtype, "device": weight.device}
    full_weight = torch.empty(out_features, in_features, **factory)
    full_bias = None if bias is None else torch.empty(out_features, **factory)
    _init_linear(full_weight, full_bias, in_features)
    with torch.no_grad():
        weight.copy_(weight_spec.shard(full_weight, tp.world, tp.rank))
        if bias is not None:
            bias.copy_(bias_spec.shard(full_bias, tp.world, tp.rank))


def linear_parts(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 parts: Optional[Tuple[int, ...]]):
    """F.linear(x, weight, bias); with `parts` (the sizes of weight's row blocks) a tuple, one
    F.linear per block with that block's weight and bias rows: bitwise what separate layers
    compute (one GEMM of all the blocks, split after, may pick another kernel on a GPU and
    differ in the last bits)."""
    if parts is None:
        return F.linear(x, weight, bias)
    biases = (None,) * len(parts) if bias is None else bias.split(parts)
    return tuple(F.linear(x, w, b) for w, b in zip(weight.split(parts), biases))


def _high_precision(x, weight, bias, dtype):
    return F.linear(in_dtype(x, dtype), in_dtype(weight, dtype), in_dtype(bias, dtype))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, last dim); 2-D tensors pass through without a view."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


CPP_NODE = "C++ node"
_OFF_CUDA = "Python node: the C++ node runs on CUDA tensors only"
_SWITCHED_OFF = "Python node: the C++ node is switched off (kernels.native.ENABLED = False)"
_HIGH_WGRAD = "Python node: BlockScaling(fp8_wgrad=False) (the C++ node's block path has an FP8 wgrad only)"


def _block_scaled_forward(layer: Linear, x, weight, bias, q_input: Quantizer, q_weight: Quantizer, q_grad: Quantizer,
                          config: GemmConfig, act_dtype: torch.dtype, grad: bool,
                          is_first_microbatch: Optional[bool], fp8_wgrad: bool) -> torch.Tensor:
    """The layer's FP8 forward under BlockScaling: block-scaled operands that the layer casts
    itself, in the C++ node where it takes the call, else the Python node."""
    refuse_per_tensor_fp8(layer, x, weight)
    return block_scaled_gemm(layer._workspace, x, weight, bias, q_input, q_weight, q_grad, config, act_dtype, grad,
                             is_first_microbatch, None if torch.compiler.is_compiling() else layer._path,
                             fp8_wgrad=fp8_wgrad)


def _stacked_forward(layer: Linear, x, q_input: Quantizer, q_weight: Quantizer, q_grad: Quantizer,
                     config: GemmConfig, act_dtype: torch.dtype, grad: bool,
                     is_first_microbatch: Optional[bool], fp8_wgrad: bool) -> Optional[torch.Tensor]:
    """Under BlockScaling(stack_siblings=True), a tied layer's output through its tie's one
    stacked GEMM (modules/stacked.py): the slice the tie's first member computed, or, called
    as that first member, all members' outputs from one block-scaled GEMM on the weights
    stacked (the later members' kept for their calls); None where the layer runs alone."""
    traced = torch.compiler.is_compiling()
    y = stacked.take(layer, q_input, x)
    if y is not None:
        if not traced:
            layer._path[0] = q_input.members[0]._path[0]
        return y
    # activation checkpointing's recomputation stacks where its forward did (not where the
    # tie formed during that forward), or it would save other tensors
    recomputing = not traced and torch._C._current_graph_task_id() != -1
    if recomputing and not layer._stacked_last:
        return None
    parts = stacked.parts(layer, q_input)
    if not traced and not recomputing and layer._stacked_last != (parts is not None):
        layer._stacked_last = parts is not None
    if parts is None:
        return None
    refuse_per_tensor_fp8(layer, x)
    weight = torch.cat(parts.weights)
    bias = None if parts.biases is None else torch.cat(parts.biases)
    workspace = layer._stack_workspace
    if workspace is None:
        workspace = layer._stack_workspace = WeightWorkspace()
    outs = block_scaled_gemm(workspace, x, weight, bias, q_input, q_weight, q_grad, config, act_dtype, grad,
                             is_first_microbatch, None if traced else layer._path, alone=True, parts=parts.weights,
                             widths=tuple(parts.widths), fp8_wgrad=fp8_wgrad)
    stacked.keep(q_input, x, outs)
    return outs[0]


def gated_stacked_forward(gate: Linear, up: Linear, down: Linear, x: torch.Tensor, act: str) -> Optional[torch.Tensor]:
    """down(act(gate(x)) * up(x)) under BlockScaling, with gate and up a stacked tie
    (modules/stacked.py GATED): one GEMM for gate and up, whose node casts the product for
    down from the GEMM's output in one kernel and, backward, dg | du from down's dX; or None
    with nothing computed, where it cannot run so (the caller runs the layers one by one):
    stacking off or not tied yet (the first FP8 call ties them), another recipe, TP layers,
    hooks, biases on gate or up, auto precision, GATED off. Under BlockScaling(fp8_wgrad=False)
    the casts are one-way and keep what the bf16 wgrads read: the product (down's X, the
    node's output in place of the stand-in) and dg | du."""
    layers = (gate, up, down)
    if (not stacked.GATED or not (stacked.EAGER or torch.compiler.is_compiling())
            or any(type(m) is not Linear or m.tp is not None or not m._fp8_dims or _hooked(m) for m in layers)):
        return None
    weight = gate.weight
    recipe, act_dtype = gate.fp8_plan(x, weight.shape[-1])
    if recipe is None or not getattr(recipe, "stack_siblings", False) or recipe.auto_precision \
            or down.call_recipe() is not recipe:
        return None
    q_input, q_weight, q_grad = gate.quantizers(recipe, weight.device, x=x)
    up.quantizers(recipe, weight.device, x=x)  # what up's own call would do: keeps the tie
    if not q_weight.blockwise or q_input.sharing != 2 or tuple(q_input.members) != (gate, up):
        return None
    parts = stacked.parts(gate, q_input)
    if parts is None or parts.biases is not None or parts.widths[0] != parts.widths[1]:
        return None
    q_next = down.quantizers(recipe, down.weight.device)[0]
    if not q_next.blockwise or q_next.sharing != 1:
        return None
    refuse_per_tensor_fp8(gate, x)
    traced = torch.compiler.is_compiling()
    workspace = gate._stack_workspace
    if workspace is None:
        workspace = gate._stack_workspace = WeightWorkspace()
    standin, *cast = block_scaled_gemm(workspace, x, torch.cat(parts.weights), None, q_input, q_weight, q_grad,
                                       recipe.gemm, act_dtype, torch.is_grad_enabled(), None,
                                       None if traced else gate._path, alone=True, parts=parts.weights,
                                       gated=(act, q_next), fp8_wgrad=recipe.fp8_wgrad)
    if not traced:
        up._path[0] = gate._path[0]
    # down's five shared-cast arguments: two-way, or one-way with the product itself as its x
    stacked.offer(q_next, standin, (*cast, None) if recipe.fp8_wgrad else (cast[0], None, cast[1], None, None))
    y = down(standin)
    if stacked.offered(q_next):  # down ran another path: its output would read the uninitialized stand-in
        q_next._offered = None
        raise RuntimeError(f"{down.describe()}: did not take its input's cast from the gated MLP's stacked "
                           "gate/up node (fp8train bug); set fp8train.modules.stacked.GATED = False to run around it")
    return y


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def refuse_per_tensor_fp8(layer: FP8Module, x, *weights) -> None:
    """BlockScaling casts the high-precision tensors itself, block by block: the per-tensor
    scaled FP8 forms (a Float8Tensor input, a weight FSDP2 gathered in FP8) are refused."""
    if isinstance(x, Float8Tensor) or any(isinstance(w, Float8Tensor) for w in weights):
        what = "input is a Float8Tensor" if isinstance(x, Float8Tensor) else \
            "weight was gathered in FP8 by FSDP2 (fp8_all_gather)"
        raise TypeError(f"{layer.describe()}: its {what}, with one scale per tensor; BlockScaling casts the "
                        "high-precision tensor itself, block by block (pass the high-precision input; leave "
                        "fp8_all_gather out)")


def block_scaled_gemm(workspace: WeightWorkspace, x, weight, bias, q_input: Quantizer, q_weight: Quantizer,
                      q_grad: Quantizer, config: GemmConfig, act_dtype: torch.dtype, grad: bool,
                      is_first_microbatch: Optional[bool], path: Optional[list] = None,
                      alone: bool = False, parts: Optional[list] = None, widths: Optional[Tuple[int, ...]] = None,
                      gated: Optional[Tuple[str, Quantizer]] = None, fp8_wgrad: bool = True):
    """One block-scaled GEMM (x @ weight^T + bias) with its backward, the weight's block cast
    kept in `workspace`: the C++ node where it takes the call (_native_block_forward), else the
    Python node. The fused modules under BlockScaling compose their norm and activation in
    high precision around it (layernorm_linear.py, layernorm_mlp.py). path: where an eager
    call notes which node ran, or why not (Linear._path). alone: x is cast for this GEMM
    alone, though q_input is tied (the tie's stacked GEMM: no sibling asks for the cast).
    parts: weight's row-stacked parts (the tie's weights; weight is their torch.cat), which
    a traced call casts in place (WeightWorkspace.get). widths: the output split along its
    last dim (the tie's members' out_features), a tuple of tensors (_LinearFn's widths).
    gated: (act, the next layer's input quantizer): the output (M, 2F) is a gated MLP's g | u,
    and comes back as act(g) * u's stand-in and cast (_LinearFn's gated). A cast offered for x
    (modules/stacked.py: a gated MLP's product, a compiled RMSNorm's output) is taken instead
    of casting x. fp8_wgrad (BlockScaling's): False, the wgrad in act_dtype from X and dY
    (_LinearFn), X and dY cast one way only; the Python node."""
    given = stacked.take_offer(q_input, x)
    if not fp8_wgrad and given is not None and given[1] is not None:
        raise RuntimeError("fp8train bug: a two-way cast was offered under BlockScaling(fp8_wgrad=False)")
    if x.is_cuda and native.ENABLED and given is None and gated is None and fp8_wgrad:
        y = _native_block_forward(workspace, x, weight, bias, q_input, q_weight, q_grad, act_dtype, grad,
                                  is_first_microbatch, path if path is not None else [None], alone)
        if y is not None:
            return y if widths is None else y.split(widths, dim=-1)
    elif path is not None:
        path[0] = _OFF_CUDA if not x.is_cuda else _SWITCHED_OFF if not native.ENABLED or fp8_wgrad else _HIGH_WGRAD
    w_fp8 = workspace.get(weight, q_weight, is_first_microbatch, need_transpose=grad and x.requires_grad, parts=parts)
    need_wgrad = grad and weight.requires_grad
    shared = given or ((None,) * 5 if alone else _shared_cast(x, q_input, need_wgrad and fp8_wgrad))
    return _LinearFn.apply(x, weight, bias, w_fp8, q_input, q_grad, config, act_dtype, need_wgrad, *shared, widths,
                           gated, fp8_wgrad)


def _shared_cast(x, q_input: Quantizer, need_wgrad: bool) -> Tuple[Optional[torch.Tensor], ...]:
    """The cast of an x that sibling layers read (Quantizer.cast_shared) as _LinearFn's last
    five arguments (data (M, K), data_t (K, Mp), scale_inv, data_t's own scale_inv where it
    has one (block scaling), else None, and x_hp: None), or five Nones where the layer casts x itself. Made
    outside _LinearFn: in a torch.compile trace the memo that serves the siblings is module
    state, which an autograd.Function's trace may not write (nor take one tensor twice)."""
    if q_input.sharing == 1 or isinstance(x, Float8Tensor):
        return None, None, None, None, None
    xq = q_input.cast_shared(x, transpose=need_wgrad)
    t_scale_inv = xq.transposed_scale_inv
    return xq.data, xq.data_t, xq.scale_inv, None if t_scale_inv is xq.scale_inv else t_scale_inv, None


def node_refusal(x: torch.Tensor, act_dtype: torch.dtype) -> Optional[str]:
    """Why the C++ node cannot take the CUDA input x with act_dtype activations, as
    layer._path says it (a Float8Tensor input, a Triton launch hook, a dtype it has no path
    for, another device than the current one), or None."""
    if isinstance(x, Float8Tensor):
        return "Python node: a Float8Tensor input"
    if native.hooks_installed():
        return "Python node: a Triton launch hook is installed (a profiler)"
    if act_dtype not in native.DTYPE_CODES or x.dtype not in native.DTYPE_CODES:
        return f"Python node: no C++ path for a {x.dtype} input with {act_dtype} activations"
    if x.get_device() != torch._C._cuda_getDevice():
        return f"Python node: input on cuda:{x.get_device()}, not the current device"
    return None


def _native_block_forward(workspace: WeightWorkspace, x, weight, bias, q_input: Quantizer, q_weight: Quantizer,
                          q_grad: Quantizer, act_dtype: torch.dtype, grad: bool, is_first_microbatch: Optional[bool],
                          path: list, alone: bool = False) -> Optional[torch.Tensor]:
    """_native_forward under BlockScaling: the same C++ node with block-scaled casts (the
    quantizers' block plans) and GEMMs (cuBLASLt's block scaling), the weight's 128 x 128 cast
    kept in `workspace` (cast by Python, or re-cast in place by the node: a tile plan) and its tile scales laid out for the GEMM here; or None with
    nothing done where the Python node must run (as _native_forward's, and: e5m2 operands,
    which only the Python node reports, and row counts that are not multiples of 4, which the
    Python node pads)."""
    if torch.compiler.is_compiling():
        return None
    refusal = node_refusal(x, act_dtype)
    if refusal is not None:
        path[0] = refusal
        return None
    code = native.DTYPE_CODES[act_dtype]
    e4m3 = torch.float8_e4m3fn
    if not (q_input.dtype == q_weight.dtype == q_grad.dtype == e4m3):
        path[0] = "Python node: BlockScaling with e5m2 (the block GEMM takes e4m3 only)"
        return None
    k = x.shape[-1]
    m = x.numel() // k
    if m % 4 or m == 0:
        path[0] = f"Python node: BlockScaling with {m} rows (the C++ block GEMM takes a multiple of 4)"
        return None
    need_dgrad = grad and x.requires_grad
    need_wgrad = grad and weight.requires_grad
    need_dbias = grad and bias is not None and bias.requires_grad
    # sibling layers read x: its one cast is Python's (cast_shared), passed in
    shared = q_input.sharing > 1 and not alone
    x_plan = None if shared else q_input.native_plan((m, k), x.dtype, need_wgrad, None)
    grad_plan = None
    if need_dgrad or need_wgrad or need_dbias:
        grad_plan = q_grad.native_plan((m, weight.shape[0]), act_dtype, need_wgrad, bias.dtype if need_dbias else None)
        if grad_plan is None:
            path[0] = _no_plan_reason(q_grad, m)
            return None
    if x_plan is None and not shared:
        path[0] = _no_plan_reason(q_input, m)
        return None
    path[0] = CPP_NODE
    # the kept cast re-cast by the node (a tile plan), or cast or kept here
    w, w_plan = workspace.for_native(weight, q_weight, is_first_microbatch, need_transpose=need_dgrad)
    w_scales, w_t_scales = workspace.block_gemm_scales(w, need_dgrad)  # the GEMMs' layouts, kept with w
    xc = (None, None, None, None)
    if shared:
        cast = q_input.cast_shared(x, transpose=need_wgrad)
        xc = (cast.data.view(m, k), cast.data_t, cast.scale_inv,
              None if cast.scale_inv_t is None else cast.scale_inv_t.t())  # (Mb, K) as the C++ cast writes it
    return native.extension().linear_forward(
        x, weight, bias, w.data, w_scales, w.data_t if need_dgrad else None, x_plan, grad_plan, False, False, False,
        code, need_wgrad, w_plan, *xc, w_t_scales)


def _native_forward(layer: Linear, x, weight, bias, q_input: Quantizer, q_weight: Quantizer, q_grad: Quantizer,
                    config: GemmConfig, act_dtype: torch.dtype, grad: bool,
                    is_first_microbatch: Optional[bool]) -> Optional[torch.Tensor]:
    """The layer's FP8 forward through the C++ node (kernels/native.py), or None (with nothing
    done) where the Python node must run: a Float8Tensor input, traced code, launch hooks (a
    profiler), x off the current device, an activation dtype or cast the C++ side does not
    take, and the first calls of each input shape (the Python path prepares the launches the
    C++ plans reuse). The weight's steady-state re-cast runs inside the C++ call too; so does
    x's cast, except for an input quantizer shared by sibling layers: x is cast once for them
    all in Python (Quantizer.cast_shared) and the C++ call takes the cast.
    Eager calls note which node ran, or why not, in layer._path."""
    if torch.compiler.is_compiling():
        return None
    path = layer._path
    refusal = node_refusal(x, act_dtype)
    if refusal is not None:
        path[0] = refusal
        return None
    code = native.DTYPE_CODES[act_dtype]
    k = x.shape[-1]
    m = x.numel() // k
    need_dgrad = grad and x.requires_grad
    need_wgrad = grad and weight.requires_grad
    need_dbias = grad and bias is not None and bias.requires_grad
    shared = q_input.sharing > 1  # sibling layers read x: its one cast is Python's (cast_shared), passed in
    x_plan = None if shared else q_input.native_plan((m, k), x.dtype, need_wgrad, None)
    need_grad_plan = need_dgrad or need_wgrad or need_dbias
    grad_plan = None
    if (shared or x_plan is not None) and need_grad_plan:
        grad_plan = q_grad.native_plan((m, weight.shape[0]), act_dtype, need_wgrad, bias.dtype if need_dbias else None)
    if (x_plan is None and not shared) or (grad_plan is None and need_grad_plan):
        path[0] = _no_plan_reason(q_input if x_plan is None and not shared else q_grad, m)
        return None
    path[0] = CPP_NODE
    w_fp8, w_cast = layer._workspace.for_native(weight, q_weight, is_first_microbatch, need_dgrad,
                                                layer.weight_cast_skip)
    w_t = w_fp8.transpose_data() if need_dgrad else None
    xc = q_input.cast_shared(x, transpose=need_wgrad)[:3] if shared else (None, None, None)  # (M, K), (K, Mp), (1,)
    return native.extension().linear_forward(
        x, weight, bias, w_fp8._data, w_fp8._scale_inv, w_t, x_plan, grad_plan, config.fprop_fast_accum,
        config.dgrad_fast_accum, config.wgrad_fast_accum, code, need_wgrad, w_cast, *xc)


def _no_plan_reason(q: Quantizer, rows: int) -> str:
    """Why a quantizer has no C++ cast plan for this call (Quantizer.native_plan is None)."""
    if native.extension() is None:
        return f"Python node: the C++ extension could not be built ({native.failure()})"
    if not q.calibrated:
        return f"Python node: the {q.role.name} quantizer calibrates on this call (delayed scaling's first)"
    return (f"Python node: no C++ cast plan yet for {rows} rows ({q.role.name}): the Python node prepares the "
            "launches on its first call of a shape, the C++ node reuses them from the next")


class _LinearFn(torch.autograd.Function):
    """Forward: fprop GEMM. Backward: one cast of dY (with its transposed copy), dgrad, wgrad.

    Saved for backward: X's transposed FP8 copy (K, Mp) and its scale_inv (block scaling: the
    copy's own per-block scale_inv_t), not X itself. The weight workspace is kept by
    reference: it is rewritten in place only by a later forward.

    widths: the output comes back split along its last dim, one output per width (a stacked
    tie's members, modules/stacked.py), so that the backward receives their gradients apart
    and casts them where they lie (BlockScalingQuantizer.cast_parts) rather than from a
    concatenation that a compiled graph would compute in one pointwise kernel over all of
    them (Inductor's pointwise cat: 0.3 ms a step at HF Llama h1024, fifty-fifth session).

    gated: (act, q_next), for a stacked gate/up tie whose output (M, 2F) is a gated MLP's
    g | u (linear.gated_stacked_forward): the forward returns, instead of g and u, a stand-in
    for act(g) * u (uninitialized, of its shape: the down projection reads only its shape and
    takes its gradient) and the product's two-way cast by q_next (BlockScalingQuantizer.
    cast_gated: computed in the cast's read, never stored), as the down projection's four
    shared-cast arguments. Saved too: g | u. The backward receives dA, the product's gradient,
    and casts dg | du from dA, g and u in one kernel (cast_gated_grad): neither is stored.

    fp8_wgrad False (BlockScaling's): X and dY are cast one way only (no transposed copies),
    X is saved in act_dtype instead of X's transposed copy, and the wgrad is dY^T X in
    act_dtype, what a high-precision Linear's backward computes (autocast's: rounded to
    act_dtype, then to the weight's dtype).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], w_fp8: Float8Tensor,
                q_input: Quantizer, q_grad: Quantizer, config: GemmConfig, act_dtype: torch.dtype,
                need_wgrad: bool, x_data: Optional[torch.Tensor] = None, x_t: Optional[torch.Tensor] = None,
                x_scale_inv: Optional[torch.Tensor] = None, x_t_scale_inv: Optional[torch.Tensor] = None,
                x_hp: Optional[torch.Tensor] = None,
                widths: Optional[Tuple[int, ...]] = None, gated: Optional[Tuple[str, Quantizer]] = None,
                fp8_wgrad: bool = True):
        in_shape = x.shape
        cast_t = need_wgrad and fp8_wgrad  # X's transposed copy, the FP8 wgrad's operand
        if isinstance(x, Float8Tensor):
            x_data, x_scale_inv = _rows(x.fp8_data), x.scale_inv
            x_t = x.transpose_data(padded=True) if cast_t else None
            x_t_scale_inv = x_scale_inv
        elif x_data is not None:  # sibling layers read x: its one cast, made for them all (_shared_cast)
            x_t_scale_inv = x_scale_inv if x_t_scale_inv is None else x_t_scale_inv
        else:
            xq = q_input.cast(_rows(x), transpose=cast_t)  # (M, K), (K, Mp)
            x_data, x_t, x_scale_inv, x_t_scale_inv = xq.data, xq.data_t, xq.scale_inv, xq.transposed_scale_inv
        y = gemm.fprop(x_data, x_scale_inv, *weight_operands(w_fp8), config, act_dtype, bias)  # (M, N)
        ctx.w_fp8, ctx.q_grad, ctx.config = w_fp8, q_grad, config
        ctx.in_shape, ctx.act_dtype, ctx.need_wgrad = in_shape, act_dtype, need_wgrad
        ctx.weight_dtype = weight.dtype
        ctx.act = None if gated is None else gated[0]
        ctx.fp8_wgrad = fp8_wgrad
        if x_hp is None and need_wgrad and not cast_t:
            x_hp = in_dtype(_rows(x), act_dtype)
        saved = (x_t, x_t_scale_inv) if cast_t else (x_hp,) if need_wgrad else ()
        if gated is not None:
            ctx.save_for_backward(*saved, y)
            f = y.shape[1] // 2
            ctx.set_materialize_grads(False)  # the cast's outputs take no gradient
            if not fp8_wgrad:  # the product itself, stored by its cast's kernel: down's bf16 wgrad reads it
                hq, h = gated[1].cast_gated_kept(y[:, :f], y[:, f:], gated[0], act_dtype)
                ctx.mark_non_differentiable(hq.data, hq.scale_inv)
                return h if len(in_shape) == 2 else h.view(*in_shape[:-1], f), hq.data, hq.scale_inv
            hq = gated[1].cast_gated(y[:, :f], y[:, f:], gated[0])
            ctx.mark_non_differentiable(hq.data, hq.data_t, hq.scale_inv, hq.scale_inv_t)
            return y.new_empty(*in_shape[:-1], f), hq.data, hq.data_t, hq.scale_inv, hq.scale_inv_t
        ctx.save_for_backward(*saved)
        y = y if len(in_shape) == 2 else unsafe_view(y, (*in_shape[:-1], y.shape[-1]))
        return y if widths is None else y.split(widths, dim=-1)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        if ctx.act is not None:
            dys = dys[:1]  # dA; the cast's outputs take none
        dys = [_rows(d) if d.dtype == ctx.act_dtype else _rows(d).to(ctx.act_dtype) for d in dys]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.need_wgrad
        cast_t = need_wgrad and ctx.fp8_wgrad  # dY's transposed copy, the FP8 wgrad's operand
        dy2 = None
        # (M, N), (N, Mp); db (N,) float32 from the same read of dY (autograd casts it to the bias dtype)
        if ctx.act is not None:  # dg | du from dA, g and u (the saved g | u)
            y = ctx.saved_tensors[-1]
            f = y.shape[1] // 2
            if ctx.fp8_wgrad:
                dyq = ctx.q_grad.cast_gated_grad(dys[0], y[:, :f], y[:, f:], ctx.act)
            else:  # one way, dg | du kept too, for the bf16 wgrad
                dyq, dy2 = ctx.q_grad.cast_gated_grad_kept(dys[0], y[:, :f], y[:, f:], ctx.act, ctx.act_dtype)
        elif len(dys) > 1 and (cast_t or not ctx.fp8_wgrad):  # a stacked tie's gradients, read where they lie
            dyq = ctx.q_grad.cast_parts(dys, transpose=cast_t, dbias=ctx.needs_input_grad[2])
        else:
            dy2 = dys[0] if len(dys) == 1 else torch.cat(dys, dim=1)
            dyq = ctx.q_grad.cast(dy2, transpose=cast_t, dbias=ctx.needs_input_grad[2])
        dx = dw = None
        if need_dgrad:
            dx = gemm.dgrad(dyq.data, dyq.scale_inv, *weight_transposed(ctx.w_fp8), ctx.config, ctx.act_dtype)
            if len(ctx.in_shape) != 2:
                dx = dx.view(*ctx.in_shape)  # ints, not a torch.Size: parsed ~2 us faster
        if cast_t:
            x_t, x_t_scale_inv = ctx.saved_tensors[:2]
            dw = gemm.wgrad(dyq.data_t, dyq.transposed_scale_inv, x_t, x_t_scale_inv, ctx.config, ctx.weight_dtype)
        elif need_wgrad:  # each part's rows of dW from its own dY: no concatenated dY
            x_saved = ctx.saved_tensors[0]
            dw = torch.cat([d.t() @ x_saved for d in dys]) if dy2 is None else dy2.t() @ x_saved
            dw = dw.to(ctx.weight_dtype)
        return dx, dw, dyq.dbias, None, None, None, None, None, None, None, None, None, None, None, None, None, None
