"""TRL's own client for a vLLM server (`trl.generation.vllm_client.VLLMClient`, the real,
pinned package) against `rollout serve`, in front of the HF and vLLM backends: what TRL's
GRPOTrainer gets back equals what the engine answers directly. The client needs vLLM
installed, so this runs in the vLLM environment (requirements/trl.txt)."""

import re

import pytest

import rollout
from rollout.apps.serving.app import ServerThread
from rollout.service.service import LocalService

vllm_client = pytest.importorskip("trl.generation.vllm_client",
                                  reason="TRL is not installed in this environment")

PROMPTS = [[5, 17, 42], [7, 8, 9, 10]]


@pytest.fixture(scope="module", params=["hf", "vllm"])
def served(request, tiny_model, shared_vllm):
    with (shared_vllm("async") if request.param == "vllm" else
          rollout.load_backend("hf", model=str(tiny_model), dtype="float32")) as ro:
        with ServerThread(LocalService(ro, "tiny")) as server:
            yield ro, vllm_client.VLLMClient(base_url=server.url, connection_timeout=60)


def direct(ro, **request):
    return ro.generate([request])[0].unwrap()


def test_generate_from_token_ids_equals_the_engine(served):
    ro, client = served
    out = client.generate(PROMPTS, n=1, temperature=0.0, max_tokens=5)  # logprobs=0 by default
    assert out["prompt_ids"] == PROMPTS
    for prompt, ids, lp_ids, lps in zip(PROMPTS, out["completion_ids"],
                                        out["logprob_token_ids"], out["logprobs"]):
        (expected,) = direct(ro, prompt_token_ids=prompt,
                             sampling={"temperature": 0.0, "max_tokens": 5, "logprobs": 0})
        assert ids == list(expected.token_ids)
        # logprobs=0: the chosen token's alone, [[logprob]] per position
        assert lp_ids == [[t] for t in expected.token_ids]
        assert [len(p) for p in lps] == [1] * len(ids)
        assert [p[0] for p in lps] == pytest.approx(list(expected.logprobs), abs=1e-5)


def test_generate_from_text_with_top_logprobs_and_trl_defaults(served):
    ro, client = served
    # TRL's defaults: top_k=0 and min_p=0 (vLLM's "no limit"), repetition_penalty=1.
    out = client.generate(["def add(a, b):"], n=1, temperature=0.0, max_tokens=4, logprobs=2)
    (expected,) = direct(ro, prompt="def add(a, b):",
                         sampling={"temperature": 0.0, "max_tokens": 4, "logprobs": 2})
    assert out["prompt_ids"] == [list(expected.prompt_token_ids)]
    assert out["completion_ids"] == [list(expected.token_ids)]
    for ids, chosen in zip(out["logprob_token_ids"][0], expected.token_ids):
        assert ids[0] == chosen and 2 <= len(ids) <= 3  # sorted; the chosen one is the best


def test_generate_sampling_keeps_its_shape_and_the_regex(served, tiny_model):
    from transformers import AutoTokenizer

    _, client = served
    out = client.generate(PROMPTS, n=3, temperature=1.0, max_tokens=6,
                          structured_outputs_regex=r"[0-9]{3}",
                          generation_kwargs={"seed": 1})
    assert len(out["completion_ids"]) == 6
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out["completion_ids"]]
    assert all(re.fullmatch(r"[0-9]{3}", t) for t in texts), texts


def test_chat_equals_the_engine(served):
    ro, client = served
    messages = [{"role": "user", "content": "def add(a, b):"}]
    out = client.chat([messages], n=1, temperature=0.0, max_tokens=5, logprobs=0)
    (expected,) = direct(ro, messages=messages, sampling={"temperature": 0.0, "max_tokens": 5,
                                                          "logprobs": 0})
    assert out["prompt_ids"] == [list(expected.prompt_token_ids)]
    assert out["completion_ids"] == [list(expected.token_ids)]
    assert [p[0] for p in out["logprobs"][0]] == pytest.approx(list(expected.logprobs),
                                                               abs=1e-5)


def test_a_field_it_cannot_honour_is_refused_with_the_reason(served):
    _, client = served
    with pytest.raises(Exception, match="return_tokens_as_token_ids"):
        client.generate(PROMPTS, max_tokens=2,
                        generation_kwargs={"return_tokens_as_token_ids": False})


def test_nccl_weight_sync_is_refused_with_the_way_that_works(served):
    _, client = served
    # TRL asks for the server's config first; the answer names the CPU-and-GPU way.
    with pytest.raises(Exception, match="501.*rollout.integrations.trl"):
        client.init_communicator(device="cpu")
    with pytest.raises(Exception, match="501.*rollout.integrations.trl"):
        client.get_world_size()


def test_get_sequence_logprobs_scores_given_sequences_as_the_engine(served):
    """TRL's teacher scoring (`prompt_logprobs` on /v1/completions), unchanged, with its
    defaults (the top 100 per position), against the engine's own scores."""
    import math

    ro, client = served
    sequences = [[5, 17, 42, 9, 3, 11], [7, 8, 9, 10, 12]]
    prompt_lengths = [3, 2]
    out = client.get_sequence_logprobs(sequences, prompt_lengths, chunk_size=1)
    for i, (sequence, start) in enumerate(zip(sequences, prompt_lengths)):
        (expected,) = direct(ro, prompt_token_ids=sequence,
                             sampling={"max_tokens": 1, "prompt_logprobs": 100})
        positions = range(start, len(sequence))
        assert out["actual_token_ids"][i] == [[sequence[p]] for p in positions]
        assert [a for (a,) in out["actual_logprobs"][i]] == pytest.approx(
            [expected.prompt_logprobs[p] for p in positions], abs=1e-5)
        for p, ids, values in zip(positions, out["logprob_token_ids"][i], out["logprobs"][i]):
            top = expected.prompt_top_logprobs[p]
            assert len(ids) == len(values) == 100
            assert ids[:len(top)] == [t.token_id for t in top]
            assert values[:len(top)] == pytest.approx([t.logprob for t in top], abs=1e-5)
            assert all(v == -math.inf for v in values[len(top):])  # TRL's padding
            assert values[:len(top)] == sorted(values[:len(top)], reverse=True)
