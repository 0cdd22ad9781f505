"""The HTTP server in front of the real HF backend on the tiny model: the shared server
contract (OpenAI routes through the official `openai` client, the native route, keys, load),
plus what does not depend on the backend."""

import base64
import io
import json
import signal
import subprocess
import sys
import urllib.request

import openai
import pytest

import rollout
from rollout.contract.errors import EngineDeadError, NoReplicaError, RolloutTimeoutError
from rollout.apps.serving.app import ServerThread
from rollout.kit.tiny_model import build_tiny_moe
from rollout.service.service import LocalService
from rollout.testing.model_folders import load_weights
from rollout.testing.strict_tools import MODEL as STRICT_MODEL
from rollout.testing.strict_tools import StrictToolsContract
from rollout.testing.strict_tools import tool as strict_tool
from rollout.testing.server_contract import (CALL_REGEX, CHAT, KEY, MODEL, ServerContract,
                                             completions, http)


class TestHFServer(ServerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model, max_model_len: rollout.load_backend(
            "hf", model=model, max_model_len=max_model_len)


# --- tools: what TRL sends, strict schemas, finish reasons ----------------------------------


class TestHFStrictTools(StrictToolsContract):
    """Hypothesis-made strict tools (rollout.testing.strict_tools), and what the tools section of
    docs/serving.md promises about them."""

    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model: rollout.load_backend("hf", model=model, max_model_len=2048)

    def test_a_function_tool_with_a_return_schema_reaches_the_template(self, served,
                                                                       tiny_model):
        """TRL's chat(tools=[a_python_function]) sends get_json_schema's `return` key: taken,
        and rendered by the chat template with the tool (vLLM's server takes and drops it)."""
        from transformers import AutoTokenizer
        from transformers.utils import get_json_schema

        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first
                b: the second

            Returns:
                their sum
            """
            return a + b

        spec = get_json_schema(add)
        assert "return" in spec["function"]
        client, _, _ = served
        answer = client.chat.completions.create(model=STRICT_MODEL, messages=CHAT, tools=[spec],
                                                max_tokens=2, temperature=0)
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))

        def length(tools):
            return len(tokenizer.apply_chat_template(CHAT, tools=tools, tokenize=True,
                                                     add_generation_prompt=True,
                                                     return_dict=False))

        bare = {**spec, "function": {k: v for k, v in spec["function"].items()
                                     if k != "return"}}
        assert answer.usage.prompt_tokens == length([spec]) > length([bare])
        with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.returns?\b"):
            client.chat.completions.create(
                model=STRICT_MODEL, messages=CHAT, max_tokens=2,
                tools=[{**spec, "function": {**spec["function"], "return": "an int"}}])
        with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.retrun: "
                                                         "unknown field"):
            client.chat.completions.create(
                model=STRICT_MODEL, messages=CHAT, max_tokens=2,
                tools=[{**spec, "function": {**spec["function"], "retrun": {}}}])

    @pytest.mark.parametrize(("node", "keyword"), [
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "format": "date"}, "format"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "pattern"),
        ({"type": "string", "pattern": '^a"b$'}, "pattern"),
        ({"type": "string", "enum": ["long", "no"], "maxLength": 2}, "enum"),
        ({"type": "object", "required": ["x"]}, "required"),
        ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "if"),
    ])
    @pytest.mark.parametrize("where", ["auto", "required", "response_format"])
    def test_what_the_grammar_cannot_hold_a_value_to_is_refused_naming_it(
            self, served, node, keyword, where):
        client, _, _ = served
        schema = {"type": "object", "properties": {"v": node}, "required": ["v"]}
        if where == "response_format":
            call = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "v", "schema": schema, "strict": True}}}
            param = "response_format.json_schema.schema.properties.v." + keyword
        else:
            call = {"tools": [strict_tool(schema)], "tool_choice": where}
            param = "tools[0].function.parameters.properties.v." + keyword
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=STRICT_MODEL, messages=CHAT, max_tokens=2,
                                           **call)
        assert caught.value.body["param"] == param, caught.value.body
        # Not strict, a tool's schema is the template's only: taken as it is.
        if where != "response_format":
            loose = {"tools": [{**strict_tool(schema), "function": {
                **strict_tool(schema)["function"], "strict": False}}], "tool_choice": "auto"}
            client.chat.completions.create(model=STRICT_MODEL, messages=CHAT, max_tokens=2,
                                           **loose)

    @pytest.mark.parametrize("stream", [False, True])
    def test_calls_whose_later_text_was_cut_finish_as_tool_calls_as_on_vllm(self, served,
                                                                           stream):
        """A call, then a second block cut by max_tokens: the call comes back, the cut
        block stays text with its reason, and the finish reason is `tool_calls` (vLLM's
        server: any call read in "auto" ends so)."""
        client, _, _ = served
        regex = CALL_REGEX + r"\n<tool_call>\{" + "x" * 400
        tools = [{"type": "function", "function": {
            "name": "add", "parameters": {"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
        kwargs = dict(messages=CHAT, tools=tools, max_tokens=120, temperature=0,
                      extra_body={"structured_outputs": {"regex": regex}})
        if stream:
            chunks = list(client.chat.completions.create(model=STRICT_MODEL, stream=True,
                                                         **kwargs))
            choices = [c for chunk in chunks for c in chunk.choices]
            calls = [t for c in choices for t in c.delta.tool_calls or ()]
            finish = [c.finish_reason for c in choices if c.finish_reason]
            content = "".join(c.delta.content or "" for c in choices)
        else:
            (choice,) = client.chat.completions.create(model=STRICT_MODEL, **kwargs).choices
            calls, finish, content = choice.message.tool_calls, [choice.finish_reason], \
                choice.message.content
            (error,) = choice.message.model_extra["tool_call_errors"]
            assert "never closed" in error["reason"] and error["text"] in content
        (call,) = calls
        assert call.function.name == "add" and finish == ["tool_calls"]
        assert content.startswith("<tool_call>{") and "add" not in content  # only the cut one
        response = client.responses.create(model=STRICT_MODEL, input="hi", tools=[{
            "type": "function", **tools[0]["function"]}], max_output_tokens=120, temperature=0,
            extra_body={"structured_outputs": {"regex": regex}})
        assert response.status == "completed"
        assert [item.type for item in response.output] == ["message", "function_call"]


# --- weight versions -----------------------------------------------------------------------


def _stream_lines(url: str, body: dict) -> list[dict]:
    """The newline-delimited JSON of a native stream."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return [json.loads(line) for line in response.read().splitlines()]


def test_served_results_say_which_weights_made_their_tokens(tiny_model):
    """After update_weights(version=7) each choice's `weight_versions` covers its tokens with
    version 7, and each streamed piece with tokens says 7; the native routes carry the same
    fields, and a sample continued after the next update is split between 7 and 8."""
    weights = load_weights(tiny_model)
    with rollout.load_backend("hf", model=str(tiny_model), max_model_len=256) as ro, \
            ServerThread(LocalService(ro, MODEL), api_key=KEY) as server:
        ro.update_weights(weights.items(), version=7)  # the same weights, a new label
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        fixed = {"ignore_eos": True, "return_token_ids": True}
        completions = client.completions.create(model=MODEL, prompt=["def add", "the"], n=2,
                                                max_tokens=5, seed=1, extra_body=fixed)
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                              temperature=0, extra_body=fixed)
        for choice in [*completions.choices, *chat.choices]:
            assert choice.model_extra["weight_versions"] == [
                {"version": 7, "start": 0, "end": len(choice.model_extra["token_ids"])}]
        plain = client.completions.create(model=MODEL, prompt="the", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert plain.choices[0].model_extra["weight_versions"] == [
            {"version": 7, "start": 0, "end": 3}]  # without return_token_ids too

        for stream in (
                client.completions.create(model=MODEL, prompt="the", max_tokens=6, stream=True,
                                          extra_body=fixed),
                client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                               stream=True, extra_body=fixed)):
            pieces = [c.model_extra for chunk in stream for c in chunk.choices]
            assert sum(len(p.get("token_ids") or ()) for p in pieces) == 6
            for piece in pieces:  # a version on a piece with tokens, none on one without
                assert piece.get("weight_version", "none") == (
                    7 if piece.get("token_ids") else "none"), piece

        url = server.url
        ask = {"prompt": "def add", "sampling": {"max_tokens": 3, "temperature": 0,
                                                 "ignore_eos": True}}
        status, body = http(f"{url}/rollout/generate", {"requests": [ask]})
        (first,) = body["completions"][0]["results"]
        assert status == 200 and first["weight_version"] == 7
        assert first["weight_versions"] == [{"version": 7, "start": 0, "end": 3}]

        ro.update_weights(weights.items(), version=8)
        # The 3 tokens made under 7, continued as if an update had stopped them.
        go_on = {**ask, "sampling": {**ask["sampling"], "max_tokens": 5},
                 "continue_from": {**first, "finish_reason": "abort"}}
        mixed = [{"version": 7, "start": 0, "end": 3}, {"version": 8, "start": 3, "end": 5}]
        status, body = http(f"{url}/rollout/generate", {"requests": [go_on]})
        (result,) = body["completions"][0]["results"]
        assert status == 200 and result["weight_versions"] == mixed
        assert result["weight_version"] == 8
        lines = _stream_lines(f"{url}/rollout/stream", {"request": go_on})
        chunks = [line["chunk"] for line in lines[:-1]]
        # The 2 new tokens, all from version 8 (one chunk or two: a busy machine may hand
        # over both at once).
        streamed = [(c["weight_version"], len(c["token_ids"])) for c in chunks if c["token_ids"]]
        assert {v for v, _ in streamed} == {8} and sum(n for _, n in streamed) == 2, streamed
        assert lines[-1]["completion"]["results"][0]["weight_versions"] == mixed


def test_routed_experts_through_http_are_the_engines(tmp_path):
    """A mixture-of-experts model's routing comes back per choice as vLLM's server writes
    it (`routed_experts`, base64 `.npy`, [tokens run, layers, top_k]), equal to what the
    engine gives in process; a stream carries it on the chunk that ends the sample."""
    np = pytest.importorskip("numpy")

    def experts(encoded: str):
        return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)

    with rollout.load_backend("hf", model=str(build_tiny_moe(tmp_path))) as ro, \
            ServerThread(LocalService(ro, MODEL), api_key=KEY) as server:
        sampling = {"max_tokens": 5, "ignore_eos": True, "temperature": 0,
                    "return_routed_experts": True}
        (choice,) = completions(server.url, {"model": MODEL, "prompt": "ka lo mi",
                                             "return_token_ids": True, **sampling})
        expected = ro.generate([{"prompt": "ka lo mi", "sampling": sampling}])[0].unwrap()[0]
        assert choice["token_ids"] == list(expected.token_ids)
        got = experts(choice["routed_experts"])
        assert got.dtype == np.int32
        assert got.shape == (len(choice["prompt_token_ids"]) + 5 - 1, 2, 2)
        assert got.tolist() == [[list(layer) for layer in token]
                                for token in expected.routed_experts]

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="ka lo mi", stream=True,
                                           max_tokens=5, temperature=0, extra_body={
                                               "ignore_eos": True,
                                               "return_routed_experts": True})
        pieces = [c.model_extra for chunk in stream for c in chunk.choices]
        carrying = [i for i, p in enumerate(pieces) if "routed_experts" in p]
        assert carrying == [len(pieces) - 1]  # the last
        assert experts(pieces[-1]["routed_experts"]).tolist() == got.tolist()


# --- a service that cannot serve ----------------------------------------------------------


class FailingService:
    """Stands for a pool whose replicas are gone (only the error path is under test)."""

    name = "failing"

    def __init__(self, error):
        self.error = error

    async def generate(self, request):
        raise self.error

    def stream(self, request):
        return FailingStream(self.error)

    async def health(self):
        raise self.error

    def adapters(self):
        return {}

    async def close(self):
        pass


class FailingStream:
    """Fails at once, or after `made` chunks."""

    completion = None

    def __init__(self, error, made: int = 0):
        self.error, self.made = error, made

    def __aiter__(self):
        return self

    async def __anext__(self):
        from rollout import Chunk

        if self.made:
            self.made -= 1
            return Chunk(0, (5,), text="x")
        raise self.error

    async def aclose(self):
        pass


@pytest.mark.parametrize(("error", "status"), [
    (NoReplicaError("no healthy replica"), 503),
    (EngineDeadError("engine exited"), 503),
    (RolloutTimeoutError("too slow"), 504),
])
def test_a_service_that_cannot_serve_is_a_503_or_504(error, status):
    with ServerThread(FailingService(error)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="failing", messages=CHAT, max_tokens=2)
        assert caught.value.status_code == status
        assert caught.value.body["code"] == error.kind
        with pytest.raises(openai.APIStatusError) as caught:
            list(client.completions.create(model="failing", prompt="x", stream=True))
        assert caught.value.status_code == status  # nothing sent yet: a plain error
        assert http(f"{server.url}/health")[0] == 503
        assert http(f"{server.url}/rollout/generate", {"requests": [{"prompt": "x"}]})[0] == status
        assert http(f"{server.url}/rollout/stream", {"request": {"prompt": "x"}})[0] == status


class MidStreamFailure(FailingService):
    def stream(self, request):
        return FailingStream(self.error, made=1)


def test_a_stream_that_fails_midway_ends_with_the_error_and_done():
    """Tokens sent, then the engine fails: the stream's last events are the OpenAI error
    and `[DONE]`, as vLLM's server ends it, and the openai client raises the error."""
    from rollout.contract.errors import GenerationError

    with ServerThread(MidStreamFailure(GenerationError("the engine failed"))) as server:
        request = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps({
            "model": "failing", "prompt": "x", "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            events = [line.removeprefix(b"data: ").decode()
                      for line in response.read().splitlines() if line]
        assert json.loads(events[0])["choices"][0]["text"] == "x"
        assert json.loads(events[-2])["error"]["code"] == "generation"
        assert events[-1] == "[DONE]"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIError, match="the engine failed"):
            list(client.completions.create(model="failing", prompt="x", stream=True))


# --- running the server -------------------------------------------------------------------

SERVE_SCRIPT = """
import asyncio, sys, rollout
from rollout.apps.serving.app import serve
from rollout.service.service import LocalService

class Service(LocalService):
    async def close(self):
        await super().close()
        print("closed", flush=True)

ro = rollout.load_backend("hf", model=sys.argv[1])
asyncio.run(serve(Service(ro, "tiny"), port=0, on_started=lambda url: print(url, flush=True)))
print("returned", flush=True)
"""


def test_serve_stops_on_sigterm_and_closes_the_service(tiny_model):
    process = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(tiny_model)],
                               stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        assert http(f"{url}/health")[0] == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert process.stdout.read().split() == ["closed", "returned"]
    finally:
        process.kill()
        process.wait()


def test_serve_on_a_taken_port_fails_at_once_before_loading_the_model(tmp_path):
    """The port is bound first: a taken one is said at once, and replicas started after
    it cannot be handed the same port as a free one."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "rollout", "serve", "--backend", "hf",
                               "--model", str(tmp_path / "no-model-here"), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_serve_without_aiohttp_says_how_to_install_it(tiny_model):
    blocked = ("import sys; sys.modules['aiohttp'] = None; sys.argv[0] = 'rollout'; "
               "from rollout.apps.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", blocked, "serve", "--backend", "hf",
                           "--model", str(tiny_model)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "needs aiohttp" in done.stderr and "pip install" in done.stderr
