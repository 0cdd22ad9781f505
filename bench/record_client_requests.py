"""Record the requests real clients send, for the differential suite against vLLM's server
(rollout.testing.differential; plugins/vllm_backend/tests/test_differential.py replays
the recording without the clients).

A recording proxy (aiohttp) sits in front of a running server (`--upstream`, vLLM's own
OpenAI server on the tiny model, served as "tiny": the clients then see the reference
server's answers) and writes each POST to /v1/completions, /v1/chat/completions and
/v1/responses as one JSON line `{"source", "path", "body"}`. Each client reaches the proxy
under a path of its own name (`http://127.0.0.1:PORT/openai/v1/...`), which the proxy takes
off and records as `source`. The clients, each run as its own process in the Python that
has it (`client NAME BASE_URL`):

- openai: the openai SDK's completions, chat (plain, streamed with usage, tools, logprobs,
  response_format, vLLM's extension fields), responses (plain and streamed);
- trl: TRL's VLLMClient generate (text and token ids, greedy and under a regex), chat
  (with a Python function as a tool) and sequence logprobs;
- bench: vLLM's serving benchmark (`vllm bench serve`, random dataset) on completions and
  chat;
- agents: the OpenAI Agents SDK, its default (Responses) model and its chat model, with a
  function tool;
- langchain: LangChain's ChatOpenAI (invoke, stream, bound tools, structured output).

Run (vLLM's server on the tiny model first, e.g. as bench/bench_differential.py starts it):
    VPY=~/.cache/rollout/venvs/vllm-*/bin/python; HPY=~/.cache/rollout/venvs/hf-*/bin/python
    $VPY bench/record_client_requests.py --upstream http://127.0.0.1:8000 --tokenizer TINY_DIR \
        --hf-python $HPY --out plugins/vllm_backend/tests/data/client_requests.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
MODEL = "tiny"
# Which Python runs which client: "vllm" (the vLLM environment: vLLM, TRL, the openai SDK)
# or "hf" (the HF environment: the Agents SDK, LangChain).
CLIENTS = {"openai": "vllm", "trl": "vllm", "bench": "vllm", "agents": "hf", "langchain": "hf"}


# --- the proxy ----------------------------------------------------------------------------


class Recorder:
    """The proxy: forwards every request to `upstream`, records the POST bodies of the
    OpenAI routes."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.records: list[dict] = []
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    async def _handle(self, request):
        from aiohttp import ClientSession, ClientTimeout, web

        source, _, rest = request.path.lstrip("/").partition("/")
        path = "/" + rest
        raw = await request.read()
        if request.method == "POST" and path in ROUTES:
            self.records.append({"source": source, "path": path, "body": json.loads(raw)})
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("content-type", "authorization", "accept")}
        async with ClientSession(timeout=ClientTimeout(total=600)) as session:
            async with session.request(request.method, self.upstream + path, data=raw or None,
                                       headers=headers, params=request.query) as upstream:
                response = web.StreamResponse(status=upstream.status)
                if upstream.content_type:
                    response.content_type = upstream.content_type
                await response.prepare(request)
                try:
                    async for piece in upstream.content.iter_any():
                        await response.write(piece)
                    await response.write_eof()
                except ConnectionResetError:  # the client has read all it wanted ([DONE])
                    pass
                return response

    def serve_in_thread(self) -> None:
        threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True).start()
        self._ready.wait(30)

    async def _serve(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()


# --- the clients --------------------------------------------------------------------------

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}


def client_openai(base: str, tokenizer: str) -> None:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    for prompt in ("def add(a, b):", ["The capital of", "Once upon"], [5, 17, 42],
                   [[7, 8, 9], [10, 11]]):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                              logprobs=3)
    client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0,
                              stop=["e", "\n"])
    client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0.8,
                              seed=3, n=2)
    list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=6,
                                   temperature=0, stream=True,
                                   stream_options={"include_usage": True}))
    client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                              extra_body={"min_tokens": 3, "ignore_eos": True, "top_k": 5,
                                          "repetition_penalty": 1.2,
                                          "return_token_ids": True})
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                   temperature=0, logprobs=True, top_logprobs=2)
    list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
    list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                        temperature=0, stream=True, logprobs=True))
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                   temperature=1.0, seed=11, n=3)
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"},
                                          {"type": "text", "text": "second"}]}]
    client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                    "type": "object", "properties": {"n": {"type": "integer"}},
                    "required": ["n"]}}}):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                       temperature=0, response_format=fmt)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    weather = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("auto", "required", "none",
                   {"type": "function", "function": {"name": "get_weather"}}):
        client.chat.completions.create(model=MODEL, messages=weather, tools=[TOOL],
                                       tool_choice=choice, max_tokens=24, temperature=0)
    list(client.chat.completions.create(model=MODEL, messages=weather, tools=[TOOL],
                                        tool_choice="required", max_tokens=24, temperature=0,
                                        stream=True))
    turn = weather + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    client.chat.completions.create(model=MODEL, messages=turn, tools=[TOOL], max_tokens=8,
                                   temperature=0)
    client.responses.create(model=MODEL, input="hello", max_output_tokens=8, temperature=0)
    client.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}],
                            instructions="Be brief.", max_output_tokens=8, temperature=0)
    with client.responses.stream(model=MODEL, input="stream", max_output_tokens=6,
                                 temperature=0) as stream:
        for _ in stream:
            pass


def client_trl(base: str, tokenizer: str) -> None:
    from trl.generation.vllm_client import VLLMClient

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        return "sunny"

    client = VLLMClient(base_url=base, connection_timeout=60)
    client.generate([[5, 17, 42], [7, 8, 9, 10]], n=1, temperature=0.0, max_tokens=5)
    client.generate(["def add(a, b):", "hello"], n=2, temperature=1.0, max_tokens=6,
                    generation_kwargs={"seed": 5})
    client.generate([[5, 17, 42]], n=3, temperature=1.0, max_tokens=6,
                    structured_outputs_regex=r"[0-9]{3}")
    conversation = [{"role": "user", "content": "def add(a, b):"}]
    client.chat([conversation], n=1, temperature=0.0, max_tokens=5, logprobs=0)
    client.chat([conversation, [{"role": "user", "content": "weather?"}]], n=1,
                temperature=0.0, max_tokens=6, tools=[get_weather])
    client.get_sequence_logprobs([[5, 17, 42, 7, 8]], prompt_lengths=[3], top_logprobs=2)


def client_bench(base: str, tokenizer: str) -> None:
    from rollout.testing.vllm_bench import run_bench

    for backend, endpoint in (("openai", "/v1/completions"),
                              ("openai-chat", "/v1/chat/completions")):
        run_bench(sys.executable, base, MODEL, tokenizer, backend, endpoint, 40,
                  extra=("--random-input-len", "16", "--random-output-len", "8",
                         "--max-concurrency", "8"))


def client_agents(base: str, tokenizer: str) -> None:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    client = AsyncOpenAI(base_url=base + "/v1", api_key="none")
    from agents import OpenAIResponsesModel

    settings = ModelSettings(temperature=0.0, max_tokens=24)
    for model in (OpenAIResponsesModel(MODEL, client), OpenAIChatCompletionsModel(MODEL, client)):
        agent = Agent(name="helper", instructions="Answer briefly.", model=model,
                      tools=[get_weather], model_settings=settings)
        forced = agent.clone(model_settings=ModelSettings(temperature=0.0, max_tokens=24,
                                                          tool_choice="required"))
        for runner in (agent, forced):
            try:
                Runner.run_sync(runner, "What is the weather in Paris?", max_turns=2)
            except Exception as exc:  # noqa: BLE001 - a random model's answer ends a run
                print("agent run ended:", type(exc).__name__, exc)


def client_langchain(base: str, tokenizer: str) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Answer(BaseModel):
        n: int

    llm = ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="none", temperature=0,
                     max_tokens=8)
    llm.invoke("What is 2 + 2?")
    llm.invoke([("system", "Be brief."), ("human", "hello")])
    list(llm.stream("stream this"))
    llm.bind_tools([TOOL]).invoke("Weather in Paris?")
    llm.bind_tools([TOOL], tool_choice="get_weather").invoke("Weather in Paris?")
    for method in ("json_schema", "json_mode"):
        try:
            llm.with_structured_output(Answer, method=method).invoke("Give n.")
        except Exception as exc:  # noqa: BLE001 - a random model writes no valid answer
            print("structured output:", type(exc).__name__)
    ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="none", temperature=0,
               max_tokens=6, logprobs=True).invoke("hello")


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        _, _, name, base, tokenizer = sys.argv
        globals()[f"client_{name}"](base, tokenizer)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True, help="the server to record in front of")
    parser.add_argument("--tokenizer", required=True, help="the tiny model's folder")
    parser.add_argument("--hf-python", required=True,
                        help="the Python with the Agents SDK and LangChain")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pythons = {"vllm": sys.executable, "hf": args.hf_python}
    recorder = Recorder(args.upstream)
    recorder.serve_in_thread()
    for name in args.clients.split(","):
        before = len(recorder.records)
        done = subprocess.run([pythons[CLIENTS[name]], __file__, "client", name,
                               f"{recorder.url}/{name}", args.tokenizer],
                              capture_output=True, text=True, timeout=900)
        print(f"{name}: exit {done.returncode}, {len(recorder.records) - before} requests")
        if done.returncode:
            print(done.stdout[-2000:], done.stderr[-4000:])
            sys.exit(1)
    with open(args.out, "w") as out:
        for record in recorder.records:
            out.write(json.dumps(record, sort_keys=True) + "\n")
    print(f"{len(recorder.records)} requests written to {args.out}")


if __name__ == "__main__":
    main()
