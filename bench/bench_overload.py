"""Memory under a 10x overload: `rollout serve` with admission control (the default bounds,
or --max-running/--max-waiting) against the same server with no bound on waiting work,
side by side in one run.

First each server's throughput is measured with a closed loop; then requests arrive
open-loop at 10x that rate for `--seconds`, in calls to the native route of
`--per-call` requests each, with prompts of about `--prompt-chars` characters. The
server's peak RSS is read at each quarter of the flood: the bounded server refuses what
does not fit (429) and stays flat once its turns and line are full; the unbounded one
queues everything and grows with the backlog.

    python bench/bench_overload.py [--seconds 30] [--max-running 16 --max-waiting 256]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import add_model_argument, model_folder, prompts

KEY = "overload-key"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(model: str, bounds: list[str]):
    from rollout.kit.process import HOST, ServerProcess, free_port

    port = free_port()
    server = ServerProcess("overload-serve", [
        sys.executable, "-m", "rollout", "serve", "--backend", "hf", "--model", model,
        "--port", str(port), "--log-level", "warning", *bounds], env={"ROLLOUT_API_KEY": KEY})
    url = f"http://{HOST}:{port}"
    server.wait_healthy(f"{url}/health", 300, {"Authorization": f"Bearer {KEY}"})
    return server, url


async def call(session, url: str, requests: list[dict]) -> int:
    import aiohttp

    try:
        async with session.post(f"{url}/rollout/generate", json={"requests": requests},
                                timeout=aiohttp.ClientTimeout(total=600)) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0


def requests_of(texts: list[str], count: int, tokens: int) -> list[dict]:
    return [{"prompt": texts[i % len(texts)], "sampling": {"max_tokens": tokens,
                                                           "ignore_eos": True}}
            for i in range(count)]


async def throughput(url: str, texts: list[str], tokens: int, seconds: float = 8.0) -> float:
    """Requests per second with 16 calls of 4 requests kept going."""
    import aiohttp

    done, stop = 0, time.monotonic() + seconds

    async def loop(session):
        nonlocal done
        while time.monotonic() < stop:
            if await call(session, url, requests_of(texts, 4, tokens)) == 200:
                done += 4

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        await asyncio.gather(*(loop(session) for _ in range(16)))
    return done / seconds


async def flood(url: str, texts: list[str], tokens: int, rate: float, seconds: float,
                per_call: int) -> dict:
    """Open loop: a call of `per_call` requests every per_call / rate seconds."""
    import aiohttp

    statuses: dict[int, int] = {}
    calls = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"},
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        began = time.monotonic()
        sent = 0
        while time.monotonic() - began < seconds:
            calls.append(asyncio.ensure_future(call(session, url,
                                                    requests_of(texts, per_call, tokens))))
            sent += per_call
            await asyncio.sleep(max(0.0, began + sent / rate - time.monotonic()))
        # What was answered within the flood's time; the rest is the backlog.
        await asyncio.sleep(2.0)
        for task in calls:
            if task.done():
                statuses[task.result()] = statuses.get(task.result(), 0) + per_call
            else:
                task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    return {"sent": sent, "answered": statuses}


def measure(model: str, bounds: list[str], args, texts: list[str]) -> dict:
    server, url = start(model, bounds)
    samples, stop = [], threading.Event()  # (seconds into the flood, RSS)

    def sample():
        began = time.monotonic()
        while not stop.wait(0.5):
            samples.append((time.monotonic() - began, rss_mb(server.proc.pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        rate = asyncio.run(throughput(url, texts, args.tokens))
        before = rss_mb(server.proc.pid)
        sampler.start()
        flooded = asyncio.run(flood(url, texts, args.tokens, 10 * rate, args.seconds,
                                    args.per_call))
    finally:
        stop.set()
        server.stop()
    quarters = [max((mb for t, mb in samples if t <= q * args.seconds), default=before)
                for q in (0.25, 0.5, 0.75, 1.0)]
    return {"rate": rate, "rss_before": before, "rss_quarters": quarters, **flooded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--per-call", type=int, default=50)
    parser.add_argument("--prompt-chars", type=int, default=2000)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-waiting", type=int, default=1024)
    args = parser.parse_args()
    model = model_folder(args.model, tempfile.mkdtemp(prefix="overload-"))
    # Long prompts, each a little different; cut to the tiny model's context.
    texts = [(text + " ") * (args.prompt_chars // (len(text) + 1)) for text in prompts(32)]
    bounded = ["--max-running", str(args.max_running), "--max-waiting", str(args.max_waiting)]
    unbounded = ["--max-running", str(args.max_running), "--max-waiting", str(10**9)]
    results = {name: measure(model, bounds, args, texts)
               for name, bounds in (("bounded", bounded), ("unbounded", unbounded))}
    for name, r in results.items():
        print(f"{name:>9}: {r['rate']:.0f} requests/s served; at 10x for {args.seconds:.0f} s, "
              f"{r['sent']} sent, answered by status {r['answered']}; server peak RSS "
              f"{r['rss_before']:.0f} MB before, then by quarter of the flood "
              + " / ".join(f"{mb:.0f}" for mb in r["rss_quarters"]) + " MB")
    grew = {n: r["rss_quarters"][-1] - r["rss_quarters"][0] for n, r in results.items()}
    print(f"RSS growth from the first quarter of the flood to its end: bounded "
          f"{grew['bounded']:.0f} MB, unbounded {grew['unbounded']:.0f} MB")


if __name__ == "__main__":
    main()
