"""LangChain's OpenAI chat model (the real `langchain-openai`) against `rollout serve` on the
HF backend, with its own defaults: no max_tokens sent, so an answer may use the room left
in the context; a tool call cut by its limit comes back cut (finish reason `length`), not
as an answer."""

import pytest

pytest.importorskip("langchain_openai", reason="langchain-openai is not installed here")

import rollout  # noqa: E402
from rollout.apps.serving.app import ServerThread  # noqa: E402
from rollout.service.service import LocalService  # noqa: E402
from rollout.testing.server_contract import TOOLS  # noqa: E402

KEY = "lc-key"
CONTEXT = 512  # room for the tools in the chat template


@pytest.fixture(scope="module")
def url(tiny_model):
    ro = rollout.load_backend("hf", model=str(tiny_model), max_model_len=CONTEXT)
    with ServerThread(LocalService(ro, "tiny"), api_key=KEY) as server:
        yield f"{server.url}/v1"


def chat_model(url, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="tiny", base_url=url, api_key=KEY, max_retries=0, timeout=120,
                      **kwargs)


def test_an_answer_without_max_tokens_may_use_the_room_left(url):
    answer = chat_model(url, temperature=0, extra_body={"ignore_eos": True}).invoke("def add")
    usage = answer.usage_metadata
    assert answer.response_metadata["finish_reason"] == "length"
    assert usage["output_tokens"] > 16
    assert usage["input_tokens"] + usage["output_tokens"] == CONTEXT


def test_a_cut_tool_call_comes_back_cut_not_as_an_answer(url):
    model = chat_model(url, max_tokens=4).bind_tools(TOOLS, tool_choice="required")
    answer = model.invoke("add 2 and 3")
    assert answer.response_metadata["finish_reason"] == "length"
    assert not answer.tool_calls
