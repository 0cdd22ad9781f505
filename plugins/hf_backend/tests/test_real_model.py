"""The HF backend on the real SmolLM2-135M-Instruct: right sums under greedy decoding, the
same tokens as transformers' own `generate`, the model's chat template, bfloat16, pushes
that take effect, the batch job's count of right answers, and a few GRPO steps."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

import rollout
from rollout.apps.datasets import sums
from rollout.testing import real_model as checks
from rollout.testing.grpo import run_grpo


@pytest.fixture(scope="module")
def backend(real_model):
    with rollout.load_backend("hf", "smollm2", dtype="float32") as ro:
        yield ro


def test_greedy_sums_are_right_and_equal_transformers_generate(backend, real_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = checks.greedy_sums(backend)
    checks.check_sums_right(results)
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    for result in results:
        checks.check_chat_template(result, tokenizer)
        ids = torch.tensor([result.prompt_token_ids])
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == list(result.token_ids)


def test_bfloat16_answers_the_same_sums(real_model):
    with rollout.load_backend("hf", "smollm2", dtype="bfloat16") as ro:
        checks.check_sums_right(checks.greedy_sums(ro, logprobs=0))


def test_a_weight_push_takes_effect(real_model):
    with rollout.load_backend("hf", "smollm2", dtype="float32") as ro:
        checks.check_update_takes_effect(ro, real_model)


def test_the_batch_job_counts_right_answers(real_model, tmp_path):
    prompts, out = tmp_path / "sums.parquet", tmp_path / "out.parquet"
    sums.write(str(prompts), 16, seed=0, high=10)
    done = subprocess.run([sys.executable, "-m", "rollout", "generate", "--backend", "hf",
                           "--model", "smollm2", "--input", str(prompts), "--output", str(out),
                           "--n", "1", "--temperature", "0", "--max-tokens", "16", "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    rows = pq.read_table(out).to_pylist()
    right = sum(sums.is_right(r["responses"][0], r["answer"]) for r in rows)
    assert summary["answers"] == {"checked": 16, "right": right, "accuracy": right / 16}
    assert right > 8  # most of these small sums (about 70% of 1..10 under greedy decoding)
    assert f"right answers {right} of 16" in done.stderr


def test_a_few_grpo_steps_on_the_sums(real_model):
    """The example's sums task: logprobs equal the trainer's after every push, held-out
    accuracy measured through the pushed weights before and after."""
    run = run_grpo("hf", {"dtype": "float32"}, "smollm2", "--task", "sums", "--steps", 2,
                   "--prompts", 2, "--group-size", 4, "--max-tokens", 12, "--held-out", 12,
                   "--lr", 2e-5, timeout=600)
    assert len(run.steps) == 2 and run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["accuracy_before"] is not None and run.summary["accuracy_after"] is not None
    assert set(run.summary["mean_seconds"]) == {"sample_s", "train_s", "push_s", "step_s"}
