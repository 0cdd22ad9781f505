"""The OpenAI Agents SDK's tool loop, default (strict) function tools and all, against
`rollout serve` on the HF backend (rollout.testing.agents_sdk)."""

import sys

import pytest

pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed here")
from rollout.testing.agents_sdk import check_agents_sdk  # noqa: E402


def test_an_agent_with_strict_tools_completes_its_tool_loop(tiny_model):
    check_agents_sdk(sys.executable, "hf", str(tiny_model), {"dtype": "float32"})
