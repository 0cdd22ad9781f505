"""What recording agent sessions costs `rollout serve`, and what it saves: the same multi-turn
load against two servers in front of one backend in this process (HF by default), one
recording sessions (the default) and one not (`sessions_kept=0`), side by side, rounds
alternating.

Each of `--clients` clients runs sessions of `--turns` chat turns, one call after the other,
every call naming its session (`X-Session-ID`), seeded alike for both servers where the
backend takes seeds (so that both do the same work, call for call): a tool call in the
hermes format (held by a regex, as a random model would not write one), its result sent
back, then free text; on a model whose template takes no tools (SmolLM2's), free text at
every turn. Printed: calls/s of each server and their ratio (target >= 0.98), the ratio
of this process's CPU time a call (clients, servers and an in-process engine), the tokens
each call prompted and sampled, the server's memory per 1,000 sessions recorded, and the
drift: over the recorded sessions, the tokens where the conversation rebuilt from its text
by the chat template differs from the ids the engine sampled (a trainer that re-tokenizes
trains on those), against 0 in the recording (each call's sampled ids are checked to sit
in the session as sampled).

    python bench/bench_sessions.py [--model tiny|smollm2] [--backend hf|vllm|sglang]
        [-o KEY=VALUE] [--clients 8] [--turns 4] [--seconds 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
import tracemalloc
from collections import Counter

from common import add_backend_arguments, add_model_argument, model_folder, prepare_engine

from rollout.testing.server_contract import CALL_REGEX, TOOLS

KEY = "bench"
MODEL = "model"
ids = itertools.count()


async def one_session(http, url: str, turns: int, record: list | None, tools: bool,
                      tokens: Counter, asked: dict, seed: int | None) -> int:
    """A session's turns; their answers (with token ids) appended to `record`, their prompt
    tokens (and the engine's cached ones) counted in `tokens`. Without
    `tools` (a template that takes none, as SmolLM2's) every turn is free text. `seed`
    (where the backend takes seeds): the session's, from which each turn's comes, so that
    both servers sample the same sessions, call for call."""
    name = f"s{next(ids)}"
    messages = [{"role": "user", "content": "what is 2 + 3?"}]
    answers = []
    for turn in range(turns):
        tool = tools and turn % 2 == 0
        body = {"model": MODEL, "messages": messages, "temperature": 1.0,
                "return_token_ids": True, **asked, **({"tools": TOOLS} if tools else {}),
                **({} if seed is None else {"seed": seed * turns + turn}),
                **({"structured_outputs": {"regex": CALL_REGEX}, "max_tokens": 64} if tool
                   else {"max_tokens": 16, **({"tool_choice": "none"} if tools else {})})}
        async with http.post(f"{url}/v1/chat/completions", json=body,
                             headers={"X-Session-ID": name}) as response:
            answer = await response.json()
            assert response.status == 200, answer
        usage = answer.get("usage") or {}
        tokens["calls"] += 1
        tokens["prompt"] += usage.get("prompt_tokens") or 0
        tokens["cached"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        tokens["completion"] += usage.get("completion_tokens") or 0
        choice = answer["choices"][0]
        answers.append(choice)
        messages.append({k: v for k, v in choice["message"].items()
                         if k in ("role", "content", "tool_calls")})
        if choice["message"].get("tool_calls"):
            messages.append({"role": "tool", "content": "5",
                             "tool_call_id": choice["message"]["tool_calls"][0]["id"]})
        else:
            messages.append({"role": "user", "content": "go on"})
    if record is not None:
        record.append((name, messages[:-1], answers))
    return turns


async def run_load(url: str, clients: int, turns: int, seconds: float, tools: bool,
                   record: list | None = None, tokens: Counter | None = None,
                   asked: dict | None = None, seeds: int | None = None) -> float:
    """Calls/s over `seconds`; `asked`: fields every call adds. `seeds`: where client c's
    k-th session's seed starts from, so that two runs from the same start sample the same
    sessions in the same order (and differ only in how many they finish)."""
    import aiohttp

    tokens = Counter() if tokens is None else tokens
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        deadline = time.monotonic() + seconds
        done = [0]

        async def client(c: int):
            for k in itertools.count():
                if time.monotonic() >= deadline:
                    break
                done[0] += await one_session(http, url, turns, record, tools, tokens,
                                             asked or {}, None if seeds is None
                                             else seeds + k * clients + c)

        started = time.monotonic()
        await asyncio.gather(*(client(c) for c in range(clients)))
        return done[0] / (time.monotonic() - started)


def takes_tools(tokenizer) -> bool:
    ask = [{"role": "user", "content": "what is 2 + 3?"}]
    return tokenizer.apply_chat_template(ask, tools=TOOLS, tokenize=False) != \
        tokenizer.apply_chat_template(ask, tokenize=False)


def drift(server, tokenizer, recorded: list, tools: bool) -> tuple[int, int, int, int]:
    """(sessions, tokens, sessions whose text rebuild differs, tokens that differ) over
    `recorded`; raises if a session does not hold its calls' sampled ids."""
    import urllib.request

    from rollout.apps.agents.tokens import first_difference

    sessions = tokens = drifted = drifted_tokens = 0
    for name, messages, answers in recorded:
        request = urllib.request.Request(f"{server.url}/rollout/sessions/{name}?pop=true",
                                         headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            (branch,) = json.loads(response.read())["branches"]
        held = branch["token_ids"]
        for call, answer in zip(branch["calls"], answers):
            assert held[call["prompt_end"]:call["end"]] == answer["token_ids"], name
        for message in messages:  # as a template takes a call: arguments as an object
            for call in message.get("tool_calls") or ():
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        text = tokenizer.apply_chat_template(messages, tools=TOOLS if tools else None,
                                             tokenize=False)
        rebuilt = tokenizer(text, add_special_tokens=False).input_ids
        end = branch["calls"][-1]["end"]
        first = first_difference(rebuilt, held[:end])
        sessions += 1
        tokens += end
        if first < max(len(rebuilt), end):
            drifted += 1
            drifted_tokens += sum(a != b for a, b in zip(rebuilt[first:], held[first:end])) \
                + abs(len(rebuilt) - end)
    return sessions, tokens, drifted, drifted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_backend_arguments(parser)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--logprobs", action="store_true",
                        help="every call asks for logprobs, which recording asks the engine "
                        "for anyway: the ratio is then recording's own cost")
    args = parser.parse_args()
    asked = {"logprobs": True} if args.logprobs else {}
    prepare_engine(args.backend)

    import rollout
    from transformers import AutoTokenizer

    from rollout.apps.serving.app import ServerThread
    from rollout.testing.server_contract import BorrowedService

    folder = model_folder(args.model, tempfile.mkdtemp())
    ro = rollout.load_backend(args.backend, model=folder,
                              **{"max_model_len": 2048, **dict(args.options)})
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tools = takes_tools(tokenizer)
    # Both servers then sample the same calls in a round (not SGLang on CPU, which takes no
    # seeds); each round its own, so that no round finds another's in a prefix cache.
    seeded = ro.capabilities.supports("seed")
    rates: dict[str, list[float]] = {"recorded": [], "not recorded": []}
    # This process's CPU (clients, server, and the engine where it runs in process) over
    # the calls made: recording's own work shows there where the engine waits for no one
    # (contention raises it too: on 2 shared cores it spread as much as calls/s).
    cpu_a_call: dict[str, list[float]] = {name: [] for name in rates}
    usage = {name: Counter() for name in rates}
    with ServerThread(BorrowedService(ro, MODEL), api_key=KEY) as recording, \
            ServerThread(BorrowedService(ro, MODEL), api_key=KEY, sessions_kept=0) as plain:
        servers = {"recorded": recording, "not recorded": plain}
        for server in servers.values():  # warm both
            asyncio.run(run_load(server.url, args.clients, args.turns, 2.0, tools))
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(servers)[::-1]
            for name in order:
                calls, cpu = usage[name]["calls"], time.process_time()
                rate = asyncio.run(run_load(servers[name].url, args.clients, args.turns,
                                            args.seconds, tools, tokens=usage[name],
                                            asked=asked,
                                            seeds=round_ * 10**6 if seeded else None))
                rates[name].append(rate)
                cpu_a_call[name].append((time.process_time() - cpu)
                                        / max(usage[name]["calls"] - calls, 1))
                print(f"round {round_ + 1} {name:>12}: {rate:7.2f} calls/s, "
                      f"{cpu_a_call[name][-1] * 1000:.1f} ms of CPU a call", flush=True)
        # Memory per 1,000 sessions, and the drift, over sessions recorded for that.
        record: list = []
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        asyncio.run(run_load(recording.url, args.clients, args.turns, args.seconds, tools,
                             record))
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        sessions, tokens, drifted, drifted_tokens = drift(recording, tokenizer, record, tools)
    ro.close()
    # Each round's ratio, the two servers measured one after the other (in turn first):
    # the machine's drift over the run falls out of it.
    ratios = [r / n for r, n in zip(rates["recorded"], rates["not recorded"])]
    print(f"sessions recorded / not: {statistics.median(ratios):.3f} of the calls/s, the "
          f"median of the rounds' ratios ({min(ratios):.2f} to {max(ratios):.2f}; target "
          f">= 0.98); medians {statistics.median(rates['recorded']):.2f} and "
          f"{statistics.median(rates['not recorded']):.2f} calls/s")
    cpu = [r / n for r, n in zip(cpu_a_call["recorded"], cpu_a_call["not recorded"])]
    print(f"CPU a call, recorded / not: {statistics.median(cpu):.3f}, the median of the "
          f"rounds' ratios ({min(cpu):.2f} to {max(cpu):.2f})")
    for name, counted in usage.items():
        calls = max(counted["calls"], 1)
        print(f"{name}: {counted['prompt'] / calls:.1f} prompt tokens a call, "
              f"{counted['cached'] / max(counted['prompt'], 1):.0%} of them cached, "
              f"{counted['completion'] / calls:.1f} tokens sampled")
    print(f"memory: {grown / 2**20 / max(sessions, 1) * 1000:.1f} MiB per 1,000 sessions of "
          f"{args.turns} turns ({tokens / max(sessions, 1):.0f} tokens each; Python objects "
          "allocated while recording, tracemalloc)")
    print(f"drift: 0 tokens in the {sessions} recorded sessions (each call's sampled ids "
          f"checked); rebuilt from their text, {drifted} of them ({drifted_tokens} of "
          f"{tokens} tokens) differ from what the engine sampled")


if __name__ == "__main__":
    main()
