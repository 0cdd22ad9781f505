"""Routed experts (R3) on the SGLang backend, with a tiny random Qwen3-MoE: SGLang records
each token's experts (started with enable_return_routed_experts, which the backend sets
for a mixture-of-experts model), and they are those a reference forward pass of
transformers routes it to. (A dense model refuses them by name: the contract suite's
on-policy tests.)"""

from __future__ import annotations

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.routing import (PROMPTS, assert_routed_as_the_reference,
                                     float32_model, streamed_with_routing_last)

@pytest.fixture(scope="module")
def ro(tiny_moe):
    # In process; the server mode sends the same body as JSON (test_request_bodies).
    ro = rollout.load_backend("sglang", model=str(tiny_moe), mode="engine", **ENGINE)
    yield ro
    ro.close()


@pytest.fixture(scope="module")
def reference(tiny_moe):
    return float32_model(tiny_moe)


def test_each_tokens_experts_are_those_of_a_reference_forward(ro, reference):
    assert ro.capabilities.supports("routed_experts")
    requests = [{"prompt": p, "sampling": {"max_tokens": 6 + i, "ignore_eos": True,
                                           "temperature": 1.0 if i % 2 else 0.0,
                                           "n": 2 if i % 2 else 1,
                                           "return_routed_experts": True}}
                for i, p in enumerate(PROMPTS)]
    results = [r for c in ro.generate(requests) for r in c.unwrap()]
    assert len(results) == 4
    for result in results:
        assert assert_routed_as_the_reference(result, reference)[1:] == (2, 2)


def test_a_streamed_sample_gets_them_on_its_last_chunk(ro):
    request = {"prompt": PROMPTS[0], "sampling": {"max_tokens": 6, "ignore_eos": True,
                                                  "temperature": 0.0,
                                                  "return_routed_experts": True}}
    result = streamed_with_routing_last(ro, request)
    (whole,) = ro.generate([request])[0].unwrap()
    assert result.token_ids == whole.token_ids
    assert result.routed_experts == whole.routed_experts


def test_a_sample_the_backend_ends_itself_is_refused_by_name(ro):
    refused, answered = ro.generate([
        {"prompt": PROMPTS[0], "sampling": {"max_tokens": 4, "ignore_eos": True,
                                            "stop_token_ids": [3],
                                            "return_routed_experts": True}},
        {"prompt": PROMPTS[0], "sampling": {"max_tokens": 4, "return_routed_experts": True}}])
    assert refused.error.field == "sampling.return_routed_experts"
    assert answered.unwrap()[0].routed_experts
