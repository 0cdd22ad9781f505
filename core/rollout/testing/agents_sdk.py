"""The OpenAI Agents SDK (the real package) as a client of `rollout serve`.

An agent with two plain `@function_tool`s, which the SDK marks `strict`, runs a tool loop:
the first turn asks for one call (`tool_choice="required"`, which forces a valid call even
from a random model), the SDK runs the tools and, as it does by default, sends the next turn with
`tool_choice="auto"`, strict tools and all; the model then answers in text (a random
model's stray `<tool_call>` tag is banned by a logit bias, so the loop ends). Every call's
arguments must match its tool's schema. It runs twice: with the SDK's default model class,
which speaks the Responses API (`/v1/responses`), sending no `max_tokens` as the SDK does by
default (the SDK fails a response cut short; EOS is favoured, so that a random model's
answer ends by itself), and with its chat-completions model class. Then a forced call cut short by its token
limit must reach the SDK as cut (it raises), not as a final answer.

`python -m rollout.testing.agents_sdk URL MODEL OPENING_TOKEN_ID EOS_TOKEN_ID API` runs the
agent and prints one JSON line; `check_agents_sdk` starts `rollout serve` on a backend and
runs that in the Python given (one with the SDK installed, which may be another
environment's than the server's).
"""

import sys

from rollout.testing.serve_child import MODEL_NAME, print_result, rollout_serve, run_client

# No `from __future__ import annotations` here: the SDK reads the tools' annotations, which
# name types imported inside run_agent.


def run_agent(url: str, model: str, opening: int, eos: int, api: str) -> dict:
    import asyncio
    from typing import Annotated, Literal

    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel,
                        OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI
    from pydantic import Field

    set_tracing_disabled(True)  # nothing leaves this machine
    calls = []

    # Bounded arguments, so that a random model's call fits in a few tokens.
    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=9)], b: Annotated[int, Field(ge=0, le=9)]) -> int:
        """Add two digits."""
        calls.append(("add", {"a": a, "b": b}))
        return a + b

    @function_tool
    def weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(("weather", {"city": city}))
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    if api == "responses":  # the SDK's defaults: no max_tokens
        chosen = OpenAIResponsesModel(model=model, openai_client=client)
        settings = ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                 temperature=1.0, extra_body={
                                     "logit_bias": {str(opening): -100, str(eos): 3}})
    else:
        chosen = OpenAIChatCompletionsModel(model=model, openai_client=client)
        settings = ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                 max_tokens=96, temperature=1.0,
                                 extra_body={"logit_bias": {str(opening): -100}})
    agent = Agent(name="assistant", instructions="Use the tools, then answer.",
                  tools=[add, weather], model=chosen, model_settings=settings)
    if api == "cut":  # a forced call cut by max_tokens: an error, not a final answer
        agent = agent.clone(model=OpenAIResponsesModel(model=model, openai_client=client),
                            model_settings=ModelSettings(tool_choice="required", max_tokens=4))
        try:
            result = asyncio.run(Runner.run(agent, "What is 2 + 3?", max_turns=2))
        except Exception as exc:  # noqa: BLE001 - what the SDK makes of it is the answer
            return {"raised": type(exc).__name__, "message": str(exc)[:500]}
        return {"final_output": result.final_output}
    result = asyncio.run(Runner.run(agent, "What is 2 + 3, and the weather in Paris?",
                                    max_turns=4))
    schemas = {t.name: t.params_json_schema for t in (add, weather)}
    return {"strict": [t.strict_json_schema for t in (add, weather)], "calls": calls,
            "schemas": schemas, "final_output": result.final_output,
            "turns": sum(1 for item in result.raw_responses)}


def check_agents_sdk(python: str, backend: str, model_dir: str, options: dict | None = None,
                     timeout: float = 600) -> None:
    """Serve `backend`, run the agent against it with `python`, by each API: strict
    tools, at least one call, each call's arguments valid for its tool, a text answer at
    the end."""
    import jsonschema
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    opening = tokenizer.convert_tokens_to_ids("<tool_call>")
    with rollout_serve(backend, model_dir, options) as url:
        for api in ("responses", "chat"):
            run = run_client([python, "-m", "rollout.testing.agents_sdk", url, MODEL_NAME,
                              str(opening), str(tokenizer.eos_token_id), api], timeout)
            assert run["strict"] == [True, True], run  # the SDK's default: the case that failed
            assert run["calls"], run
            for name, arguments in run["calls"]:
                jsonschema.validate(arguments, run["schemas"][name])
            assert isinstance(run["final_output"], str) and run["turns"] >= 2, run
        cut = run_client([python, "-m", "rollout.testing.agents_sdk", url, MODEL_NAME,
                          str(opening), str(tokenizer.eos_token_id), "cut"], timeout)
        assert "max_output_tokens" in cut.get("message", ""), cut


if __name__ == "__main__":
    print_result(run_agent(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                           sys.argv[5]))
