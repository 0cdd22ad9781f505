"""An adapter's tensors in one block of memory: `pack_tensors` moves a trainer's tensors
(parameters or not) into one, keeping their objects and values, and `one_block` finds such
a block again, so that a backend copies it at once."""

import pytest

torch = pytest.importorskip("torch")

from rollout.weights.lora import one_block, pack_tensors  # noqa: E402


def tensors():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in ((4, 6), (6, 4), (3, 5))]


def test_packed_tensors_keep_their_objects_and_values_and_form_one_block():
    given = tensors()
    params = [torch.nn.Parameter(t.clone()) for t in given]
    objects = [id(p) for p in params]
    pack_tensors(params)
    assert [id(p) for p in params] == objects
    assert all(torch.equal(p.data, t) for p, t in zip(params, given))
    block = one_block([p.detach() for p in params])
    assert block is not None
    assert torch.equal(block, torch.cat([t.reshape(-1) for t in given]))
    with torch.no_grad():  # a step in place moves what the block holds
        params[1].add_(1.0)
    assert torch.equal(block[24:48], (given[1] + 1.0).reshape(-1))


def test_tensors_not_back_to_back_in_this_order_are_no_block():
    separate = tensors()
    assert one_block(separate) is None
    packed = tensors()
    pack_tensors(packed)
    assert one_block(packed) is not None
    assert one_block([packed[1], packed[0], packed[2]]) is None  # another order
    assert one_block([packed[0], packed[2]]) is None  # a gap
    assert one_block([packed[0], packed[1].t(), packed[2]]) is None  # not contiguous
    assert one_block(packed[1:]) is not None  # a run of them is one


def test_only_tensors_of_one_kind_are_packed():
    mixed = [torch.zeros(3), torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(ValueError, match="one dtype"):
        pack_tensors(mixed)
    assert mixed[0].dtype == torch.float32 and mixed[1].dtype == torch.float64
