"""The OpenAI Agents SDK's tool loop, default (strict) function tools and all, against
`rollout serve` on the sglang backend (rollout.testing.agents_sdk). The SDK lives in the HF
environment: scripts/test.sh names its Python in ROLLOUT_AGENTS_PYTHON."""

import os

import pytest
from conftest import ENGINE

from rollout.testing.agents_sdk import check_agents_sdk

AGENTS_PYTHON = os.environ.get("ROLLOUT_AGENTS_PYTHON")


@pytest.mark.skipif(not AGENTS_PYTHON, reason="ROLLOUT_AGENTS_PYTHON (a Python with the SDK) unset")
def test_an_agent_with_strict_tools_completes_its_tool_loop(tiny_model):
    check_agents_sdk(AGENTS_PYTHON, "sglang", str(tiny_model), ENGINE)
