"""Training through an agent program (rollout.apps.rl.harness): groups of episodes of agents
that call a gateway over the HF backend on the tiny model, as functions and as commands;
each episode is its session's exact tokens, which a trainer's forward pass scores as the
engine did, under the weights of each token's version."""

import asyncio
import json
import os
import sys
import threading

import openai
import pytest
import torch

import rollout
from rollout.apps.rl import GroupSampler, Harness, gateway, largest_gap
from rollout.contract.convert import structure
from rollout.kit.aio import engine_loop
from rollout.testing.forward import logprobs_under

MODEL = "policy"
TASKS = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"what is {i} + 3?"}],
          "metadata": {"answer": i + 3}} for i in range(2)]


@pytest.fixture(scope="module")
def ro(tiny_model):
    ro = rollout.load_backend("hf", model=str(tiny_model), max_model_len=2048)
    yield ro
    ro.close()


@pytest.fixture(scope="module")
def url(ro):
    with gateway(ro, MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def chat_agent(call, between=None) -> str:
    """Two turns of a chat through the openai SDK, the first answer sent back as it came;
    `between` runs between them. Prints (returns) the token ids each turn got back, to
    compare with the recording. (Free sampling: under a structured output's grammar the
    engine's logprobs are not the raw model's.)"""
    client = openai.OpenAI(base_url=call.openai_base_url, api_key=call.api_key, max_retries=0)
    messages, turns = [{"role": "user", "content": call.task}], []
    for turn in range(2):
        answer = client.chat.completions.create(
            model=call.model, messages=messages, max_tokens=12, temperature=1.0, seed=turn,
            extra_body={"return_token_ids": True})
        (choice,) = answer.choices
        turns.append(choice.model_dump()["token_ids"])
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "user", "content": "go on"}]
        if between is not None and turn == 0:
            between()
    return json.dumps(turns)


def test_groups_of_agent_episodes_are_the_engines_tokens_scored_as_a_trainer_scores(ro, url,
                                                                                   trainer):
    harness = Harness(chat_agent, url)
    score = lambda request, episodes: [float(request.metadata["answer"]) for _ in episodes]  # noqa: E731
    with GroupSampler(ro, TASKS, group_size=2, batch_size=2, sample=harness.run,
                      score=score) as groups:
        batch = groups.next_batch(timeout=600)
    assert sorted(g.request.id for g in batch) == ["t0", "t1"]
    for group in batch:
        assert group.rewards == (group.request.metadata["answer"],) * 2
        assert [e.id for e in group.results] == [f"{group.request.id}/0",
                                                f"{group.request.id}/1"]
        for episode in group.results:
            assert episode.error is None
            (branch,) = episode.branches  # one conversation, continued: one sequence
            turns = json.loads(episode.output)
            sampled = [i for i, m in zip(branch.response_ids, branch.mask) if m]
            # The tokens the agent was answered with are the sequence's sampled ones, in
            # order, and only they are masked; the rest is the template's, between turns.
            assert sampled == turns[0] + turns[1]
            assert branch.response_ids[:len(turns[0])] == turns[0]
            assert 0 < sum(branch.mask) < len(branch.mask)
            assert sum(s.end - s.start for s in branch.weight_versions) == len(sampled)
            assert largest_gap([branch], logprobs_under(trainer)) < 1e-4


def test_an_update_mid_episode_versions_each_turns_tokens(ro, url, trainer):
    """The trainer pushes new weights between an episode's two calls: the first call's
    tokens are of the old version, the second's of the new, each scored under its own."""
    first_turn_done, pushed = threading.Event(), threading.Event()

    def between():
        first_turn_done.set()
        assert pushed.wait(300)

    harness = Harness(lambda call: chat_agent(call, between), url)
    old = {k: v.clone() for k, v in trainer.state_dict().items()}
    try:
        with GroupSampler(ro, TASKS[:1], group_size=1, batch_size=1, eta=1,
                          sample=harness.run) as groups:
            start = groups.version
            assert first_turn_done.wait(300)
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            version = groups.update_weights(trainer.named_parameters())
            pushed.set()
            (group,) = groups.next_batch(timeout=600)
        (episode,) = group.results
        (branch,) = episode.branches
        turns = json.loads(episode.output)
        # Each turn's tokens are of the weights it was sampled under: the second's the new.
        assert [(s.version, s.end - s.start) for s in branch.weight_versions][-1] == (
            version, len(turns[1]))
        assert all(s.version != version for s in branch.weight_versions[:-1])
        assert group.oldest == start and group.version == version
        new = {k: v.clone() for k, v in trainer.state_dict().items()}

        def under(v, trajectories):
            trainer.load_state_dict(new if v == version else old)
            return logprobs_under(trainer)(v, trajectories)

        assert largest_gap([branch], under) < 1e-4
    finally:
        trainer.load_state_dict(old)
        ro.update_weights(trainer.named_parameters(), version=None)


COMMAND = r"""
import json, os, sys
import anthropic
client = anthropic.Anthropic(max_retries=0)  # its base URL and key from the environment
message = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=16,
                                 messages=[{"role": "user", "content": sys.argv[1]}])
print(json.dumps({"text": message.content[0].text if message.content else "",
                  "tokens": message.usage.output_tokens, "task": sys.argv[1]}))
"""


def test_a_command_agent_runs_with_its_base_urls_and_its_task(ro, url, tiny_model):
    from transformers import AutoTokenizer

    harness = Harness([sys.executable, "-c", COMMAND, "{task}"], url)
    with GroupSampler(ro, TASKS[:1], group_size=2, batch_size=1,
                      sample=harness.run) as groups:
        (group,) = groups.next_batch(timeout=600)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    for episode in group.results:
        assert episode.error is None
        said = json.loads(episode.output)
        assert said["task"] == "what is 0 + 3?"
        (branch,) = episode.branches
        assert sum(branch.mask) == said["tokens"]
        assert tokenizer.decode(branch.response_ids, skip_special_tokens=True) == said["text"]


def test_a_failed_agent_keeps_what_it_sampled_and_a_silent_one_has_no_tokens(ro, url):
    fails = [sys.executable, "-c", COMMAND + "\nsys.exit(3)", "{task}"]
    silent = [sys.executable, "-c", "print('no calls')"]
    run = lambda agent, **kw: engine_loop().run(  # noqa: E731
        Harness(agent, url, **kw).run(structure(TASKS[0], rollout.Request)), 300, "an episode")
    failed = run(fails)
    assert failed.error.startswith("exit status 3") and len(failed.branches) == 1
    assert failed.sampled_tokens > 0
    quiet = run(silent)
    assert quiet.error is None and quiet.output == "no calls\n" and quiet.branches == ()

    async def hangs(call):
        await asyncio.sleep(600)

    late = run(hangs, timeout=0.5)
    assert late.error == "timed out after 0.5 s" and late.branches == ()


def test_a_cancelled_episode_kills_its_command(url, tmp_path):
    """GroupSampler.close cancels running episodes: the agent's process group dies."""
    pidfile = tmp_path / "pid"
    harness = Harness(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 600"], url)

    async def start_and_cancel():
        task = asyncio.ensure_future(harness.run(structure(TASKS[0], rollout.Request)))
        for _ in range(6000):  # until the command is up (bounded: 60 s)
            if pidfile.exists() and pidfile.read_text().strip():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return int(pidfile.read_text())

    pid = engine_loop().run(start_and_cancel(), 120, "a cancelled episode")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_harness_refuses_what_is_not_an_agent(url):
    with pytest.raises(rollout.InvalidRequestError, match="agent"):
        Harness("llm -m policy", url)
    with pytest.raises(rollout.InvalidRequestError, match="agent"):
        Harness([], url)
