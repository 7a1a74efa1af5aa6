"""Float8Tensor: payload, own scale_inv, layout ops, cached transpose, round trips, refusals."""
import io

import pytest
import torch

import fp8train
from fp8train import Float8Tensor, TensorRole
from helpers import fp8_bytes


@pytest.fixture(params=[torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def q(request):
    x = torch.randn(6, 48, dtype=torch.bfloat16)
    return fp8train.quantize(x, request.param, role=TensorRole.INPUT)


def test_fields(q):
    assert q.fp8_data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert q.scale_inv.dtype == torch.float32 and q.scale_inv.shape == ()
    assert q.dtype == torch.bfloat16 and q.shape == (6, 48) and q.role is TensorRole.INPUT
    assert isinstance(q, torch.Tensor) and not q.requires_grad


def test_dequantize(q):
    ref = q.fp8_data.float() * q.scale_inv
    assert torch.equal(q.dequantize(torch.float32), ref)
    assert q.dequantize().dtype == torch.bfloat16 and torch.equal(q.dequantize(), ref.bfloat16())
    assert torch.equal(q.float(), ref)  # an explicit dtype conversion is an explicit dequantize


def test_scale_inv_is_its_own_copy():
    x = torch.randn(16, 16)
    s = torch.tensor(4.0)
    q = fp8train.quantize(x, scale=s)
    s.fill_(8.0)
    assert q.scale_inv.item() == 0.25
    assert q.clone().scale_inv.data_ptr() != q.scale_inv.data_ptr()


def test_detach_view_reshape_share_payload(q):
    for v in (q.detach(), q.view(2, 3, 48), q.reshape(288), q.view(-1, 16)):
        assert isinstance(v, Float8Tensor) and v.fp8_data.data_ptr() == q.fp8_data.data_ptr()
        assert torch.equal(v.dequantize().reshape(q.shape), q.dequantize())
        assert v.role is q.role and v.dtype == q.dtype


def test_view_that_breaks_layout_raises(q):
    with pytest.raises(RuntimeError):
        q.t().view(288)


def test_t(q):
    t = q.t()
    assert t.shape == (48, 6) and torch.equal(t.dequantize(), q.dequantize().t())


def test_clone_copies_payload(q):
    c = q.clone()
    assert c.fp8_data.data_ptr() != q.fp8_data.data_ptr()
    assert torch.equal(fp8_bytes(c.fp8_data), fp8_bytes(q.fp8_data))


def test_to_device(q):
    m = q.to("meta")
    assert isinstance(m, Float8Tensor) and m.device.type == "meta" and m.fp8_data.device.type == "meta"
    back = q.to("cpu")
    assert isinstance(back, Float8Tensor) and torch.equal(back.dequantize(), q.dequantize())


def test_copy_requantizes_in_place(q):
    data_ptr, si_ptr = q.fp8_data.data_ptr(), q.scale_inv.data_ptr()
    x = torch.randn(6, 48, dtype=torch.bfloat16) * 100
    q.copy_(x)
    assert q.fp8_data.data_ptr() == data_ptr and q.scale_inv.data_ptr() == si_ptr
    expected = fp8train.quantize(x, q.fp8_dtype)
    assert torch.equal(fp8_bytes(q.fp8_data), fp8_bytes(expected.fp8_data))
    assert torch.equal(q.scale_inv, expected.scale_inv)


def test_copy_between_float8_tensors(q):
    other = fp8train.quantize(torch.randn(6, 48), q.fp8_dtype)
    q.copy_(other)
    assert torch.equal(fp8_bytes(q.fp8_data), fp8_bytes(other.fp8_data)) and torch.equal(q.scale_inv, other.scale_inv)
    wrong = fp8train.quantize(torch.randn(6, 48), torch.float8_e5m2 if q.fp8_dtype == torch.float8_e4m3fn
                              else torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="different FP8 dtypes"):
        q.copy_(wrong)


def test_copy_into_high_precision_dequantizes(q):
    dst = torch.empty(6, 48)
    dst.copy_(q)
    assert torch.equal(dst, q.dequantize(torch.float32))


def test_transpose_cache_built_once_and_invalidated_by_inplace_writes(q):
    t1 = q.transpose_data()
    assert t1.shape == (48, 6) and torch.equal(fp8_bytes(t1), fp8_bytes(q.fp8_data).t())
    assert q.transpose_data().data_ptr() == t1.data_ptr()  # cached
    padded = q.transpose_data(padded=True)
    assert padded.shape == (48, 16) and (fp8_bytes(padded[:, 6:]) == 0).all()
    q.copy_(torch.randn(6, 48))  # rewrite the payload in place
    assert not q.transpose_is_cached()
    assert torch.equal(fp8_bytes(q.transpose_data()), fp8_bytes(q.fp8_data).t())
    q.fp8_data.view(torch.uint8).fill_(0x11)  # a foreign in-place write bumps the version too
    assert not q.transpose_is_cached()


def test_inference_mode_tensors_cache_their_transpose_until_rewritten_through_fp8train():
    """Made under torch.inference_mode the payload keeps no version counter: the transposed
    copy is kept until fp8train rewrites the payload (copy_ requantizes, which drops it);
    a foreign in-place write there goes unseen."""
    with torch.inference_mode():
        q = fp8train.quantize(torch.randn(6, 48, dtype=torch.bfloat16), role=TensorRole.INPUT)
        assert q.fp8_data.is_inference()
        t1 = q.transpose_data()
        assert q.transpose_is_cached() and q.transpose_data().data_ptr() == t1.data_ptr()
        assert torch.equal(fp8_bytes(t1), fp8_bytes(q.fp8_data).t())
        q.copy_(torch.randn(6, 48))
        assert not q.transpose_is_cached()
        assert torch.equal(fp8_bytes(q.transpose_data()), fp8_bytes(q.fp8_data).t())


def test_reshape_keeps_the_transposed_copy_when_rows_are_unchanged():
    q = fp8train.quantize(torch.randn(2, 3, 32))
    t = q.transpose_data()
    assert t.shape == (32, 6)
    assert q.reshape(6, 32).transpose_data().data_ptr() == t.data_ptr()


@pytest.mark.parametrize("weights_only", [True, False])
def test_save_load_round_trip(q, weights_only):
    buf = io.BytesIO()
    torch.save({"q": q, "v": q.view(2, 3, 48)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=weights_only)
    for key in ("q", "v"):
        out, src = loaded[key], {"q": q, "v": q.view(2, 3, 48)}[key]
        assert isinstance(out, Float8Tensor) and out.shape == src.shape and out.dtype == src.dtype
        assert out.role is src.role and torch.equal(fp8_bytes(out.fp8_data), fp8_bytes(src.fp8_data))
        assert torch.equal(out.scale_inv, src.scale_inv)


@pytest.mark.parametrize("op", [
    lambda q: q + 1, lambda q: q * q, lambda q: torch.matmul(q, q.t()), lambda q: q.sum(),
    lambda q: torch.nn.functional.gelu(q), lambda q: q.abs(), lambda q: torch.cat([q, q]),
], ids=["add", "mul", "matmul", "sum", "gelu", "abs", "cat"])
def test_unsupported_ops_raise_instead_of_dequantizing(q, op):
    with pytest.raises(NotImplementedError, match="dequantize"):
        op(q)


def test_constructor_validation():
    data = torch.zeros(4, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="data"):
        Float8Tensor(torch.zeros(4), torch.ones(()), torch.float32)
    with pytest.raises(TypeError, match="scale_inv"):
        Float8Tensor(data, torch.ones(2), torch.float32)
    with pytest.raises(TypeError, match="orig_dtype"):
        Float8Tensor(data, torch.ones(()), torch.int32)


def test_repr(q):
    assert "Float8Tensor(shape=(6, 48)" in repr(q) and "role=INPUT" in repr(q)


def test_as_strided_is_a_layout_op_on_the_payload():
    # FSDP2 views each gathered weight with torch.as_strided (its size, contiguous strides)
    q = fp8train.quantize(torch.randn(8, 32), torch.float8_e4m3fn)
    v = torch.as_strided(q, (8, 32), (32, 1), storage_offset=0)
    assert isinstance(v, Float8Tensor) and torch.equal(v.scale_inv, q.scale_inv)
    assert torch.equal(v.fp8_data.view(torch.uint8), q.fp8_data.view(torch.uint8))
    w = torch.as_strided(q, (4, 32), (32, 1), storage_offset=32)  # rows 1..4 of the bytes
    assert torch.equal(w.fp8_data.view(torch.uint8), q.fp8_data[1:5].view(torch.uint8))


def test_repr_reads_no_value_under_a_trace():
    # AOTAutograd's debug log reprs its inputs' metadata: a CPU Float8Tensor's repr called
    # scale_inv.item(), which a fake tensor cannot answer (aot_eager failed and Dynamo fell
    # back to eager silently, in torch 2.11)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fp8train.tensor import Float8Tensor
    t = Float8Tensor(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.tensor(0.5), torch.float32)
    assert "scale_inv=0.5" in repr(t)
    with FakeTensorMode() as mode:
        fake = Float8Tensor(mode.from_tensor(t._data), mode.from_tensor(t._scale_inv), torch.float32)
        assert "scale_inv=<traced>" in repr(fake)
