"""What the served replica path costs: the same load against the HF backend in this process
(a `Rollout`), through one `rollout serve`, and through a pool of 2 replicas behind one
`rollout serve --replicas 2`, side by side in one run.

Two loads, each from `--clients` clients that send one request after the other:
- `plain`: short completions (8 tokens);
- `mixed`: the soak's mix (bench/soak.py): completions, chats, streams left after their
  first chunks, forced tool calls and bad requests.

In process, each request is made as the server makes it (the same OpenAI call objects build
the requests and the answer), without HTTP; a stream is left as the soak's client leaves it.
The baselines run at their best setting: in process and the one server each with one
OpenMP thread and with every core, the faster taken (the in-process side runs in a child
process of this one, started with its threads, since torch reads them once). The pool runs
with its defaults. Paths alternate by rounds, so the machine's drift falls on all of them.

Printed for each load and path: requests/s, p50 and p99 latency; then the ratios served /
in process and pool / single server.

    python bench/bench_replica_path.py [--model tiny|smollm2] [--seconds 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

from common import add_model_argument, model_folder, percentile, prompts
from soak import KEY, KINDS, MODEL, Load

LOADS = {"plain": {"completion": 1}, "mixed": None}  # None: the soak's own mix
WARM_UP_S = 3.0


class InProcess:
    """The soak's requests against a `Rollout` here: built and answered by the server's own
    call objects, sent to the backend without HTTP."""

    def __init__(self, rollout):
        self.rollout = rollout

    async def one(self, load: Load, kind: str) -> str:
        from rollout.apps.serving.openai_api import ApiError, ChatCall, CompletionsCall

        route, body, expected = load.body(kind)
        try:
            call = CompletionsCall(body, MODEL) if route == "completions" \
                else ChatCall(body, MODEL, "hermes")
        except ApiError:
            return "ok" if expected == 400 else "refused"
        (request,) = call.requests
        if kind == "stream_dropped":
            stream = self.rollout.stream(request)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.aclose()
            return "ok"
        completion = await self.rollout.agenerate(request)
        call.response([completion])
        return "ok" if completion.ok else "failed"


class Served:
    """The soak's requests over HTTP to a `rollout serve`."""

    def __init__(self, url: str):
        self.url = url
        self.session = None

    async def one(self, load: Load, kind: str) -> str:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {KEY}"},
                connector=aiohttp.TCPConnector(limit=0))
        return await load.one(self.session, kind)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


async def measure(path, load: Load, mix: dict, seconds: float, clients: int
                  ) -> tuple[dict, list[float]]:
    kinds, weights = list(mix), list(mix.values())
    latencies: list[float] = []
    outcomes: defaultdict[str, int] = defaultdict(int)
    deadline = time.monotonic() + seconds

    async def client():
        while time.monotonic() < deadline:
            kind = load.rng.choices(kinds, weights)[0]
            started = time.perf_counter()
            outcome = await path.one(load, kind)
            latencies.append(time.perf_counter() - started)
            outcomes[outcome] += 1

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.monotonic() - started
    if set(outcomes) != {"ok"}:
        sys.exit(f"unexpected answers: {dict(outcomes)}; first: {load.unexpected[:3]}")
    return {"requests": len(latencies), "seconds": elapsed}, latencies


def in_process_child(args) -> None:
    """One in-process measurement (`--child`), in a process started with its threads:
    prints {"run", "latencies"} as JSON on its last line."""
    import rollout

    with tempfile.TemporaryDirectory() as tmp:
        backend = rollout.load_backend("hf", model=model_folder(args.model, tmp))
        path, texts = InProcess(backend), prompts(64)

        async def run():
            await measure(path, Load("", texts, args.seed), mix_of("mixed", args.tools),
                          WARM_UP_S, args.clients)
            return await measure(path, Load("", texts, args.seed),
                                 mix_of(args.loads, args.tools), args.seconds, args.clients)

        try:
            run_, latencies = asyncio.run(run())
        finally:
            backend.close()
    print(json.dumps({"run": run_, "latencies": latencies}))


class InChild:
    """A path measured in a child process with `threads` OpenMP threads."""

    def __init__(self, threads: int, args):
        self.threads, self.args = threads, args

    async def run(self, load_name: str, seconds: float, seed: int):
        argv = [sys.executable, __file__, "--child", "--model", self.args.model_folder,
                "--loads", load_name, "--seconds", str(seconds), "--seed", str(seed),
                "--clients", str(self.args.clients),
                *([] if self.args.tools else ["--no-tools"])]
        child = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": str(self.threads)})
        out, _ = await asyncio.wait_for(child.communicate(), seconds + 600)
        if child.returncode != 0:
            sys.exit(f"the in-process child failed ({child.returncode}): {out[-2000:]!r}")
        found = json.loads(out.decode().strip().splitlines()[-1])
        return found["run"], found["latencies"]


def mix_of(load_name: str, tools: bool = True) -> dict:
    """The load's kinds and weights; without tool calls for a model whose chat template
    renders no tools (SmolLM2's: the server refuses them, 400)."""
    mix = LOADS[load_name] or KINDS
    return mix if tools else {k: w for k, w in mix.items() if k != "tool_call"}


def renders_tools(model: str) -> bool:
    from transformers import AutoTokenizer

    return "tools" in (AutoTokenizer.from_pretrained(model).chat_template or "")


def start_server(model: str, replicas: int, env: dict | None = None):
    from rollout.kit.process import HOST, ServerProcess, free_port

    port = free_port()
    server = ServerProcess(f"bench-serve-{replicas}", [
        sys.executable, "-m", "rollout", "serve", "--backend", "hf", "--model", model,
        "--served-model-name", MODEL, "--replicas", str(replicas), "--port", str(port),
        "--log-level", "warning"], env={"ROLLOUT_API_KEY": KEY, **(env or {})})
    url = f"http://{HOST}:{port}"
    server.wait_healthy(f"{url}/health", 600, {"Authorization": f"Bearer {KEY}"})
    return server, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--seconds", type=float, default=20.0, help="per path, load and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--loads", default="plain,mixed")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-tools", dest="tools", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return in_process_child(args)

    tmp = tempfile.mkdtemp(prefix="bench-replica-path-")
    args.model_folder = model_folder(args.model, tmp)
    args.tools = renders_tools(args.model_folder)
    warm_mix = mix_of("mixed", args.tools)
    texts = prompts(64)
    cores = str(len(os.sched_getaffinity(0)))
    servers = {"one server, 1 thread": start_server(args.model_folder, 1, {"OMP_NUM_THREADS": "1"}),
               f"one server, {cores} threads": start_server(args.model_folder, 1,
                                                            {"OMP_NUM_THREADS": cores}),
               "pool of 2": start_server(args.model_folder, 2)}
    paths = {"in process, 1 thread": InChild(1, args),
             f"in process, {cores} threads": InChild(int(cores), args),
             **{name: Served(url) for name, (_, url) in servers.items()}}
    figures: dict = defaultdict(lambda: defaultdict(list))  # load -> path -> runs
    latencies: dict = defaultdict(lambda: defaultdict(list))
    try:
        async def run():
            for path in paths.values():  # warm-up: each server's first requests
                if isinstance(path, Served):
                    await measure(path, Load(path.url, texts, args.seed), warm_mix,
                                  WARM_UP_S, args.clients)
            for round_ in range(args.rounds):
                for load_name in args.loads.split(","):
                    order = list(paths) if round_ % 2 == 0 else list(paths)[::-1]
                    for name in order:
                        path, seed = paths[name], args.seed + round_
                        if isinstance(path, InChild):
                            run_, lat = await path.run(load_name, args.seconds, seed)
                        else:
                            run_, lat = await measure(path, Load(path.url, texts, seed),
                                                      mix_of(load_name, args.tools),
                                                      args.seconds, args.clients)
                        figures[load_name][name].append(run_)
                        latencies[load_name][name] += lat
                        print(f"round {round_ + 1} {load_name:<6} {name:<22} "
                              f"{run_['requests'] / run_['seconds']:8.1f} requests/s",
                              flush=True)
            for path in paths.values():
                if isinstance(path, Served):
                    await path.close()

        asyncio.run(run())
    finally:
        for server, _ in servers.values():
            server.stop()
    report(figures, latencies, args)


def best(rates: dict[str, float], path: str) -> float:
    return max(rate for name, rate in rates.items() if name.startswith(path))


def report(figures, latencies, args) -> None:
    out = {}
    print(f"\n{args.model} model, {args.clients} clients, {args.rounds} rounds of "
          f"{args.seconds:.0f} s" + ("" if args.tools else "; the mix without tool calls "
                                     "(the model's chat template renders no tools)"))
    print(f"{'load':<6} {'path':<22} {'requests/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for load_name, by_path in figures.items():
        rates = {name: sum(r["requests"] for r in runs) / sum(r["seconds"] for r in runs)
                 for name, runs in by_path.items()}
        for name, rate in rates.items():
            lat = latencies[load_name][name]
            print(f"{load_name:<6} {name:<22} {rate:>10.1f} {percentile(lat, 0.5) * 1e3:>8.1f} "
                  f"{percentile(lat, 0.99) * 1e3:>8.1f}")
        in_process = best(rates, "in process")
        one_server = best(rates, "one server")
        ratios = {"one server / in process": one_server / in_process,
                  "pool of 2 / in process": rates["pool of 2"] / in_process,
                  "pool of 2 / one server": rates["pool of 2"] / one_server}
        print("  each against the best of its baseline's settings: "
              + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        out[load_name] = {"requests_per_s": rates, "ratios": ratios,
                          "p50_ms": {k: statistics.median(v) * 1e3
                                     for k, v in latencies[load_name].items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
