"""vLLM and the HF backend agree on the tiny model, within the tolerance that
rollout.testing.agreement states and explains."""

import pytest

import rollout
from rollout.testing.agreement import check_first_token_logprobs, check_greedy_tokens, greedy_outputs


@pytest.fixture(scope="module")
def pairs(tiny_model, shared_vllm):
    with rollout.load_backend("hf", model=str(tiny_model)) as hf:
        expected = greedy_outputs(hf)
    return list(zip(expected, greedy_outputs(shared_vllm("engine"))))


def test_first_token_logprobs_agree(pairs):
    check_first_token_logprobs(pairs)


def test_greedy_tokens_agree_up_to_a_near_tie(pairs):
    check_greedy_tokens(pairs)
