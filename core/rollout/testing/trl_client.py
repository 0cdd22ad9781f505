"""TRL's own client for a vLLM server (`trl.generation.vllm_client.VLLMClient`) against
`rollout serve`, from another environment's Python (the client needs vLLM and TRL, which
an engine's environment may lack).

`python -m rollout.testing.trl_client URL` runs the client's generate (token ids, greedy,
with logprobs; sampled under a regex) and chat, and prints one JSON line;
`check_trl_client` starts `rollout serve` on a backend, runs that, and compares the
client's answers with the server's own on the OpenAI route.
"""

from __future__ import annotations

import re
import sys

import pytest

from rollout.testing.serve_child import MODEL_NAME, print_result, rollout_serve, run_client
from rollout.testing.server_contract import http

PROMPTS = [[5, 17, 42], [7, 8, 9, 10]]
CHAT = [{"role": "user", "content": "def add(a, b):"}]
REGEX = r"[0-9]{3}"
SEQUENCES = [[5, 17, 42, 9, 3], [7, 8, 9, 10]]  # scored from position 2 on


def run(url: str) -> dict:
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=url, connection_timeout=60)
    return {"greedy": client.generate(PROMPTS, n=1, temperature=0.0, max_tokens=5),
            "sampled": client.generate(PROMPTS, n=3, temperature=1.0, max_tokens=6,
                                       structured_outputs_regex=REGEX),
            "chat": client.chat([CHAT], n=1, temperature=0.0, max_tokens=5, logprobs=0),
            "scored": client.get_sequence_logprobs(SEQUENCES, [2] * len(SEQUENCES),
                                                   top_logprobs=3)}


def check_trl_client(python: str, backend: str, model_dir: str,
                     options: dict | None = None) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with rollout_serve(backend, model_dir, options) as url:
        out = run_client([python, "-m", "rollout.testing.trl_client", url])
        direct = [_ok(http(url + "/v1/completions", {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True}, key=None))["choices"][0]
            for prompt in PROMPTS]
        scores = [_ok(http(url + "/v1/completions", {
            "model": MODEL_NAME, "prompt": sequence, "max_tokens": 1, "prompt_logprobs": 3},
            key=None))["choices"][0]["prompt_logprobs"] for sequence in SEQUENCES]
        chat = _ok(http(url + "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": CHAT, "max_tokens": 5, "temperature": 0.0,
            "return_token_ids": True}, key=None))
    greedy = out["greedy"]
    assert greedy["prompt_ids"] == PROMPTS
    assert greedy["completion_ids"] == [c["token_ids"] for c in direct]
    for logprobs, choice in zip(greedy["logprobs"], direct):  # the chosen token's alone
        assert [p[0] for p in logprobs] == pytest.approx(
            choice["logprobs"]["token_logprobs"], abs=1e-5)
    sampled = out["sampled"]["completion_ids"]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in sampled]
    assert len(sampled) == 6 and all(re.fullmatch(REGEX, t) for t in texts), texts
    assert out["chat"]["completion_ids"] == [chat["choices"][0]["token_ids"]]
    assert out["chat"]["prompt_ids"] == [chat["prompt_token_ids"]]
    scored = out["scored"]
    for i, (sequence, positions) in enumerate(zip(SEQUENCES, scores)):
        assert scored["actual_token_ids"][i] == [[t] for t in sequence[2:]]
        assert [a for (a,) in scored["actual_logprobs"][i]] == pytest.approx(
            [positions[p][str(sequence[p])]["logprob"] for p in range(2, len(sequence))],
            abs=1e-5)
        for p, ids in zip(range(2, len(sequence)), scored["logprob_token_ids"][i]):
            ranked = sorted(positions[p].items(), key=lambda item: item[1]["rank"])
            assert ids == [int(t) for t, _ in ranked[:3]]
    return out


def _ok(answer: tuple[int, dict]) -> dict:
    status, body = answer
    assert status == 200, body
    return body


if __name__ == "__main__":
    print_result(run(sys.argv[1]))
