"""TRL's GRPOTrainer sampling through `rollout.integrations.trl` from the SGLang engine on
the real model. TRL lives in this environment (requirements/trl.txt)."""

import pytest
from conftest import ENGINE

import rollout

pytest.importorskip("trl", reason="TRL is not installed in this environment")
from rollout.testing import trl as checks  # noqa: E402


def test_grpo_trainer_samples_through_sglang_with_the_trainers_weights(real_model, tmp_path):
    with rollout.load_backend("sglang", str(real_model), mode="engine",
                              **{**ENGINE, "max_total_tokens": 4096}) as ro:
        checks.check_grpo_trainer_through_rollout(ro, str(real_model), str(tmp_path))
