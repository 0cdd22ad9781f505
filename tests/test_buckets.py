import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.weights.buckets import ALIGN, iter_buckets, iter_unpacked, unpack

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64]


@st.composite
def named_tensors(draw):
    out = []
    for i in range(draw(st.integers(0, 12))):
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        tensor = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 251).to(dtype)
        out.append((f"layer{i}.weight", tensor.reshape(shape)))
    return out


@settings(max_examples=200)
@given(named_tensors(), st.integers(1, 2048))
def test_pack_then_unpack_gives_back_every_tensor_in_order(tensors, max_bytes):
    buckets = list(iter_buckets(iter(tensors), max_bytes))
    for bucket in buckets:
        sizes = [m.nbytes for m in bucket.tensors]
        assert bucket.nbytes <= max_bytes or len(sizes) == 1  # oversize tensors travel alone
        assert all(m.offset % ALIGN == 0 for m in bucket.tensors)
    back = list(iter_unpacked(buckets))
    assert [n for n, _ in back] == [n for n, _ in tensors]
    for (_, a), (_, b) in zip(back, tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_buckets_fill_up_to_the_bound():
    tensors = [(f"t{i}", torch.zeros(4)) for i in range(10)]  # 16 bytes each
    buckets = list(iter_buckets(tensors, 64))
    assert [len(b.tensors) for b in buckets] == [4, 4, 2]


def test_unpack_is_a_view_of_the_buffer():
    (bucket,) = iter_buckets([("w", torch.ones(3))], 1024)
    (_, view), = unpack(bucket)
    bucket.data.zero_()
    assert view.sum() == 0


def test_non_contiguous_tensors_are_packed_by_value():
    t = torch.arange(12.0).reshape(3, 4).t()
    (bucket,) = iter_buckets([("w", t)], 1024)
    assert torch.equal(unpack(bucket)[0][1], t)


def test_bound_must_be_positive():
    with pytest.raises(ValueError):
        list(iter_buckets([("w", torch.ones(1))], 0))
