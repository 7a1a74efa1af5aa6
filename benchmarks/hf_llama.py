"""A model users bring: Hugging Face `LlamaForCausalLM`, trained as people train it (GPU machine).

Built from a `transformers.LlamaConfig` (random initialisation, nothing downloaded) over a byte
vocabulary (256) and trained on bytes of the Python standard library (fp8train.data): FP32
master weights, `torch.autocast(bfloat16)`, fused AdamW (lr 3e-4), 8 x 1024 = 8192 tokens per
step, HF's own loss. Shapes (`--shapes`, issue 24):

  h1024  hidden 1024, ffn 2816, 4 layers, 16 heads / 4 KV heads
  h2048  hidden 2048, ffn 5632, 8 layers, 16 / 4
  h4096  hidden 4096, ffn 14336, 2 layers, 32 / 8
  block4096  one layer of h4096's width, 4 x 2048 tokens (TARGETS.md's T5: a GPT-style block,
         attention + MLP, h 4096, sequence 2048)
  tiny   hidden 64, ffn 128, 2 layers, 4 / 2, 2 x 64 tokens (a smoke run, CPU included)

Variants (`--variants`, all by default; every one from the same initial weights and batches):

  bf16 eager / bf16 compile / bf16 compile-ro  the model as it is; compile-ro: mode="reduce-overhead"
  fp8 eager {delayed,current}                  fp8train.convert(model, recipe, not lm_head), the
                                               step under fp8train.autocast inside torch.autocast
  fp8 compile {delayed,current}, fp8 compile-ro {delayed,current}
                                               the same, torch.compile(model) after one eager step
  fp8 compile delayed aten-mm                  the same, compiled GEMMs through torch._scaled_mm
                                               instead of the extension's operator (an A/B of it)
  fp8 eager block, fp8 compile block, fp8 compile-ro block
                                               BlockScaling (1x128 / 128x128 block scales)
  fp8 compile block apart                      BlockScaling(stack_siblings=False): q/k/v and
                                               gate/up each their own GEMMs (the default stacks
                                               them: modules/stacked.py; an A/B of it)
  fp8 eager block stacked                      eager calls stacked too (modules.stacked.EAGER set
                                               around this variant's steps; an A/B of it)
  fp8 {eager,compile} block hiwgrad            BlockScaling(fp8_wgrad=False): the wgrad GEMMs in
                                               bf16 from X and dY, no transposed casts (the
                                               gated MLP's and norms' fused casts one-way,
                                               keeping what the wgrads read); with
                                               "ungated unnormed": those unfused
  fp8 compile block tuned                      the block GEMMs tuned per problem
                                               (native.set_block_gemm_tuning(True) around this
                                               variant's steps; opt-in: an A/B of the tuning)
  fp8 {eager,compile} block unclamped          the two-way block cast without its clamp (the
                                               GPU's FP8 conversion saturates by itself:
                                               block_kernel.BlockShapes.both_clamp off around
                                               this variant's steps, compiles included; an A/B)
  fp8 {eager,compile} block unmasked           the two-way block casts unmasked on whole tiles,
                                               8 warps, no clamp, the gated forms 8 / 8 warps,
                                               the gradients' one launch per side
                                               (BlockShapes(both=8, both_clamp=False, gated=(8, 8),
                                               norm=8, even=True, gated_sides=True) around this variant's
                                               steps: every form at 128 registers, two programs
                                               an SM; an A/B, 0.13 ms a step slower on the H100)
  fp8 compile block [unmasked] packed          the transposed copies packed in words
                                               (BlockShapes.packed_t: ~18% fewer instructions),
                                               on the default forms or the unmasked ones
                                               (compiled variants recompile under their own
                                               forms: kernels.forms.KEY)
  <a block variant> forms:NAME=VALUE+...       the block casts' launch shapes set field by
                                               field around this variant's steps, e.g. "fp8
                                               compile block forms:both_clamp=false+norm=8+
                                               gated=4x8" (BlockShapes fields; values true,
                                               false, an int, ints joined by x)
  fp8 compile block ungated                    the gated MLP's product and its gradients stored
                                               and cast apart (modules.stacked.GATED off around
                                               this variant's steps; the default casts them inside
                                               the stacked gate/up node: an A/B of it)
  fp8 compile block unnormed                   the RMSNorms' outputs stored and cast by their
                                               stacked readers (modules.stacked.NORMS off; the
                                               default casts them inside the norm: an A/B of it)
  fp8 compile block ungated unnormed           both off: the stacked step before either
  fp8 {eager,compile} block torch-gemm         the same, the block GEMMs through
                                               torch.nn.functional.scaled_mm instead of the
                                               extension's cuBLASLt call (native.BLOCK_GEMM off;
                                               an A/B of it)
  fp8 {eager,compile} delayed unshared         without shared input casts (every fp8 variant but
                                               these ties q/k/v's and gate/up's input quantizers:
                                               modules.base.SHARE_INPUT_CASTS, off while these
                                               are built; an A/B of it)
  fp8 eager {current,delayed} unfused          without fp8train's RMSNorm (convert's fuse_norms=False: HF's
                                               norm as it is, the Linears cast its output; an A/B of it)
  fp8 eager {current,delayed} unfused-mlp      without fp8train's GatedMLP (convert's fuse_mlps=False:
                                               HF's silu(gate) * up as torch ops; an A/B of it)
  bf16 compile combo, fp8 compile {delayed,current} combo, torchao compile combo
                                               the same compiled with Inductor's combo kernels
                                               (options={"combo_kernels": True}: independent
                                               kernels, such as the weights' amaxes, launched as
                                               one; a user's compile option, measured alike for all)
  bf16 eager ckpt, fp8 eager {current,delayed} ckpt, bf16 compile ckpt, fp8 compile current ckpt,
  fp8 compile block ckpt, torchao compile ckpt the same with HF's activation checkpointing (every
                                               decoder layer recomputed in the backward;
                                               torch.utils.checkpoint, not reentrant), called with
                                               use_cache=False (HF's warning about it otherwise
                                               breaks the compiled graph), compiled with Dynamo's
                                               skip_fwd_side_effects_in_bwd_under_checkpoint (HF's
                                               attention sets a context variable, which otherwise
                                               breaks the graph at every checkpointed layer and
                                               runs it eagerly): memory against speed
  torchao compile, torchao compile-ro          torchao.float8 convert_to_float8_training
                                               (tensorwise, not lm_head) + torch.compile, when
                                               torchao imports (TARGETS.md: carry its wheel)

Every variant is built and warmed up first; then `--rounds` rounds time `--steps` steps of
each variant back to back (one sync at each end), the order reversed every other round, so
that the host's drift between rounds (up to 2x here) falls on every variant alike. Per
variant: wall ms per step (the median round), device ms per step (the kernels' time under
torch.profiler over `--profile-steps` more steps), their ratio (T7: wall <= 1.10x device),
device events (kernels, copies) per step, with `--host-top N` the N largest host self times per
step, with `--device-top N` the device time per step by kernel kind (GEMM, attention, ...)
and the N largest kernels, with `--python-top N` the N Python functions with the largest
self time per step under cProfile (where a host-bound step's host time goes, by function),
with `--idle-top N` the GPU's idle time per step between kernels and its N largest shares by
the host op that launched the kernel after each gap (where wall time exceeds device time),
peak memory above what the variants built before it hold (over one steady step; the
warm-up's, which holds the compiles and fp8train's eager first step, in the JSON), the
last round's mean loss (it falls with the steps taken: `--rounds` and `--steps` move it; the
optimizer steps behind it are printed beside it), and the median over rounds of the within-round ratio to BF16 eager
and to torchao compile (T7: fp8train <= 0.85x torchao), with the number of rounds in which the
variant beat BF16 eager (a host-bound step's median ratio near 1 is a tie unless most rounds
agree). A variant that fails prints its
error in the table instead of
ending the run. Writes JSON; never asserts on time.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import json
import re
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

import fp8train
from fp8train.data import ByteCorpus
from fp8train.kernels import native
from fp8train.modules import base as module_base
from fp8train.modules import stacked


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    batch: int = 8
    seq: int = 1024


SHAPES = {
    "h1024": Shape(1024, 2816, 4, 16, 4),
    "h2048": Shape(2048, 5632, 8, 16, 4),
    "h4096": Shape(4096, 14336, 2, 32, 8),
    "block4096": Shape(4096, 14336, 1, 32, 8, batch=4, seq=2048),
    "tiny": Shape(64, 128, 2, 4, 2, batch=2, seq=64),
}
# the library's defaults, restored after each step
_BLOCK_GEMM = native.BLOCK_GEMM
_EAGER_STACKED = stacked.EAGER
_GATED, _NORMS = stacked.GATED, stacked.NORMS
RECIPES = {"delayed": fp8train.DelayedScaling, "current": fp8train.CurrentScaling, "block": fp8train.BlockScaling}
VARIANTS = ["bf16 eager", "bf16 compile", "bf16 compile-ro", "fp8 eager delayed", "fp8 eager current",
            "fp8 compile delayed", "fp8 compile current", "fp8 compile-ro delayed", "fp8 compile-ro current",
            "fp8 compile delayed aten-mm",
            "fp8 eager delayed unshared", "fp8 compile delayed unshared", "fp8 eager current unfused",
            "fp8 eager delayed unfused", "fp8 eager current unfused-mlp", "fp8 eager delayed unfused-mlp",
            "fp8 eager block", "fp8 compile block",
            "fp8 compile-ro block",
            "fp8 compile block apart", "fp8 compile block tuned", "fp8 eager block hiwgrad", "fp8 compile block hiwgrad",
            "fp8 compile block hiwgrad ungated unnormed", "fp8 eager block stacked",
            "fp8 eager block unclamped", "fp8 compile block unclamped",
            "fp8 eager block unmasked", "fp8 compile block unmasked", "fp8 compile block packed",
            "fp8 eager block unmasked packed", "fp8 compile block unmasked packed", "fp8 compile block ungated",
            "fp8 compile block unnormed", "fp8 compile block ungated unnormed",
            "fp8 eager block torch-gemm", "fp8 compile block torch-gemm", "torchao compile", "torchao compile-ro",
            "bf16 compile combo", "fp8 compile delayed combo", "fp8 compile current combo", "torchao compile combo",
            "bf16 eager ckpt", "fp8 eager current ckpt", "fp8 eager delayed ckpt", "bf16 compile ckpt",
            "fp8 compile current ckpt", "fp8 compile block ckpt", "torchao compile ckpt"]
# variant words that are torch.compile options (a user's choice, not fp8train's)
COMPILE_OPTIONS = {"combo": {"combo_kernels": True}}


def recipe_of(words):
    """The fp8 recipe a variant's words after "fp8 <mode>" name: its defaults, but `apart`
    turns BlockScaling's stacked siblings off and `hiwgrad` its FP8 wgrad."""
    return RECIPES[words[0]](**({"stack_siblings": False} if "apart" in words else {}),
                             **({"fp8_wgrad": False} if "hiwgrad" in words else {}))


def compile_options(words) -> dict:
    """torch.compile's options for a variant's words: those COMPILE_OPTIONS names that this
    torch's Inductor config has."""
    import torch._inductor.config as inductor_config
    return {k: v for word in words for k, v in COMPILE_OPTIONS.get(word, {}).items() if hasattr(inductor_config, k)}


def block_forms(word: str) -> Dict[str, object]:
    """A block variant's last word `forms:NAME=VALUE+...` as block_kernel.BlockShapes fields:
    VALUE true or false, an int, or ints joined by x for a tuple (gated=4x8). Any launch
    shapes timed without a variant of their own; BlockShapes checks the names and values."""
    if not word.startswith("forms:") or word == "forms:":
        raise ValueError(f"{word!r}: expected forms:NAME=VALUE+NAME=VALUE...")
    forms: Dict[str, object] = {}
    for item in word[len("forms:"):].split("+"):
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier() or not value or name in forms:
            raise ValueError(f"{word!r}: {item!r} is not NAME=VALUE (each name once)")
        if value in ("true", "false"):
            forms[name] = value == "true"
        elif re.fullmatch(r"\d+(x\d+)+", value):
            forms[name] = tuple(int(v) for v in value.split("x"))
        elif value.isdigit():
            forms[name] = int(value)
        else:
            raise ValueError(f"{word!r}: {value!r} is not true, false, an int or ints joined by x")
    return forms


def split_forms(variant: str) -> Tuple[str, Dict[str, object]]:
    """(the variant without its forms: word, the word's BlockShapes fields; {} without one)."""
    words = variant.split()
    if words and words[-1].startswith("forms:"):
        return " ".join(words[:-1]), block_forms(words[-1])
    return variant, {}


def checked_variants(parser: argparse.ArgumentParser, variants: List[str], known: List[str]) -> List[str]:
    """`variants` checked against `known` (a parser error names an unknown one), less the
    torchao ones where torchao does not import (said once). A block variant may end in a
    forms: word (block_forms)."""
    for v in variants:
        try:
            base, forms = split_forms(v)
        except ValueError as e:
            parser.error(f"variant {v!r}: {e}")
        if base not in known or (forms and "block" not in base.split()):
            parser.error(f"unknown variant {v!r}; one of {known}, a block one maybe ending in forms:NAME=VALUE+...")
    try:
        import torchao  # noqa: F401
    except ImportError:
        if any(v.startswith("torchao") for v in variants):
            print("torchao not importable: its variants are skipped")
        variants = [v for v in variants if not v.startswith("torchao")]
    return variants


def build_llama(shape: Shape, device: torch.device, seed: int = 0):
    """A randomly initialised LlamaForCausalLM over bytes, FP32 parameters, no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device)


def checkpointing(model: torch.nn.Module, reentrant: bool = False) -> None:
    """HF's activation checkpointing of every decoder layer (torch.utils.checkpoint, not
    reentrant by default: torch's advice); activation_checkpointing_enable from transformers
    5.2x, gradient_checkpointing_enable before (the GPU machine's 5.17)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def not_lm_head(name: str, *_) -> bool:
    return not name.endswith("lm_head")


def prepare(variant: str, model: torch.nn.Module, first_step: Callable[[], None]):
    """Convert and compile `model` as `variant` says; returns (model, fp8 recipe or None).
    first_step runs one eager step (fp8train compiles after one, as the issue's user did)."""
    kind, mode, *rest = variant.split()
    recipe = None
    if "ckpt" in rest:
        checkpointing(model)
        if mode.startswith("compile"):  # read while tracing; a checkpointed model's alone (torchtitan sets it too)
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if kind == "fp8":
        recipe = recipe_of(rest)
        fp8train.convert(model, recipe, filter_fn=not_lm_head, fuse_norms="unfused" not in rest,
                         fuse_mlps="unfused-mlp" not in rest)
    elif kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda m, fqn: not_lm_head(fqn))
    if mode.startswith("compile"):
        if kind == "fp8":
            first_step(model, recipe)
        if mode == "compile-ro":
            model = torch.compile(model, mode="reduce-overhead")
        else:
            options = compile_options(rest)
            model = torch.compile(model, options=options or None)
    return model, recipe


class Runner:
    """One variant, built, converted, compiled and warmed up (3 steps), kept alive so that the
    variants' timed steps can alternate (`timed`)."""

    def __init__(self, variant: str, shape: Shape, device: torch.device, batches):
        gc.collect()
        self.variant, self.device, self.batches = variant, device, batches
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        model = build_llama(shape, device)
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
        self.count = 0
        self.ro = "compile-ro" in variant.split()
        self.aten_mm = "aten-mm" in variant.split()
        self.call_kwargs = {"use_cache": False} if "ckpt" in variant.split() else {}
        self.block_gemm = "torch-gemm" not in variant.split() and _BLOCK_GEMM
        self.eager_stacked = "stacked" in variant.split()
        self.gated = "ungated" not in variant.split() and _GATED
        self.norms = "unnormed" not in variant.split() and _NORMS
        self.tuned = "tuned" in variant.split()
        self.unclamped = "unclamped" in variant.split()
        self.unmasked = "unmasked" in variant.split()
        self.packed = "packed" in variant.split()
        self.forms = split_forms(variant)[1]
        sharing, module_base.SHARE_INPUT_CASTS = module_base.SHARE_INPUT_CASTS, "unshared" not in variant.split()
        try:  # ties form at the first FP8 forward (here) and stay
            self.model, self.recipe = prepare(variant, model, self.step)
            self.losses: List[float] = []
            for _ in range(3):  # warm-up (compiles)
                self.step(self.model, self.recipe)
        finally:
            module_base.SHARE_INPUT_CASTS = sharing
        self.sync()
        # What this variant allocated at its peak, above what the variants built before it
        # hold: over the warm-up (compiles, and fp8train's eager first step, whose HF
        # activations are larger than a compiled step's), then over one more step (a steady
        # step's peak: parameters, optimizer state, caches and that step's activations).
        self.warmup_peak_gib = self.peak_gib = None
        if cuda:
            self.warmup_peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
            torch.cuda.reset_peak_memory_stats()
            self.step(self.model, self.recipe)
            self.sync()
            self.peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        self.fp8_layers = sum(isinstance(m, fp8train.Linear) for m in self.model.modules())
        self.shared_groups = len(fp8train.inspect.shared_input_casts(self.model))
        # which node the Linears' last eager call (warm-up) ran, before the profiler's hooks change it
        eager = variant.split()[:2] == ["fp8", "eager"]
        self.paths = dict(collections.Counter(fp8train.inspect.execution_paths(self.model).values())) if eager else {}
        self.norm_paths = dict(collections.Counter(fp8train.inspect.norm_paths(self.model).values())) if eager else {}
        self.mlp_paths = dict(collections.Counter(fp8train.inspect.mlp_paths(self.model).values())) if eager else {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self, m, recipe):
        # the A/B switches are set around each of this variant's steps: Dynamo guards on them
        native.GEMM_OP, native.BLOCK_GEMM, stacked.EAGER = not self.aten_mm, self.block_gemm, self.eager_stacked
        stacked.GATED, stacked.NORMS = self.gated, self.norms
        if self.tuned:  # read by the extension at each call, not traced
            native.set_block_gemm_tuning(True)
        shapes = contextlib.nullcontext()
        forms = {**({"both_clamp": False} if self.unclamped else {}),
                 **(dict(both=8, both_clamp=False, gated=(8, 8), norm=8, even=True, gated_sides=True)
                    if self.unmasked else {}),
                 **({"packed_t": True} if self.packed else {}), **self.forms}
        if forms:  # read where a cast's launch is made: eager calls, a compile's trace (baked in)
            from fp8train.kernels import block_kernel  # needs triton
            shapes = block_kernel.override_shapes(replace(block_kernel.BlockShapes(), **forms))
        try:
            with shapes:
                return self._step(m, recipe)
        finally:
            native.GEMM_OP, native.BLOCK_GEMM, stacked.EAGER = True, _BLOCK_GEMM, _EAGER_STACKED
            stacked.GATED, stacked.NORMS = _GATED, _NORMS
            if self.tuned:
                native.set_block_gemm_tuning(False)

    def _step(self, m, recipe):
        x, y = self.batches[self.count % len(self.batches)]
        self.count += 1
        if self.ro:
            torch.compiler.cudagraph_mark_step_begin()
        fp8 = fp8train.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with torch.autocast(self.device.type, dtype=torch.bfloat16), fp8:
            loss = m(input_ids=x, labels=y, **self.call_kwargs).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # a copy: under reduce-overhead the loss lives in the CUDA graph's memory, which the next
        # replay overwrites (`timed` reads its steps' losses after the last one; held, every
        # compile-ro step read as the last replay's value)
        return loss.detach().clone()

    def timed(self, steps: int) -> float:
        """ms per step over `steps` steps back to back (one sync at each end)."""
        self.sync()
        t0 = time.perf_counter()
        out = [self.step(self.model, self.recipe) for _ in range(steps)]
        self.sync()
        self.losses = [float(v) for v in out]
        self.loss_steps = self.count  # the optimizer steps taken (warm-up included) when these losses ended
        return (time.perf_counter() - t0) * 1e3 / steps

    def profile(self, steps: int, host_top: int = 0, device_top: int = 0, idle_top: int = 0) -> Dict:
        """Under torch.profiler: the kernels' time per step (the device's own events only: a
        CPU op's self device time would count its kernels a second time), the device events
        (kernels, copies) per step, with host_top the `host_top` largest host self times per
        step (where a host-bound step spends its time), and with device_top the device time per
        step of each kernel_kind and of the `device_top` largest kernels (where a GPU-bound step
        spends it), and with idle_top the GPU's idle time between kernels by the host op that
        launched the kernel after each gap (idle_gaps: where wall time exceeds device time)."""
        if steps <= 0:
            return {"device_ms": None, "kernels_per_step": None, "host_top": [], "device_kinds": {},
                    "device_top": [], "idle_top": []}
        from torch.profiler import ProfilerActivity, profile
        cuda = self.device.type == "cuda"  # on the CPU: the host columns only (and this code runs in CPU tests)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                self.step(self.model, self.recipe)
            self.sync()
        events = [e for e in prof.key_averages() if is_device_work(e)]
        top = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda e: -e.self_cpu_time_total)[:host_top]
        kinds: Dict[str, float] = {}
        for e in events:
            kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + e.self_device_time_total / 1e3 / steps
        largest = sorted(events, key=lambda e: -e.self_device_time_total)[:device_top]
        return {"device_ms": sum(e.self_device_time_total for e in events) / 1e3 / steps if cuda else None,
                "kernels_per_step": sum(e.count for e in events) / steps if cuda else None,
                "host_top": [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in top],
                "device_kinds": kinds if device_top else {},
                "device_top": [(e.key, e.self_device_time_total / 1e3 / steps, e.count / steps) for e in largest],
                "idle_top": idle_gaps(prof, steps, idle_top) if cuda and idle_top else []}


    def python_profile(self, steps: int, top: int) -> List:
        """The `top` Python functions by self time per step under cProfile over `steps` more
        steps: (function, ms per step, calls per step). Where a host-bound compiled step spends
        its host time by function (Inductor's launchers, the graphs' wrappers, AOTAutograd's
        runtime wrappers, the optimizer); C++ work shows under the Python function that called
        it (Dynamo's guards under the frame's caller). cProfile slows every Python call alike:
        compare variants, not these times with the wall times."""
        import cProfile
        import pstats
        if steps <= 0 or top <= 0:
            return []
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            self.step(self.model, self.recipe)
        self.sync()
        prof.disable()
        stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        return [(f"{name} {'/'.join(file.rsplit('/', 2)[-2:])}:{line}", tottime * 1e3 / steps, calls / steps)
                for (file, line, name), (_, calls, tottime, _, _) in rows]


def idle_gaps(prof, steps: int, top: int, floor_us: float = 5.0) -> List:
    """The device's idle time per step between consecutive device events (gaps over floor_us,
    the steps' ends excluded by the caller's one sync: the last gap runs to the next step),
    grouped by (the host op that launched the event after the gap, that op's outermost
    enclosing op on its thread: an autograd node's evaluate_function in the backward, the
    module's first op in the forward): the `top` largest groups as (launcher <- outer, ms per
    step, gaps per step), led by the total ("all", ms, gaps)."""
    events = prof.profiler.kineto_results.events()
    device = sorted((e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA
                     and not e.is_user_annotation()), key=lambda e: e.start_ns())
    ops = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU and e.duration_ns() > 0]
    by_id = {e.correlation_id(): e for e in ops}
    outer: Dict[int, str] = {}  # op correlation id -> outermost enclosing op's name, per thread by a stack sweep
    for thread in {e.start_thread_id() for e in ops}:
        stack: List = []
        for e in sorted((e for e in ops if e.start_thread_id() == thread), key=lambda e: (e.start_ns(), -e.end_ns())):
            while stack and stack[-1].end_ns() <= e.start_ns():
                stack.pop()
            outer[e.correlation_id()] = (stack[0] if stack else e).name()
            stack.append(e)
    groups: Dict[str, List[float]] = {}
    total = [0.0, 0]
    for prev, cur in zip(device, device[1:]):
        gap_us = (cur.start_ns() - max(prev.end_ns(), prev.start_ns())) / 1e3
        if gap_us <= floor_us:
            continue
        op = by_id.get(cur.linked_correlation_id())
        key = f"{op.name()} <- {outer.get(op.correlation_id(), '?')}" if op is not None else "(no host op)"
        entry = groups.setdefault(key, [0.0, 0])
        entry[0] += gap_us
        entry[1] += 1
        total[0] += gap_us
        total[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [("all", total[0] / 1e3 / steps, total[1] / steps)] + [(k, us / 1e3 / steps, n / steps) for k, (us, n) in rows]


# Kernel names by kind, first match wins: cuBLAS(Lt)'s GEMMs (nvjet / sm90 xmma / cutlass),
# SDPA's flash attention, the fused AdamW, Inductor's generated kernels (triton_{poi,red,per}_),
# fp8train's own Triton kernels (named _<what>_kernel), ATen's, copies.
KERNEL_KINDS = (("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")), ("attention", ("flash", "fmha", "attention")),
                ("optimizer", ("multi_tensor", "adam")), ("inductor", ("triton_",)), ("copy", ("memcpy", "memset")),
                ("aten", ("at::", "void ")))


def is_device_work(event) -> bool:
    """A profiler event that is device work (kernel, memcpy, memset): not a CPU op, and not a
    user annotation's GPU range (record_function's, e.g. "Optimizer.step#AdamW.step" or
    FSDP2's "FSDP::pre_forward"), which spans idle gaps and the kernels counted already."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def kernel_kind(name: str) -> str:
    low = name.lower()
    if name.startswith("_") and low.endswith("_kernel"):
        return "fp8train"
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def within_rounds(times: List[float], base: List[float]) -> Tuple[float, int]:
    """(median over rounds of times / base within a round, rounds in which times < base). On a
    host-bound step the rounds drift more than the effect: a median ratio of 0.99x in 12 of 21
    rounds is a tie (a sign test's p = 0.66), the count says so where the median cannot."""
    return statistics.median(a / b for a, b in zip(times, base)), sum(a < b for a, b in zip(times, base))


def measure(runners: Dict[str, Runner], rounds: int, steps: int, profile_steps: int, host_top: int = 0,
            device_top: int = 0, python_top: int = 0, idle_top: int = 0) -> List[Dict]:
    """Rounds of `steps` timed steps per variant, the order reversed every other round (the
    host's speed drifts between rounds: every variant sees the same drift). Per variant: the
    median round, and the median over rounds of its ratio to BF16 eager's and to torchao
    compile's time in the same round."""
    times: Dict[str, List[float]] = {v: [] for v in runners}
    for r in range(rounds):
        for v in (list(runners) if r % 2 == 0 else list(reversed(runners))):
            times[v].append(runners[v].timed(steps))
        # each round as it ends: a run stopped by a time limit keeps what it timed (in its log)
        print(f"  round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f}" for v in runners), flush=True)

    def paired(v: str, base: str) -> Tuple[Optional[float], Optional[int]]:
        return within_rounds(times[v], times[base]) if base in times else (None, None)

    rows = []
    for v, run in runners.items():
        wall = statistics.median(times[v])
        vs_bf16, wins = paired(v, "bf16 eager")
        try:  # the timings stand without the profile: a profiler failure must not lose them
            prof = run.profile(profile_steps, host_top, device_top, idle_top)
        except Exception as e:
            traceback.print_exc()
            print(f"  {v}: profile failed ({type(e).__name__}: {e}); wall times kept", flush=True)
            prof = {"device_ms": None, "kernels_per_step": None, "host_top": [], "device_kinds": {}, "device_top": [],
                    "idle_top": []}
        python = run.python_profile(profile_steps, python_top)
        device_ms = prof["device_ms"]
        rows.append({"variant": v, "wall_ms": wall, "rounds_ms": times[v], "device_ms": device_ms,
                     "wall_over_device": wall / device_ms if device_ms else None, "peak_gib": run.peak_gib,
                     "warmup_peak_gib": run.warmup_peak_gib,
                     "kernels_per_step": prof["kernels_per_step"], "host_top": prof["host_top"],
                     "device_kinds": prof["device_kinds"], "device_top": prof["device_top"], "idle_top": prof["idle_top"],
                     "python_top": python,
                     "vs_bf16_eager": vs_bf16, "rounds_faster_than_bf16_eager": wins,
                     "vs_torchao": paired(v, "torchao compile")[0],
                     "loss": statistics.fmean(run.losses), "loss_steps": run.loss_steps,
                     "fp8train_layers": run.fp8_layers,
                     "shared_input_groups": run.shared_groups, "linear_paths": run.paths,
                     "norm_paths": run.norm_paths, "mlp_paths": run.mlp_paths})
    return rows


def _faster(row: Dict) -> str:
    """The rounds in which row's variant beat BF16 eager's step, as "k/n" (blank for BF16 eager)."""
    wins = row.get("rounds_faster_than_bf16_eager")
    return "" if wins is None or row["variant"] == "bf16 eager" else f"{wins}/{len(row['rounds_ms'])}"


def print_table(name: str, rows: List[Dict]) -> None:
    print(f"\n{name}: {SHAPES[name]} (vs: the median over rounds of the ratio within a round; "
          "faster: the rounds in which the variant beat BF16 eager)")
    print(f"{'variant':<34}{'wall ms':>9}{'device ms':>10}{'wall/dev':>9}{'vs bf16 eager':>14}{'faster':>8}"
          f"{'vs torchao':>11}{'peak GiB':>9}{'kernels':>8}{'loss (after steps)':>19}")

    def cell(v: Optional[float], width: int, spec: str, unit: str = "") -> str:
        return " " * width if v is None else f"{format(v, spec) + unit:>{width}}"

    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<34}  failed: {r['error'][:150]}")
            continue
        print(f"{r['variant']:<34}{cell(r['wall_ms'], 9, '.2f')}{cell(r['device_ms'], 10, '.2f')}"
              f"{cell(r['wall_over_device'], 9, '.2f')}{cell(r['vs_bf16_eager'], 14, '.2f', 'x')}"
              f"{_faster(r):>8}"
              f"{cell(r['vs_torchao'], 11, '.2f', 'x')}{cell(r['peak_gib'], 9, '.1f')}"
              f"{cell(r['kernels_per_step'], 8, '.0f')}{r['loss']:>11.3f} ({r['loss_steps']:>4d})")
    for r in rows:
        for path, count in r.get("linear_paths", {}).items():
            print(f"  path {r['variant']:<34}{count:3d} Linears  {path[:100]}")
        for path, count in r.get("norm_paths", {}).items():
            print(f"  path {r['variant']:<34}{count:3d} norms    {path[:100]}")
        for path, count in r.get("mlp_paths", {}).items():
            print(f"  path {r['variant']:<34}{count:3d} MLPs     {path[:100]}")
    for r in rows:
        for key, ms, count in r.get("host_top", []):
            print(f"  host {r['variant']:<34}{ms:8.3f} ms{count:7.0f}x  {key[:90]}")
    for r in rows:
        for key, ms, count in r.get("idle_top", []):
            print(f"  idle {r['variant']:<34}{ms:8.3f} ms{count:7.0f}x  {key[:110]}")
    for r in rows:
        for key, ms, count in r.get("python_top", []):
            print(f"  py   {r['variant']:<34}{ms:8.3f} ms{count:7.0f}x  {key[:90]}")
    for r in rows:
        if r.get("device_kinds"):
            kinds = "  ".join(f"{k} {ms:.2f}" for k, ms in sorted(r["device_kinds"].items(), key=lambda kv: -kv[1]))
            print(f"  dev  {r['variant']:<34}{kinds}")
        for key, ms, count in r.get("device_top", []):
            print(f"  dev  {r['variant']:<34}{ms:8.3f} ms{count:7.0f}x  {key[:90]}")


def main(argv: Optional[List[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="h1024,h2048,h4096", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (variants alternate)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--profile-steps", type=int, default=5, help="profiled steps per variant (device time)")
    p.add_argument("--host-top", type=int, default=0, help="print each variant's N largest host self times per step")
    p.add_argument("--device-top", type=int, default=0,
                   help="print each variant's device time per step by kernel kind and its N largest kernels")
    p.add_argument("--idle-top", type=int, default=0,
                   help="print each variant's GPU idle time per step and its N largest shares by launching host op")
    p.add_argument("--python-top", type=int, default=0,
                   help="print each variant's N largest Python self times per step (cProfile, --profile-steps more steps)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = args.shapes.split(",")
    variants = args.variants.split(",")
    for name in shapes:
        if name not in SHAPES:
            p.error(f"unknown shape {name!r}; one of {sorted(SHAPES)}")
    variants = checked_variants(p, variants, VARIANTS)
    corpus = ByteCorpus.from_stdlib(max_bytes=4_000_000)
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shapes": {}}
    # every variant's compiled model stays alive: one cache entry each for Dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(variants))
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit,
                                                            64 * len(variants))
    for name in shapes:
        shape = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        batches = [tuple(t.to(device) for t in corpus.batch("train", shape.batch, shape.seq, g)) for _ in range(8)]
        runners, failed = {}, []
        for v in variants:
            t0 = time.perf_counter()
            try:
                runners[v] = Runner(v, shape, device, batches)
            except Exception as e:  # a benchmark reports what failed and goes on
                traceback.print_exc()
                failed.append({"variant": v, "error": f"{type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"})
            built = f"ready in {time.perf_counter() - t0:.0f} s" if v in runners else failed[-1]["error"]
            print(f"  {name} {v}: {built}", flush=True)
        rows = measure(runners, args.rounds, args.steps, args.profile_steps, args.host_top, args.device_top,
                       args.python_top, args.idle_top) + failed
        # the block GEMM problems the extension tuned (process-wide: this shape's and earlier ones')
        tunings = [t._asdict() for t in native.block_gemm_tunings()] if device.type == "cuda" else []
        results["shapes"][name] = {"shape": asdict(shape), "rounds": args.rounds, "steps_per_round": args.steps,
                                   "rows": rows, "block_gemm_tunings": tunings}
        print_table(name, rows)
        for t in tunings:
            print(f"  tune {t['m']:>6} x {t['n']:>6} x {t['k']:>6}: {t['answers']} answers, pick {t['pick']}, "
                  f"{t['first_us']:.1f} -> {t['pick_us']:.1f} us")
        if args.json:  # after each shape: a later shape that runs out of time leaves this one written
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        del runners
        torch._dynamo.reset()
        gc.collect()
    return results


if __name__ == "__main__":
    main()
