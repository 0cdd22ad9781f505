"""Multi-turn tool trajectories on the real HF backend: the agent contract, every failure
kind, limits, abort, a history-rewriting template, and 1,000 trajectories at once."""

import asyncio
import threading

import pytest

import rollout
from rollout import SamplingParams
from rollout.apps.agents import AgentConfig, AgentRunner, Environment, Reply, function_tool
from rollout.testing.agents import GREEDY, AgentContract, add, check_lined_up, run


class TestHFAgents(AgentContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model_dir: rollout.load_backend("hf", model=str(model_dir))


@pytest.fixture(scope="module")
def ro(tiny_model):
    with rollout.load_backend("hf", model=str(tiny_model), max_model_len=1024) as ro:
        yield ro


def forced(call: str) -> str:
    """A regex that makes the model write exactly this tool-call block."""
    import re

    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", f"<tool_call>{call}</tool_call>")


class Scripted(Environment):
    """Turn 0 writes the given call; later turns answer."""

    def __init__(self, call: str, tools=(add,)):
        super().__init__(tools)
        self.call = call

    def sampling(self, row, turn, messages):
        regex = forced(self.call) if turn == 0 else r"The sum is [0-9]\."
        return {"structured_outputs": {"regex": regex}}


def boom(a: int) -> int:
    """Always fails."""
    raise ValueError("no luck")


async def slow(a: int) -> int:
    """Takes too long."""
    await asyncio.sleep(30)
    return a


CASES = {  # the call the model writes -> the outcome it must get
    "ok": ('{"name": "add", "arguments": {"a": 1, "b": 2}}', "ok", "3"),
    "error": ('{"name": "boom", "arguments": {"a": 1}}', "error", "raised ValueError: no luck"),
    "timeout": ('{"name": "slow", "arguments": {"a": 1}}', "timeout", "did not finish"),
    "unknown_tool": ('{"name": "nope", "arguments": {}}', "unknown_tool", "no tool named"),
    "bad_arguments": ('{"name": "add", "arguments": {"a": }}', "bad_arguments",
                      "could not be read"),
    "invalid_arguments": ('{"name": "add", "arguments": {"a": 1}}', "invalid_arguments",
                          "'b' is a required property"),
}


@pytest.mark.parametrize("on_tool_error", ["message", "end"])
def test_each_tool_failure_has_its_outcome_and_spares_the_others(ro, on_tool_error):
    # A short tool timeout only where it is the subject: a loaded machine may take a second
    # to run the others.
    runners = {kind: AgentRunner(ro, Scripted(call, (add, boom, slow)), AgentConfig(
        sampling=GREEDY, tool_timeout=1.0 if kind == "timeout" else 60.0,
        on_tool_error=on_tool_error))
        for kind, (call, _, _) in CASES.items()}

    async def main():
        return await asyncio.gather(*(r.run({"prompt": "go"}) for r in runners.values()))

    for kind, t in zip(CASES, asyncio.run(main())):
        _, outcome, message = CASES[kind]
        record = t.turns[0].tool_calls[0]
        assert record.outcome == outcome and message in record.detail, (kind, record)
        check_lined_up(t)
        if outcome == "ok" or on_tool_error == "message":
            assert t.end_reason == "done", (kind, t.end_detail)
            tool_message = t.messages[-2]
            assert tool_message.role == "tool" and message in tool_message.text
        else:
            assert t.end_reason == "tool_error" and outcome in t.end_detail
            assert t.num_turns == 1


def test_a_long_tool_result_is_truncated_and_marked(ro):
    def long(a: int) -> str:
        """A long answer."""
        return "x" * 500

    env = Scripted('{"name": "long", "arguments": {"a": 1}}', (function_tool(long),))
    [t] = asyncio.run(AgentRunner(ro, env, AgentConfig(sampling=GREEDY, max_tool_chars=50))
                      .run_many([{"prompt": "go"}]))
    record = t.turns[0].tool_calls[0]
    assert record.truncated and "[truncated: 450 more characters]" in t.messages[-2].text


class Chatty(Environment):
    """Answers every turn with a user message; `raise_at` makes it fail on that turn."""

    def __init__(self, raise_at: int | None = None):
        super().__init__()
        self.raise_at = raise_at

    def respond(self, row, messages):
        turns = sum(m.role == "assistant" for m in messages)
        if turns == self.raise_at:
            raise RuntimeError("the environment broke")
        return Reply([{"role": "user", "content": f"and then {turns}?"}],
                     done=turns >= row.get("turns", 3))


SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_limits_end_trajectories_with_their_reasons(ro):
    [turns] = run(ro, Chatty(), [{"prompt": "hi", "turns": 99}], sampling=SHORT, max_turns=3)
    assert (turns.end_reason, turns.num_turns) == ("max_turns", 3)
    [budget] = run(ro, Chatty(), [{"prompt": "hi", "turns": 99}], sampling=SHORT,
                   max_tokens=10)
    assert budget.end_reason == "max_tokens" and len(budget.response_ids) <= 10
    [context] = run(ro, Chatty(), [{"prompt": "hi", "turns": 99}], sampling=SHORT,
                    max_model_len=40)
    assert context.end_reason == "context_length"
    assert len(context.prompt_ids) + len(context.response_ids) <= 40
    [first] = run(ro, Chatty(), [{"prompt": "hi " * 60}], sampling=SHORT, max_model_len=40)
    assert first.end_reason == "context_length" and first.response_ids == []
    for t in (turns, budget, context):
        check_lined_up(t)


def test_a_failing_environment_ends_only_its_trajectory(ro):
    class Mixed(Chatty):
        def respond(self, row, messages):
            if row.get("broken"):
                raise RuntimeError("the environment broke")
            return super().respond(row, messages)

    done = run(ro, Mixed(), [{"prompt": "a"}, {"prompt": "b", "broken": True}, {"prompt": "c"}],
               sampling=SHORT)
    assert [t.end_reason for t in done] == ["done", "error", "done"]
    assert "the environment broke" in done[1].end_detail


def test_a_timeout_and_an_abort_stop_the_running_turn_and_keep_what_it_made(ro):
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    class FirstToken:
        """The backend, streamed: `made` is set when a turn's first token has come."""

        encoder = ro.encoder
        abort = ro.abort

        def __init__(self):
            self.made = asyncio.Event()

        async def agenerate(self, request):
            stream = ro.stream(request)
            async for chunk in stream:
                if chunk.token_ids:
                    self.made.set()
            return stream.completion

    async def main():
        runner = AgentRunner(ro, Chatty(), AgentConfig(sampling=long, timeout=0.5))
        timed = await runner.run({"prompt": "a"})
        sampler = FirstToken()
        aborter = AgentRunner(sampler, Chatty(), AgentConfig(sampling=long))
        task = asyncio.ensure_future(aborter.run({"prompt": "b"}, id="victim"))
        bystander = AgentRunner(ro, Chatty(), AgentConfig(sampling=SHORT))
        other = asyncio.ensure_future(bystander.run({"prompt": "c"}, id="other"))
        await asyncio.wait_for(sampler.made.wait(), 120)
        assert aborter.abort("victim") and not aborter.abort("nobody")
        return timed, await task, await other

    timed, aborted, other = asyncio.run(main())
    assert timed.end_reason == "timeout"
    assert aborted.end_reason == "aborted"
    # The abort comes after the first token; the timeout's 0.5 s may end before it (a loaded
    # machine), even before the turn was sent.
    assert 0 < sum(aborted.mask)
    for t in (timed, aborted):
        assert sum(t.mask) < 900 and all(turn.finish_reason == "abort" for turn in t.turns[-1:])
        check_lined_up(t)
        check_spans(t)  # the cut turn's tokens too
    assert other.end_reason == "done"
    health = ro.health()
    assert health.get("running", 0) == 0, health  # the cut turns stopped in the engine


def check_spans(t) -> None:
    """The weight spans cover exactly the sampled tokens, in order."""
    covered = [i for span in t.weight_versions for i in range(span.start, span.end)]
    assert covered == [i for i, m in enumerate(t.mask) if m]
    assert all(span.start < span.end for span in t.weight_versions)


def test_each_turn_s_tokens_carry_the_version_of_the_weights_that_sampled_them(
        ro, tiny_model):
    from rollout.testing.model_folders import load_weights

    weights = load_weights(tiny_model)

    class Updating(Chatty):
        """Loads the same weights under the next version after every turn."""

        version = 1

        async def respond(self, row, messages):
            self.version += 1
            await asyncio.to_thread(ro.update_weights, weights.items(), version=self.version)
            return super().respond(row, messages)

    ro.update_weights(weights.items(), version=1)
    [t] = run(ro, Updating(), [{"prompt": "hi", "turns": 3}], sampling=SHORT)
    assert t.end_reason == "done" and t.num_turns == 3
    check_spans(t)
    # One span per turn (appended tokens lie between them), turn k sampled by version k + 1.
    assert [(s.version, s.end - s.start) for s in t.weight_versions] == [(1, 4), (2, 4), (3, 4)]


def test_a_template_that_drops_earlier_reasoning_is_named_and_tokens_stay_exact(ro, tiny_model):
    from transformers import AutoTokenizer

    from rollout.kit.tiny_model import CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    # Like Qwen3's: earlier assistant turns lose their <think>...</think> part.
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{% else %}{{ m['content'] }}{% endif %}",
        "{% elif m['role'] == 'assistant' and not loop.last %}"
        "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}")

    class Thinking(Chatty):
        def sampling(self, row, turn, messages):
            return {"structured_outputs": {"regex": r"<think>[a-z]{1,6}</think>ok [0-9]\."}}

    runner = AgentRunner(ro, Thinking(), AgentConfig(sampling=GREEDY), tokenizer=tokenizer)
    [t] = asyncio.run(runner.run_many([{"prompt": "hi", "turns": 3}]))
    assert t.end_reason == "done" and t.num_turns == 3  # the prefix check held every turn
    # From turn 1 on, re-rendering would have dropped turn 0's reasoning.
    assert [turn.render for turn in t.turns] == ["same", "rewritten", "rewritten"]
    assert t.render == "rewritten" and t.turns[1].render_differs_at is not None
    assert "<think>" in tokenizer.decode(t.response_ids)  # the sampled reasoning is kept


def test_1000_concurrent_trajectories_of_3_turns_with_bounded_threads(ro):
    threads = []
    env = Chatty()

    class Counting(Chatty):
        def respond(self, row, messages):
            threads.append(threading.active_count())
            return env.respond(row, messages)

    rows = [{"prompt": f"the ka {i}", "turns": 3} for i in range(1000)]
    done = run(ro, Counting(), rows, sampling=SHORT)
    assert [t.end_reason for t in done] == ["done"] * 1000
    assert {(t.num_turns, sum(t.mask)) for t in done} == {(3, 12)}
    assert max(threads) < 50


def test_a_config_value_out_of_range_names_its_field():
    from rollout import InvalidRequestError

    for field, value in (("max_turns", 0), ("on_tool_error", "ignore"), ("timeout", -1)):
        with pytest.raises(InvalidRequestError) as error:
            AgentConfig(**{field: value})
        assert error.value.field == field
    with pytest.raises(InvalidRequestError) as error:
        AgentConfig(sampling=SamplingParams(n=2))
    assert error.value.field == "sampling.n"


def test_function_schemas_come_from_signature_and_docstring():
    tool = function_tool(add)
    assert tool.name == "add" and tool.description == "Add two digits."
    assert tool.parameters["required"] == ["a", "b"]
    assert tool.parameters["properties"]["a"] == {"type": "integer",
                                                  "description": "the first digit"}

    def opt(name: str, times: int = 1, tags: list[str] | None = None) -> str:
        """Say it."""
        return name * times

    schema = function_tool(opt).parameters
    assert schema["required"] == ["name"]
    assert schema["properties"]["tags"] == {"anyOf": [{"type": "array",
                                                       "items": {"type": "string"}},
                                                      {"type": "null"}]}



def test_trajectories_over_a_replica_pool_stay_on_one_replica_each(tiny_model):
    from rollout.testing.agents import ROWS, ToolTask

    with rollout.ServedRollout.start("hf", str(tiny_model), replicas=2) as sampler:
        served = []  # (session, replica) of every turn sent
        for replica in sampler.service.replicas:
            def record(request, send=replica.service.generate, replica=replica):
                served.append((request.session_id, replica))
                return send(request)

            replica.service.generate = record
        runner = AgentRunner(sampler, ToolTask(), AgentConfig(sampling=GREEDY))
        done = asyncio.run(runner.run_many(ROWS * 2))
    assert [t.end_reason for t in done] == ["done"] * len(done)
    homes = {}
    for session, replica in served:
        homes.setdefault(session, set()).add(replica)
    assert len(homes) == len(done) and all(len(r) == 1 for r in homes.values())
    assert len({r for rs in homes.values() for r in rs}) == 2  # both replicas were used
    with rollout.load_backend("hf", model=str(tiny_model)) as ro:
        local = run(ro, ToolTask(), ROWS * 2, sampling=GREEDY)
    assert [t.response_ids for t in done] == [t.response_ids for t in local]


def test_a_served_sampler_has_its_models_encoder_when_told_the_folder(ro, tiny_model):
    """No caller asks which face it holds: a sampler over a server, given the model's
    folder, encodes as the backend does; one not given it says what it lacks."""
    from rollout import InvalidRequestError, Request, ServedRollout
    from rollout.contract import convert
    from rollout.apps.serving.app import ServerThread
    from rollout.service.service import LocalService
    from rollout.testing.agents import ROWS, ToolTask

    chat = convert.structure({"messages": [{"role": "user", "content": "add 2 and 3"}],
                              "tools": [convert.unstructure(t.spec) for t in ToolTask().tools]},
                             Request)
    served = rollout.load_backend("hf", model=str(tiny_model))
    with ServerThread(LocalService(served, "tiny")) as server:  # (closes it at the end)
        with ServedRollout.connect(server.url) as blind:
            assert blind.encoder is None
            with pytest.raises(InvalidRequestError) as refused:
                AgentRunner(blind, ToolTask())
            assert refused.value.field == "tokenizer"
        with ServedRollout.connect(server.url, model=str(tiny_model)) as told:
            assert told.encoder.encode(chat) == ro.encoder.encode(chat)
            assert told.encoder.vocab_size == ro.encoder.vocab_size
            [t] = asyncio.run(AgentRunner(told, ToolTask(), AgentConfig(sampling=GREEDY))
                              .run_many(ROWS[:1]))
            assert t.end_reason == "done", t.end_detail


def test_an_engine_that_saw_another_prompt_ends_the_trajectory_naming_the_turn(ro):
    """The real engines echo the prompt they got; a service that does not (stood in for
    here by one that drops a token from the echo on turn 1) is caught at that turn."""
    import attrs

    class Lossy:
        encoder = ro.encoder
        abort = ro.abort

        async def agenerate(self, request):
            completion = await ro.agenerate(request)
            if request.id.endswith(":1"):
                result = completion.results[0]
                completion = attrs.evolve(completion, results=(attrs.evolve(
                    result, prompt_token_ids=result.prompt_token_ids[1:],
                    prompt_tokens=result.prompt_tokens - 1),))
            return completion

    [t] = asyncio.run(AgentRunner(Lossy(), Chatty(), AgentConfig(sampling=SHORT))
                      .run_many([{"prompt": "hi"}]))
    assert t.end_reason == "error" and t.num_turns == 2
    assert "prefix_mismatch" in t.end_detail and "turn 1" in t.end_detail
