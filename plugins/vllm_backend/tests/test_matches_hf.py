"""vLLM and the HF backend agree on the tiny model, within the tolerance that
rollout.testing.agreement states and explains."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.agreement import check_first_token_logprobs, check_greedy_tokens, greedy_outputs


@pytest.fixture(scope="module")
def pairs(tiny_model):
    with rollout.load_backend("hf", model=str(tiny_model)) as hf:
        expected = greedy_outputs(hf)
    with rollout.load_backend("vllm", model=str(tiny_model), mode="engine", **ENGINE) as other:
        got = greedy_outputs(other)
    return list(zip(expected, got))


def test_first_token_logprobs_agree(pairs):
    check_first_token_logprobs(pairs)


def test_greedy_tokens_agree_up_to_a_near_tie(pairs):
    check_greedy_tokens(pairs)
