"""GRPO through an agent program run unchanged: the policy learns from what a third-party
agent sampled, token for token, as the server's sessions recorded it.

Each prompt is run `--group-size` times by the agent (rollout.apps.rl.Harness), each run in
a session of its own: the agent's OpenAI and Anthropic base URLs point at `/sessions/{id}`
of a gateway over the sampler (or of `--server`), the server records each call's prompt
and sampled ids, logprobs and weight versions, and the episode is that record. The reward
reads what the agent printed. The loss is examples/grpo.py's, over the sampled tokens of
every branch of every episode (mask 1; the template's tokens between calls are context
only), with grpo.py's two checks: every token's weight version within `--async` of the
trainer's, and its logprob equal to the trainer's forward pass under that version's weights.

The default agent is Simon Willison's `llm` CLI (`pip install llm`), unmodified: it reads
OPENAI_BASE_URL and OPENAI_API_KEY, and a scratch LLM_USER_PATH names the served model
for it (`rollout`). Any program that takes a base URL works the same way (`{task}` in its
arguments is the prompt's text):

    python examples/grpo_agent.py --task sums --steps 40 --log agent.jsonl
    python examples/grpo_agent.py --agent 'my-agent --question {task}'
    python examples/grpo_agent.py --server http://127.0.0.1:8000 --model DIR

Held-out accuracy (sums) is scored greedily by the sampler on the same chat the agent
sends (one user message), not through the agent.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import grpo  # examples/grpo.py: the tasks, the trainer's forward pass, the kept versions

from rollout.apps.rl import GroupSampler, Harness, gateway, largest_gap
from rollout.service.served import open_sampler

LLM = "llm -m rollout -n -o temperature 1 -o max_tokens {max_tokens} {{task}}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agent", help="the agent's command line ({task}: the prompt's "
                        f"text); default: {LLM!r}")
    parser.add_argument("--agent-timeout", type=float, default=300.0,
                        help="seconds an agent run may take before it is killed")
    parser.add_argument("--task", default="letter", choices=tuple(grpo.TASKS))
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--backend-option", action="append", default=[], metavar="K=V")
    parser.add_argument("--model", help="model folder or known name; default: the tiny model "
                        "(letter), smollm2 (sums)")
    parser.add_argument("--server", help="a running `rollout serve` at this URL, instead of "
                        "the backend in this process behind a gateway")
    parser.add_argument("--api-key")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--async", dest="eta", type=int, default=0, metavar="ETA")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="agent runs per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="the default agent's")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="a", help="letter: the reward counts tokens "
                        "containing it")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--held-out", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--log", help="one JSON line per step and evaluation")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the reward rose")
    return parser.parse_args(argv)


def agent_command(args: argparse.Namespace, scratch: str, model: str
                  ) -> tuple[list[str], dict[str, str]]:
    """The agent's argv and the variables it needs besides the base URLs."""
    command = shlex.split(args.agent or LLM.format(max_tokens=args.max_tokens))
    if Path(command[0]).name != "llm":
        return command, {}
    # llm finds a model of an OpenAI-compatible server by its own name in this file; its
    # base URL comes from OPENAI_BASE_URL, which the harness sets per run.
    Path(scratch, "extra-openai-models.yaml").write_text(
        f"- model_id: rollout\n  model_name: {model}\n")
    env = {"LLM_USER_PATH": scratch, "LLM_LOAD_PLUGINS": ""}  # (no plugins: a faster start)
    # Every run opens llm's log database, and runs that create it at once race: it is
    # made here first (`logs status` migrates an existing file).
    Path(scratch, "logs.db").touch()
    subprocess.run([command[0], "logs", "status"], env={**os.environ, **env}, check=True,
                   capture_output=True, timeout=120)
    return command, env


def said(episode) -> SimpleNamespace:
    """An episode as grpo.py's tasks score a sample: what the agent printed, and the ids
    it sampled."""
    return SimpleNamespace(text=episode.output, token_ids=[i for c in episode.calls for i in c])


class Branch:
    """A recorded branch as grpo.py's forward pass and checks read a result."""

    def __init__(self, trajectory):
        self.prompt_token_ids, self.token_ids = trajectory.prompt_ids, trajectory.response_ids
        self.mask, self.logprobs = trajectory.mask, trajectory.logprobs
        self.weight_versions = trajectory.weight_versions


def main(argv: list[str] | None = None) -> int:
    return grpo.with_model(parse_args(argv), train)


def train(args: argparse.Namespace, model_dir: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = open_sampler(args.backend, model_dir, grpo.backend_options(args.backend_option),
                           server=args.server, api_key=args.api_key)
    task = grpo.TASKS[args.task](args, tokenizer)
    program = Path(shlex.split(args.agent or LLM)[0]).name

    def record(entry: dict) -> None:
        if log:
            log.write(json.dumps({"backend": args.backend, "task": args.task,
                                  "agent": program, **entry}) + "\n")
            log.flush()

    def evaluate(step: int) -> float | None:
        if not task.held_out:
            return None
        score = grpo.accuracy(sampler, task, args.max_tokens, None)
        print(f"after {step:3d} steps  held-out greedy accuracy {score:.3f}", flush=True)
        record({"step": step, "accuracy": score})
        return score

    def score(request, episodes) -> list[float]:
        return [task.score(said(e), request.metadata["answer"]) for e in episodes]

    def prompts():
        for step in itertools.count(1):
            for i, (fields, answer) in enumerate(task.batch(step)):
                yield {**fields, "id": f"s{step}-{i}", "metadata": {"answer": answer}}

    kept = grpo.Versions(model, args.eta)
    rewards, worst, failed, groups = [], 0.0, 0, None
    with contextlib.ExitStack() as stack:
        stack.callback(sampler.close)
        log = stack.enter_context(open(args.log, "w")) if args.log else None
        url = args.server or stack.enter_context(gateway(sampler))
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="agent-"))
        command, env = agent_command(args, scratch, _served_name(url, args.api_key))
        harness = Harness(command, url, api_key=args.api_key, env=env,
                          timeout=args.agent_timeout)
        before = evaluate(0)
        groups = stack.enter_context(GroupSampler(
            sampler, prompts(), group_size=args.group_size, batch_size=args.prompts,
            eta=args.eta, score=score, sample=harness.run))
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            batch = groups.next_batch(timeout=1800)
            sampled = time.perf_counter()
            version = groups.version
            episodes = [e for g in batch for e in g.results]
            errors = [e.error for e in episodes if e.error is not None]
            if errors and not failed:
                print(f"step {step}: an agent run failed: {errors[0][-1000:]}", flush=True)
            failed += len(errors)
            owners = [(k, Branch(b)) for k, e in enumerate(episodes) for b in e.branches]
            branches = [b for _, b in owners]
            old = {v for v in kept.of(branches) if not version - args.eta <= v <= version}
            if old:
                print(f"step {step}: tokens of weight versions {old}, the trainer at {version}")
                return 1
            logprobs = grpo.sequence_logprobs(model, branches) if branches else []
            gap = largest_gap(branches, kept.logprobs_under(version, branches, logprobs))
            worst = max(worst, gap)
            if gap > args.tolerance:
                print(f"step {step}: logprobs differ by {gap:.2e} > {args.tolerance:g}")
                return 1
            reward = torch.tensor([g.rewards for g in batch])
            advantage = ((reward - reward.mean(1, keepdim=True))
                         / (reward.std(1, keepdim=True) + 1e-4)).flatten()
            # Each episode's advantage on the tokens it sampled (mask 1) in every branch,
            # weighted by their truncated importance ratios.
            terms = []
            for (k, branch), lp in zip(owners, logprobs):
                mask = torch.tensor(branch.mask, dtype=lp.dtype)
                ratio = torch.exp(lp.detach() - torch.tensor(branch.logprobs)).clamp(
                    max=args.tis_cap)
                terms.append(advantage[k] * (mask * ratio * lp).sum())
            if terms:
                loss = -torch.stack(terms).sum() / len(episodes)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            trained = time.perf_counter()
            kept.add(groups.update_weights(model.named_parameters()))
            pushed = time.perf_counter()
            rewards.append(reward.mean().item())
            seconds = pushed - started
            tokens = sum(sum(b.mask) for b in branches)
            record({"step": step, "reward": rewards[-1], "max_logprob_diff": gap,
                    "episodes": len(episodes), "branches": len(branches),
                    "sampled_tokens": tokens, "failed_runs": failed,
                    "step_s": round(seconds, 3), "sample_s": round(sampled - started, 3),
                    "train_s": round(trained - sampled, 3), "push_s": round(pushed - trained, 3)})
            print(f"step {step:3d}  reward {rewards[-1]:.3f}  max|logprob diff| {gap:.1e}  "
                  f"{len(episodes)} runs, {len(branches)} branches, {tokens} sampled tokens  "
                  f"{seconds:.2f} s", flush=True)
            if args.eval_every and step % args.eval_every == 0 and step != args.steps:
                evaluate(step)
        groups.close()
        after = evaluate(args.steps)
    window = max(1, min(5, len(rewards) // 3))
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    print(json.dumps({"backend": args.backend, "task": args.task, "steps": args.steps,
                      "agent": args.agent or LLM, "first_reward": round(first, 4),
                      "last_reward": round(last, 4), "accuracy_before": before,
                      "accuracy_after": after, "max_logprob_diff": worst,
                      "failed_runs": failed, "rewards": [round(r, 4) for r in rewards]}))
    if args.check and not last > first:
        print(f"the reward did not rise: {first:.3f} over the first {window} steps, "
              f"{last:.3f} over the last {window}")
        return 1
    return 0


def _served_name(url: str, api_key: str | None) -> str:
    """The name the agent asks for: the one the server (or the gateway) serves."""
    from rollout.kit.aio import engine_loop
    from rollout.service.client import RemoteService

    async def ask() -> str:
        server = RemoteService(url, api_key)
        try:
            return await server.model()
        finally:
            await server.close()

    return engine_loop().run(ask(), 60, "the served model's name")


if __name__ == "__main__":
    sys.exit(main())
