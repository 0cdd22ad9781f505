"""rollout.apps.rl.mismatch: the batch diagnostics against values worked by hand, and each
importance-weight correction."""

import math

import pytest
import torch

from rollout.apps.rl import CORRECTIONS, importance_weights, mismatch


def test_on_policy_tokens_show_no_mismatch():
    logprobs = [[-1.0, -2.5], [-0.1]]
    m = mismatch(logprobs, logprobs)
    assert m["kl_k3"] == 0 and m["ratio_mean"] == 1 and m["outside"] == 0


def test_a_constant_ratio_gives_its_k3_kl_and_quantiles():
    behaviour = [torch.tensor([-1.0, -2.0, -3.0, -0.5])]
    trainer = [behaviour[0] + math.log(0.8)]  # every ratio 0.8: outside [0.9, 1.1]
    m = mismatch(trainer, behaviour)
    assert m["ratio_mean"] == pytest.approx(0.8)
    assert m["kl_k3"] == pytest.approx(-0.2 - math.log(0.8))
    assert m["ratio_p05"] == m["ratio_p95"] == pytest.approx(0.8)
    assert m["outside"] == 1.0
    assert mismatch([], []) == {}


def test_each_correction_weighs_tokens_as_documented():
    behaviour = [[0.0, 0.0, 0.0]]
    trainer = [torch.log(torch.tensor([0.5, 1.5, 3.0]))]  # ratios 0.5, 1.5, 3
    weights = {c: importance_weights(trainer, behaviour, c, cap=2.0)[0].tolist()
               for c in CORRECTIONS}
    assert weights["none"] == [1.0, 1.0, 1.0]
    assert weights["tis"] == pytest.approx([0.5, 1.5, 2.0])
    assert weights["mis"] == pytest.approx([0.5, 1.5, 0.0])
    assert weights["seq-tis"] == pytest.approx([2.0] * 3)  # the product 2.25, truncated
    assert weights["seq-mis"] == pytest.approx([0.0] * 3)
    assert not importance_weights(trainer, behaviour)[0].requires_grad
    with pytest.raises(ValueError, match="correction"):
        importance_weights(trainer, behaviour, "clip")
