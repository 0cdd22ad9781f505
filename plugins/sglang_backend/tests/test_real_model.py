"""The SGLang backend on the real SmolLM2-135M-Instruct: the same greedy sums as the HF
backend (and right), the model's chat template, a push of the whole model that takes
effect, a few GRPO steps of examples/grpo.py on the sums task, and the same right sums in
bfloat16.

One engine serves the module's first tests (starting one costs about a minute and 4 GB):
the push test runs after the agreement test on the same engine, since the push leaves
perturbed weights behind. The engine is closed before the GRPO run and the bfloat16 test,
which start their own, so that no two SGLang engines run at once."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import real_model as checks
from rollout.testing.grpo import run_grpo

# float32, as the HF backend; KV room for the 8 short sums (about 60 tokens each), not the
# contract's 64 long sequences (46 KB a token for this model).
REAL_ENGINE = {**ENGINE, "max_total_tokens": 4096}


class Engine:
    """The module's engine, started on first use and closed on demand or at the end."""

    def __init__(self):
        self.backend = None

    def get(self):
        if self.backend is None:
            self.backend = rollout.load_backend("sglang", "smollm2", mode="engine",
                                                **REAL_ENGINE)
        return self.backend

    def close(self):
        if self.backend is not None:
            self.backend.close()


@pytest.fixture(scope="module")
def engine(real_model):
    holder = Engine()
    yield holder
    holder.close()


@pytest.fixture(scope="module")
def hf_sums(real_model):
    with rollout.load_backend("hf", "smollm2", dtype="float32") as hf:
        return checks.greedy_sums(hf)


def test_greedy_sums_agree_with_hf_and_are_right(engine, hf_sums, real_model):
    checks.check_agrees_with_hf(hf_sums, checks.greedy_sums(engine.get()), real_model)


def test_a_push_of_the_whole_model_takes_effect(engine, real_model):
    checks.check_update_takes_effect(engine.get(), real_model)


def test_a_few_grpo_steps_on_the_sums(engine, real_model):
    """examples/grpo.py on SGLang, the sums task: the engine's logprobs equal the trainer's
    after every push of the full model."""
    engine.close()  # the run starts its own engine
    run = run_grpo("sglang", {"dtype": "float32", "max_total_tokens": 8192}, "smollm2",
                   "--task", "sums", "--steps", 2, "--prompts", 2, "--group-size", 4,
                   "--max-tokens", 12, "--held-out", 12, "--lr", 2e-5, timeout=600)
    assert len(run.steps) == 2, run.steps
    assert run.summary["max_logprob_diff"] <= 1e-3, run.summary
    assert run.summary["accuracy_before"] is not None, run.summary
    assert run.summary["accuracy_after"] is not None, run.summary


def test_bfloat16_answers_the_same_sums(engine, real_model):
    engine.close()  # one engine at a time
    with rollout.load_backend("sglang", "smollm2", mode="engine",
                              **{**REAL_ENGINE, "dtype": "bfloat16"}) as ro:
        checks.check_sums_right(checks.greedy_sums(ro, logprobs=0))
