"""Agent programs and libraries from PyPI, run unchanged through `rollout.apps.rl.Harness`
against a gateway over the HF backend on the tiny model: the `llm` CLI, mini-swe-agent's
`mini` and verifiers' `vf-eval` (commands), and the OpenAI Agents SDK, pydantic-ai and
smolagents (functions). Every HTTP call passes through a
counting proxy (rollout.testing.proxy), which also asks each for its sampled ids, and must
be answered with a 2xx; each episode's branches hold exactly the ids the calls sampled (one
run of sampled tokens per call, decoding to the text the library received), and where
sampling was free their logprobs are a trainer's forward pass."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import rollout
from rollout.apps.rl import Harness, gateway, largest_gap
from rollout.contract.convert import structure
from rollout.kit.aio import engine_loop
from rollout.testing.proxy import CountingProxy, answered
from rollout.testing.forward import logprobs_under

CONTEXT = 65536  # smolagents' system prompt is about 11k tokens of the tiny tokenizer
LIMIT = 16
TASK = structure({"id": "task", "messages": [{"role": "user", "content": "What is 2+2?"}]},
                 rollout.Request)
SAMPLING = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
# verifiers has an environment of its own (it pins openai<3): scripts/test.sh names its Python.
VERIFIERS_PYTHON = os.environ.get("ROLLOUT_VERIFIERS_PYTHON")


@pytest.fixture(scope="module")
def ro(tiny_model):
    ro = rollout.load_backend("hf", model=str(tiny_model), max_model_len=CONTEXT)
    yield ro
    ro.close()


@pytest.fixture(scope="module")
def url(ro):
    with gateway(ro) as url:
        yield url


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model))


def ask_ids(call):
    """A chat call as sent, asking for its sampled ids too (vLLM's `return_token_ids`):
    what the engine sampled, to hold the recording to."""
    body = call.json()
    if call.path.endswith("/v1/chat/completions") and isinstance(body, dict):
        return json.dumps({**body, "return_token_ids": True}).encode()
    return None


def episode_through_proxy(url: str, agent, **options):
    """One episode of the task, every call of it through a counting proxy."""
    with CountingProxy(url, rewrite=ask_ids) as proxy:
        episode = engine_loop().run(Harness(agent, proxy.url, **options).run(TASK), 900,
                                    "an agent's episode")
    return episode, proxy.calls


def check(episode, calls, trainer, free: bool) -> None:
    model, tokenizer = trainer
    assert episode.error is None, episode.error
    assert calls and all(200 <= (c.status or 0) < 300 for c in calls), calls
    sampling = [c for c in calls if c.method == "POST" and c.path.endswith(SAMPLING)]
    # Besides them only model lists, and the harness's own: the model's name, the session.
    assert {c.path.split("?")[0] for c in calls} - {c.path.split("?")[0] for c in sampling} \
        <= {"/v1/models", f"/sessions/{episode.session}/v1/models",
            f"/rollout/sessions/{episode.session}"}
    assert all(f"/sessions/{episode.session}/" in c.path for c in sampling)
    answers = [answered(c) for c in sampling]
    runs = episode.calls
    # One run of sampled tokens per call, as many as each call was answered with, and
    # exactly the ids the engine sampled for it.
    assert sorted(len(r) for r in runs) == sorted(n for _, n, _ in answers)
    assert all(n <= LIMIT for _, n, _ in answers)
    assert all(ids is not None for *_, ids in answers)  # (every call here is a chat call)
    assert sorted(runs) == sorted(ids for *_, ids in answers)
    # The texts the library got are the recorded tokens' (tool calls aside).
    decoded = sorted(tokenizer.decode(r, skip_special_tokens=True) for r in runs)
    for text, *_ in answers:
        if text is not None:
            assert any(text == d or text == d.strip() for d in decoded), (text, decoded)
    if free:  # (under a grammar the engine's logprobs are the constrained ones)
        assert largest_gap(list(episode.branches), logprobs_under(model)) < 1e-4


def test_the_llm_cli(url, trainer, tmp_path):
    llm = shutil.which("llm", path=str(Path(sys.executable).parent))
    assert llm, "llm is not installed beside this Python (requirements/agents.txt)"
    (tmp_path / "extra-openai-models.yaml").write_text(
        "- model_id: rollout\n  model_name: policy\n")
    (tmp_path / "logs.db").touch()
    episode, calls = episode_through_proxy(
        url, [llm, "-m", "rollout", "-n", "-o", "max_tokens", str(LIMIT), "{task}"],
        env={"LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": ""})
    check(episode, calls, trainer, free=True)
    (text, _, _), = [answered(c) for c in calls if c.method == "POST"]
    assert episode.output == text + "\n"  # what it printed is what it was answered


def test_the_openai_agents_sdk(url, trainer):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, \
        set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # (its traces go to OpenAI)

    async def agent(call):
        client = AsyncOpenAI(base_url=call.openai_base_url, api_key=call.api_key,
                             max_retries=0)
        assistant = Agent(name="assistant", instructions="Answer briefly.",
                          model=OpenAIChatCompletionsModel(call.model, client),
                          model_settings=ModelSettings(max_tokens=LIMIT))
        return (await Runner.run(assistant, call.task, max_turns=2)).final_output

    episode, calls = episode_through_proxy(url, agent)
    check(episode, calls, trainer, free=True)


def test_pydantic_ai(url, trainer):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def agent(call):
        model = OpenAIChatModel(call.model, provider=OpenAIProvider(
            base_url=call.openai_base_url, api_key=call.api_key))
        assistant = Agent(model, instructions="Answer briefly.",
                          model_settings={"max_tokens": LIMIT})
        return assistant.run_sync(call.task).output

    episode, calls = episode_through_proxy(url, agent)
    check(episode, calls, trainer, free=True)


def test_smolagents(url, trainer):
    """A tool-calling agent: smolagents asks for a tool call on every step (tool_choice
    "required"), so its tokens are sampled under the call grammar."""
    from smolagents import OpenAIServerModel, ToolCallingAgent

    def agent(call):
        model = OpenAIServerModel(model_id=call.model, api_base=call.openai_base_url,
                                  api_key=call.api_key, max_tokens=LIMIT)
        return ToolCallingAgent(tools=[], model=model, max_steps=2).run(call.task)

    episode, calls = episode_through_proxy(url, agent)
    check(episode, calls, trainer, free=False)


def test_mini_swe_agent(url, trainer, tmp_path):
    """mini-swe-agent's `mini` CLI, through litellm, as its users run it headless: a bash
    tool offered on every call; the random model's answers carry no call, so each is a
    format error, which it sends back in place of the answer, until three end the run."""
    mini = shutil.which("mini", path=str(Path(sys.executable).parent))
    assert mini, "mini-swe-agent is not installed beside this Python (requirements/agents.txt)"
    episode, calls = episode_through_proxy(
        url, [mini, "--yolo", "--exit-immediately", "-m", "openai/{model}", "-t", "{task}",
              "-c", "mini.yaml", "-c", f"model.model_kwargs.max_tokens={LIMIT}",
              "-c", "agent.step_limit=4", "-o", str(tmp_path / "run.traj.json")],
        env={"MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path), "MSWEA_CONFIGURED": "true",
             "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
             "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    check(episode, calls, trainer, free=True)
    run = json.loads((tmp_path / "run.traj.json").read_text())
    assert run["info"]["exit_status"] in ("RepeatedFormatError", "LimitsExceeded"), run["info"]
    # A format error sends back the error, not the answer that caused it: each call's
    # history drops the last answer, so each call starts a branch (never spliced).
    assert len(episode.calls) >= 3 and len(episode.branches) == len(episode.calls)


@pytest.mark.skipif(not VERIFIERS_PYTHON,
                    reason="ROLLOUT_VERIFIERS_PYTHON (a Python with verifiers) unset")
def test_verifiers(url, trainer, tmp_path):
    """verifiers 0.4's `vf-eval` CLI on its `user-sim` environment over a taskset of one
    task (tests/verifiers_taskset.py): a modeled user converses with the assistant under
    evaluation, both verifiers' tool-less `null` chat program in its subprocess runtime and
    both sampled by the policy, three turns each. Every call goes through verifiers' own
    interception server, which relays it, streamed, to the session's base URL."""
    bin_dir = Path(VERIFIERS_PYTHON).parent
    episode, calls = episode_through_proxy(
        url, [str(bin_dir / "vf-eval"), "verifiers_taskset", "--env.taskset.prompt", "{task}",
              "--env.taskset.answer", "4", "--env.id", "user-sim", "--env.user.max-turns", "3",
              "--env.assistant.harness.id", "null", "--env.user.runtime.type", "subprocess",
              "--env.assistant.runtime.type", "subprocess", "--model", "{model}",
              "--client.base-url", "{openai_base_url}", "--client.api-key-var", "OPENAI_API_KEY",
              "--sampling.max-tokens", str(LIMIT), "--no-push", "--no-rich", "-o", str(tmp_path)],
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",  # its uv
             "PYTHONPATH": str(Path(__file__).parent),  # the taskset, imported by name
             "UV_PYTHON_DOWNLOADS": "never"})  # (none reachable: uv takes the machine's)
    check(episode, calls, trainer, free=True)
    # It prints each agent's trace as JSON: both ran to their end, and what verifiers
    # recorded as sampled is what the server answered, call for call.
    decoder, text, traces = json.JSONDecoder(), episode.output, {}
    while text.strip():
        trace, end = decoder.raw_decode(text.lstrip())
        traces[trace["agent"]["name"]], text = trace, text.lstrip()[end:]
    assert sorted(traces) == ["assistant", "user"]
    assert all(t["ok"] and not t.get("errors") for t in traces.values()), traces
    replies = [n["message"].get("content") or "" for t in traces.values() for n in t["nodes"]
               if n["sampled"]]
    assert len(replies) == 6 and sorted(replies) == sorted(
        answered(c)[0] for c in calls if c.method == "POST")
    # The two sides are two conversations, so two branches at least.
    assert len(episode.branches) >= 2
    assistant = [n["message"].get("content") or "" for n in traces["assistant"]["nodes"]
                 if n["sampled"]]
    assert traces["assistant"]["rewards"]["correct"]["score"] == float("4" in assistant[-1])
