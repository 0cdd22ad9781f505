"""TRL's own vLLM client against `rollout serve` on the SGLang backend
(rollout.testing.trl_client). The client needs vLLM, so it runs in the vLLM environment's
Python, which scripts/test.sh names in ROLLOUT_VLLM_PYTHON."""

import os

import pytest
from conftest import ENGINE

from rollout.testing.trl_client import check_trl_client

CLIENT_PYTHON = os.environ.get("ROLLOUT_VLLM_PYTHON")


@pytest.mark.skipif(not CLIENT_PYTHON, reason="ROLLOUT_VLLM_PYTHON (a Python with vLLM) unset")
def test_trls_vllm_client_generates_and_chats_against_sglang(tiny_model):
    check_trl_client(CLIENT_PYTHON, "sglang", str(tiny_model), ENGINE)
