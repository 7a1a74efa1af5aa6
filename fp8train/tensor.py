"""Float8Tensor: FP8 data with its own scale_inv, posing as a high-precision tensor.

A Float8Tensor owns
  fp8_data    torch.float8_e4m3fn / torch.float8_e5m2 payload, logical shape
  scale_inv   () float32, its own copy: x ~= fp8_data.float() * scale_inv
  the original dtype (what `.dtype` reports), an optional TensorRole, and a lazily built,
  cached transposed payload (see `transpose_data`).
It holds no scaling state (quantizers do). Only layout ops are supported through
__torch_dispatch__; anything that would need arithmetic raises instead of silently
dequantizing: call `.dequantize()` and compute in high precision explicitly.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_map

from .roles import TensorRole

aten = torch.ops.aten

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def version_of(t: torch.Tensor) -> Optional[int]:
    """t's version counter, or None for a tensor made under torch.inference_mode, which keeps
    none: its in-place writes cannot be seen (the caches keyed on versions trust it unchanged)."""
    return None if t.is_inference() else t._version


def padded_rows(m: int, multiple: int = 16) -> int:
    """Rows of a transposed copy's padded storage: FP8 GEMM reduction dims need multiples of 16."""
    return -(-m // multiple) * multiple


class Float8Tensor(torch.Tensor):
    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _role: Optional[TensorRole]
    # Transposed payload cache: (cols, padded_rows(rows)) fp8, zero beyond `rows`, valid while
    # _data's version counter equals _transpose_version (in-place writes bump it; None for an
    # inference-mode payload, which has none: fp8train's own rewrites drop the copy instead).
    _transpose: Optional[torch.Tensor]
    _transpose_version: Optional[int]

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, orig_dtype: torch.dtype,
                role: Optional[TensorRole] = None):
        if data.dtype not in FP8_DTYPES:
            raise TypeError(f"Float8Tensor data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
        if scale_inv.dtype != torch.float32 or scale_inv.numel() != 1:
            raise TypeError(f"Float8Tensor scale_inv must be one float32 element, got {scale_inv.dtype} "
                            f"of shape {tuple(scale_inv.shape)}")
        if not orig_dtype.is_floating_point or orig_dtype in FP8_DTYPES:
            raise TypeError(f"Float8Tensor orig_dtype must be a high-precision float dtype, got {orig_dtype}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=orig_dtype, device=data.device, requires_grad=False)
        self._data = data
        self._scale_inv = scale_inv if scale_inv.dim() == 0 else scale_inv.reshape(())
        self._role = role
        self._transpose = None
        self._transpose_version = -1
        return self

    # ---------------------------------------------------------------- accessors
    @property
    def fp8_data(self) -> torch.Tensor:
        return self._data

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._scale_inv

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def role(self) -> Optional[TensorRole]:
        return self._role

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """High-precision copy: fp8_data * scale_inv, in `dtype` (default: the original dtype)."""
        return (self._data.float() * self._scale_inv).to(dtype or self.dtype)

    # ---------------------------------------------------------------- transposed copy
    def transpose_data(self, padded: bool = False) -> torch.Tensor:
        """Transposed payload of the 2-D view (rows = prod(leading dims), cols = last dim).

        Returns (cols, rows) fp8, row-major, a view of a (cols, padded_rows(rows)) buffer whose
        extra columns are zero; `padded=True` returns that whole buffer (the wgrad GEMM uses it
        so its reduction dim is a multiple of 16). Built once and cached until the payload is
        rewritten in place.
        """
        rows = self._data.numel() // max(self._data.shape[-1], 1) if self._data.dim() else 1
        if not self.transpose_is_cached():
            cols = self._data.shape[-1] if self._data.dim() else 1
            buf = torch.zeros((cols, padded_rows(rows)), dtype=self._data.dtype, device=self._data.device)
            buf[:, :rows].copy_(self._data.reshape(rows, cols).t())
            self._set_transpose(buf)
        buf = self._transpose
        return buf if padded or buf.shape[1] == rows else buf[:, :rows]

    def transpose_is_cached(self) -> bool:
        return self._transpose is not None and self._transpose_version == version_of(self._data)

    def _set_transpose(self, buf: torch.Tensor) -> None:
        """Adopt `buf` (written together with the payload) as the valid transposed copy."""
        self._transpose = buf
        self._transpose_version = version_of(self._data)

    def _share_transpose(self, src: "Float8Tensor") -> None:
        # Views made below autograd get their own version counter, so the shared copy is
        # valid for this view from now until its payload is rewritten through it.
        self._set_transpose(src._transpose)

    def _mark_rewritten(self) -> None:
        """Kernels write the payload through raw pointers: bump its version so caches notice
        (an inference-mode payload has none: its transposed copy is dropped instead)."""
        if self._data.is_inference():
            self._transpose = None
        else:
            torch.autograd.graph.increment_version(self._data)

    # ---------------------------------------------------------------- python protocol
    def __repr__(self):
        return (f"Float8Tensor(shape={tuple(self.shape)}, fp8_dtype={self._data.dtype}, "
                f"orig_dtype={self.dtype}, role={self._role.name if self._role else None}, "
                f"scale_inv={_scalar_repr(self._scale_inv)}, "
                f"device={self.device})")

    def __reduce_ex__(self, protocol):
        # Plain tensors, a dtype and a string: loadable with torch.load(weights_only=True).
        role = self._role.value if self._role is not None else None
        return (_rebuild_float8_tensor, (self._data, self._scale_inv, self.dtype, role))

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], (self.dtype, self._role)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta[0], meta[1])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func.overloadpacket)
        if handler is None:
            raise NotImplementedError(
                f"Float8Tensor does not support {func.overloadpacket.__name__}: FP8 data is never "
                f"dequantized implicitly. Call .dequantize() and compute in high precision.")
        return handler(func, args, kwargs)


def _scalar_repr(t: torch.Tensor) -> str:
    """A () tensor's value for a repr, read only where that is free: not on a device (a sync),
    and not under a trace, whose fake tensors hold no value (AOTAutograd's debug log reprs
    its inputs' metadata, Float8Tensors included)."""
    if t.device.type != "cpu":
        return f"<{t.device.type}>"
    if torch._subclasses.fake_tensor.is_fake(t):
        return "<traced>"
    return repr(t.item())


def _rebuild_float8_tensor(data, scale_inv, orig_dtype, role):
    return Float8Tensor(data, scale_inv, orig_dtype, TensorRole(role) if role is not None else None)


torch.serialization.add_safe_globals([_rebuild_float8_tensor])


# -------------------------------------------------------------------- op handlers
_HANDLERS = {}


def _handles(*ops):
    def register(fn):
        for op in ops:
            _HANDLERS[op] = fn
        return fn
    return register


def _like(src: Float8Tensor, data: torch.Tensor, scale_inv: Optional[torch.Tensor] = None) -> Float8Tensor:
    return Float8Tensor(data, src._scale_inv if scale_inv is None else scale_inv, src.dtype, src._role)


@_handles(aten.detach, aten.alias)
def _detach(func, args, kwargs):
    src = args[0]
    out = _like(src, func(src._data))
    if src.transpose_is_cached():
        out._share_transpose(src)
    return out


@_handles(aten.view, aten._unsafe_view, aten.reshape)
def _view(func, args, kwargs):
    src, shape = args[0], args[1]
    data = func(src._data, shape, **kwargs)
    out = _like(src, data)
    if src.transpose_is_cached() and data.dim() and src._data.dim() and data.shape[-1] == src._data.shape[-1] \
            and data.is_contiguous() and src._data.is_contiguous():
        # The 2-D view (rows, last dim) is unchanged, and so is its transposed copy.
        out._share_transpose(src)
    return out


@_handles(aten.as_strided)
def _as_strided(func, args, kwargs):
    # FSDP2 views each gathered weight with its own size and contiguous strides (a no-op view
    # of a contiguous payload); any as_strided is a layout op on the bytes.
    src = args[0]
    return _like(src, func(src._data, *args[1:], **kwargs))


@_handles(aten.t, aten.transpose)
def _t(func, args, kwargs):
    src = args[0]
    if func.overloadpacket is aten.transpose and src.dim() != 2:
        raise NotImplementedError("Float8Tensor.transpose supports 2-D tensors only")
    return _like(src, func(src._data, *args[1:], **kwargs))


@_handles(aten.clone)
def _clone(func, args, kwargs):
    src = args[0]
    return _like(src, func(src._data, **kwargs), src._scale_inv.clone())


@_handles(aten._to_copy)
def _to_copy(func, args, kwargs):
    src = args[0]
    dtype = kwargs.pop("dtype", None)
    device = kwargs.get("device", None)
    if dtype is not None and dtype != src.dtype:
        # An explicit dtype conversion (`.float()`, `.to(torch.bfloat16)`) asks for high precision.
        if dtype in FP8_DTYPES or not dtype.is_floating_point:
            raise NotImplementedError(f"Float8Tensor cannot be converted to {dtype}; use .fp8_data or .dequantize()")
        return src.dequantize(dtype).to(device=device) if device is not None else src.dequantize(dtype)
    data = func(src._data, **kwargs)
    scale_inv = src._scale_inv.to(device=data.device, copy=True)
    return Float8Tensor(data, scale_inv, src.dtype, src._role)


@_handles(aten.copy_)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, Float8Tensor):
        if isinstance(src, Float8Tensor):
            if src._data.dtype != dst._data.dtype:
                raise NotImplementedError(
                    f"copy_ between Float8Tensors of different FP8 dtypes ({src._data.dtype} -> {dst._data.dtype}); "
                    "dequantize and re-quantize explicitly")
            dst._data.copy_(src._data)
            dst._scale_inv.copy_(src._scale_inv)
            return dst
        # Re-quantize in place (same storage) with current scaling: a fresh scale from src's amax.
        from .quantize import quantize_into

        quantize_into(src, dst)
        return dst
    # Writing into a high-precision tensor is an explicit request for the dequantized values.
    return func(dst, src.dequantize(dst.dtype), *args[2:], **kwargs)


@_handles(aten.is_same_size)
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@_handles(aten.split, aten.unbind, aten.select, aten.slice, aten.chunk)
def _layout_only(func, args, kwargs):
    src = args[0]
    out = func(src._data, *args[1:], **kwargs)
    return tree_map(lambda d: _like(src, d) if isinstance(d, torch.Tensor) else d, out)
