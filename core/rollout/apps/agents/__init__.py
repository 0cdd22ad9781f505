"""Multi-turn, tool-calling trajectories with exact tokens, over any backend or pool.

- `tools`: plain functions as tools (schema from signature and docstring, arguments
  checked, timeouts, result caps);
- `environment`: first messages, answers to the model's turns, episode end and reward;
- `tokens`: token-in/token-out across turns, and the template's re-rendering compared;
- `trajectory`: what a trajectory holds (ids, loss mask, logprobs, turns, end reason);
- `runner`: `AgentRunner`, thousands of trajectories at once under limits.

See docs/agents.md.
"""

from rollout.apps.agents.environment import Environment, Reply, load_environment, load_tool
from rollout.apps.agents.runner import AgentConfig, AgentRunner, PrefixMismatchError
from rollout.apps.agents.tokens import ChatTokens, TemplateError
from rollout.apps.agents.tools import FunctionTool, function_tool
from rollout.apps.agents.trajectory import END_REASONS, ToolCallRecord, Trajectory, Turn

__all__ = ["END_REASONS", "AgentConfig", "AgentRunner", "ChatTokens", "Environment",
           "FunctionTool", "PrefixMismatchError", "Reply", "TemplateError", "ToolCallRecord",
           "Trajectory", "Turn", "function_tool", "load_environment", "load_tool"]
