"""vLLM on the real SmolLM2-135M-Instruct: in float32 the same greedy answers as the HF
backend (first-token logprobs within the agreement tolerance, tokens up to a near-tie), the
right sums and the model's chat template; in bfloat16, vLLM's default dtype on a CPU, the
same right sums; a push of the whole model that takes effect; and a few GRPO steps on the
sums task through two replica processes (the loop in process runs on the tiny model, in
test_grpo_example.py).

One float32 engine serves the first two tests: the agreement test only reads it, and the
push test, which runs after it (pytest keeps the file's order), changes its weights and then
stops it, so that no idle engine stays in memory beside the later ones."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import real_model as checks
from rollout.testing.grpo import run_grpo

# A trainer's step (forward, backward and Adam on 135M parameters) takes most of a run's
# time on a CPU: 10-30 s here.
GRPO_ARGS = ("--task", "sums", "--prompts", 2, "--group-size", 4, "--max-tokens", 12,
             "--held-out", 12, "--lr", 2e-5)


@pytest.fixture(scope="module")
def hf_sums(real_model):
    """The HF backend's greedy sums in float32, the reference (its engine stopped before
    vLLM's starts)."""
    with rollout.load_backend("hf", "smollm2", dtype="float32") as hf:
        return checks.greedy_sums(hf)


@pytest.fixture(scope="module")
def engine(real_model):
    with rollout.load_backend("vllm", "smollm2", mode="engine", **ENGINE) as ro:
        yield ro


def test_float32_greedy_sums_agree_with_hf_and_are_right(hf_sums, engine, real_model):
    checks.check_agrees_with_hf(hf_sums, checks.greedy_sums(engine), real_model)


def test_a_push_of_the_whole_model_takes_effect(engine, real_model):
    # The engine has served the test above only: nothing pushed yet.
    assert engine.weight_version is None
    try:
        checks.check_update_takes_effect(engine, real_model)
    finally:
        engine.close()  # the engine is spent (its weights changed); free its memory now


def test_bfloat16_answers_the_same_sums(real_model):
    with rollout.load_backend("vllm", "smollm2", mode="engine", dtype="bfloat16",
                              enforce_eager=True) as ro:
        checks.check_sums_right(checks.greedy_sums(ro, logprobs=0))


def test_a_few_grpo_steps_through_two_replica_processes(real_model):
    """The example's sums task sampling from two `rollout serve` replicas: every step's
    weights travel to both processes through shared memory before the next samples, and
    the samples' logprobs equal the float32 trainer's. Two steps: the second samples from
    weights pushed across processes; held-out accuracy measured through them."""
    run = run_grpo("vllm", ENGINE, "smollm2", *GRPO_ARGS, "--steps", 2, "--replicas", 2,
                   timeout=900)
    assert len(run.steps) == 2 and run.summary["max_logprob_diff"] <= 1e-3, run.summary
    assert run.summary["accuracy_before"] is not None and run.summary["accuracy_after"] is not None
