"""Drift over agent harnesses run unchanged: sessions of the `llm` CLI, the OpenAI Agents SDK
(a tool call, its result, an answer), pydantic-ai (a structured answer, retried when it does
not validate), smolagents (a tool-calling agent over several steps) and Codex CLI (npm, where
installed), each through `rollout.apps.rl.Harness` against a gateway over the HF backend.
Every call goes through a proxy that asks chat calls for the ids they sampled
(`return_token_ids`). Printed per harness: sessions, calls, branches, and two drifts over
the sampled tokens of every call:

- recorded: tokens where the session's recording differs from what the engine sampled (the
  ids returned, or for Codex's Responses calls their text); target 0;
- text: calls whose sampled ids, decoded and re-tokenized as a trainer that rebuilds a
  trajectory from text does, come back different, and the tokens from the first
  difference on.

    python bench/bench_harness_drift.py [--model tiny|smollm2] [--sessions 50]
        [--cli-sessions 10] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

from common import add_model_argument, model_folder

import rollout
from rollout.apps.rl import Harness, gateway
from rollout.contract.convert import structure
from rollout.kit.aio import engine_loop
from rollout.testing.proxy import CountingProxy, answered

from pydantic import Field

LIMIT = 96  # tokens an answer may have (a forced tool call takes about 60 here)
TASKS = ["What is {a} + {b}?", "Add {a} and {b}, then say the result.",
         "I have {a} apples and buy {b} more. How many now?"]
SAMPLING = ("/v1/chat/completions", "/v1/responses", "/v1/messages")


Digit = Annotated[int, Field(ge=0, le=9)]  # (a random model writes long numbers otherwise)


def add_digits(a: Digit, b: Digit) -> int:
    """Add two digits."""
    return a + b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def llm_agent(scratch: Path):
    llm = shutil.which("llm", path=str(Path(sys.executable).parent))
    (scratch / "extra-openai-models.yaml").write_text("- model_id: rollout\n"
                                                       "  model_name: policy\n")
    env = {"LLM_USER_PATH": str(scratch), "LLM_LOAD_PLUGINS": ""}
    (scratch / "logs.db").touch()  # migrated once here: runs that create it at once race
    subprocess.run([llm, "logs", "status"], env={**os.environ, **env}, check=True,
                   capture_output=True, timeout=120)
    return [llm, "-m", "rollout", "-n", "-o", "max_tokens", str(LIMIT), "{task}"], env


async def agents_sdk(call):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, \
        function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=call.openai_base_url, api_key=call.api_key, max_retries=0)
    agent = Agent(name="calculator", instructions="Use the tool, then answer.",
                  tools=[function_tool(add_digits)],
                  model=OpenAIChatCompletionsModel(call.model, client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=LIMIT))
    return (await Runner.run(agent, call.task, max_turns=3)).final_output


def pydantic_ai(call):
    """A structured answer, sent back to the model to try again while it is wrong."""
    from pydantic_ai import Agent, ModelRetry
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(call.model, provider=OpenAIProvider(base_url=call.openai_base_url,
                                                                api_key=call.api_key))
    agent = Agent(model, output_type=Annotated[int, Field(ge=0, le=99)], retries=2,
                  model_settings={"max_tokens": LIMIT})

    @agent.output_validator
    def right(answer: int) -> int:
        if answer != call.request.metadata["answer"]:
            raise ModelRetry(f"{answer} is wrong, try again")
        return answer

    return agent.run_sync(call.task).output


def smolagents(call):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id=call.model, api_base=call.openai_base_url,
                              api_key=call.api_key, max_tokens=LIMIT)
    return ToolCallingAgent(tools=[tool(add)], model=model, max_steps=3,
                            verbosity_level=0).run(call.task)


def codex_agent(scratch: Path):
    """Codex CLI 0.169.0 from the tests' npm folder (scripts/test.sh installs it), its
    provider's base URL given on the command line; None where it is not installed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from harnesses import codex_binary, folder

    try:
        codex = codex_binary(folder())
    except Exception:  # noqa: BLE001 - not installed here
        return None
    provider = ('{name="local", base_url="{openai_base_url}", wire_api="responses", '
                'env_key="OPENAI_API_KEY"}')
    (scratch / ".codex").mkdir(exist_ok=True)
    return [str(codex), "exec", "--json", "--skip-git-repo-check", "-c", 'model="{model}"',
            "-c", 'model_provider="local"', "-c", f"model_providers.local={provider}",
            "{task}"], {"HOME": str(scratch), "CODEX_HOME": str(scratch / ".codex")}


def rewrite(call):
    """Chat calls ask for their sampled ids; Responses calls get a length (Codex sends
    none and has no setting for it)."""
    body = call.json()
    if not isinstance(body, dict):
        return None
    if call.path.endswith("/v1/chat/completions"):
        return json.dumps({**body, "return_token_ids": True}).encode()
    if call.path.endswith("/v1/responses"):
        return json.dumps({**body, "max_output_tokens": LIMIT}).encode()
    return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(name: str, episodes, calls, tokenizer) -> dict:
    """The harness's sessions against what their calls sampled."""
    sampled = [c for c in calls if c.method == "POST" and c.path.split("?")[0].endswith(
        SAMPLING) and 200 <= (c.status or 0) < 300]
    by_session: dict[str, list] = {}
    for c in sampled:
        session = c.path.split("/sessions/")[1].split("/")[0]
        by_session.setdefault(session, []).append(answered(c))
    stats = {"harness": name, "sessions": len(episodes), "failed": 0, "calls": len(sampled),
             "branches": 0, "tokens": 0, "recorded_drift": 0, "text_drift_calls": 0,
             "text_drift_tokens": 0, "multi_call_sessions": 0, "first_error": None}
    for episode in episodes:
        stats["failed"] += episode.error is not None
        stats["first_error"] = stats["first_error"] or (episode.error or "")[-300:] or None
        stats["branches"] += len(episode.branches)
        runs = episode.calls
        answers = by_session.get(episode.session, [])
        stats["multi_call_sessions"] += len(answers) > 1
        # Recorded: each call's sampled ids (or, without them, its text) in the recording.
        left = list(runs)
        for text, count, ids in answers:
            match = next((r for r in left if r == ids or ids is None and len(r) == count and (
                text is None or tokenizer.decode(r, skip_special_tokens=True).strip()
                == text.strip())), None)
            if match is None:
                stats["recorded_drift"] += count
            else:
                left.remove(match)
        stats["recorded_drift"] += sum(len(r) for r in left)  # recorded, never answered
        for run in runs:
            stats["tokens"] += len(run)
            again = tokenizer(tokenizer.decode(run), add_special_tokens=False).input_ids
            at = first_difference(run, again)
            if at is not None:
                stats["text_drift_calls"] += 1
                stats["text_drift_tokens"] += len(run) - at
    return stats


async def run_harness(harness: Harness, count: int, concurrency: int) -> list:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int):
        a, b = i % 9 + 1, (i * 7) % 9 + 1
        request = structure({"id": f"d{i}", "metadata": {"answer": a + b}, "messages": [
            {"role": "user", "content": TASKS[i % len(TASKS)].format(a=a, b=b)}]},
            rollout.Request)
        async with gate:
            return await harness.run(request)

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--sessions", type=int, default=50, help="per Python harness")
    parser.add_argument("--cli-sessions", type=int, default=10, help="of Codex CLI")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="drift-") as tmp:
        folder = model_folder(args.model, tmp)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        # Codex's prompt is about 23k tokens of the tiny tokenizer.
        ro = rollout.load_backend("hf", model=folder, max_model_len=65536)
        harnesses = {"llm": (*llm_agent(Path(tmp)), args.sessions),
                     "openai-agents": (agents_sdk, {}, args.sessions),
                     "pydantic-ai": (pydantic_ai, {}, args.sessions),
                     "smolagents": (smolagents, {}, args.sessions)}
        codex = codex_agent(Path(tmp))
        if codex is not None and args.cli_sessions:
            harnesses["codex"] = (*codex, args.cli_sessions)
        results = []
        try:
            with gateway(ro) as url:
                for name, (agent, env, count) in harnesses.items():
                    with CountingProxy(url, rewrite=rewrite) as proxy:
                        harness = Harness(agent, proxy.url, env=env, timeout=900)
                        episodes = engine_loop().run(
                            run_harness(harness, count, args.concurrency), 7200, name)
                    results.append(measure(name, episodes, proxy.calls, tokenizer))
                    print(json.dumps(results[-1]), flush=True)
        finally:
            ro.close()
    total = {k: sum(r[k] for r in results) for k in results[0]
             if k not in ("harness", "first_error")}
    print(json.dumps({"harness": "all", "harnesses": len(results), **total}))
    print(f"{total['sessions']} sessions over {len(results)} harnesses, {total['calls']} calls, "
          f"{total['tokens']} sampled tokens: recorded drift {total['recorded_drift']} tokens; "
          f"rebuilt from text, {total['text_drift_calls']} calls differ "
          f"({total['text_drift_tokens']} tokens from the first difference on)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
