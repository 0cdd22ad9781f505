"""TRL's GRPOTrainer sampling through `rollout.integrations.trl` on the real model: on the
vLLM engine in process, and on the HF backend through a replica process (weights over
shared memory); without the pushes, the gap that they close; and a LoRA trainer, which
pushes its adapter alone. TRL lives in this environment (requirements/trl.txt, peft.txt)."""

import pytest
from conftest import ENGINE

import rollout
from rollout.service.served import ServedRollout

pytest.importorskip("trl", reason="TRL is not installed in this environment")
from rollout.testing import trl as checks  # noqa: E402


@pytest.fixture(params=["vllm", "hf-replica"])
def sampler(request, real_model):
    if request.param == "hf-replica":
        with ServedRollout.start("hf", str(real_model), 1, {"dtype": "float32"}) as served:
            yield served
        return
    with rollout.load_backend("vllm", str(real_model), mode="engine", **ENGINE) as ro:
        yield ro


def test_grpo_trainer_samples_through_rollout_with_the_trainers_weights(sampler, real_model,
                                                                      tmp_path):
    checks.check_grpo_trainer_through_rollout(sampler, str(real_model), str(tmp_path))


def test_without_the_pushes_the_engine_lags_the_trainer(real_model, tmp_path):
    with rollout.load_backend("hf", str(real_model), dtype="float32") as ro:
        func, _ = checks.train(ro, str(real_model), str(tmp_path), push_weights=False)
    gaps = func.gaps
    assert gaps[0][1] < checks.TOLERANCE < gaps[1][1]  # step 1 samples step 0's weights


def test_a_lora_trainer_pushes_only_its_adapter(real_model, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed in this environment")
    with rollout.load_backend("vllm", str(real_model), mode="engine",
                              engine_args={"enable_lora": True, "max_lora_rank": 8},
                              **ENGINE) as ro:
        checks.check_lora_grpo_trainer_through_rollout(ro, str(real_model), str(tmp_path))
