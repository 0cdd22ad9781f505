"""What `rollout serve` adds to the latency of a single request, against calling the same
backend in this process, side by side in one run.

The server runs the HF backend on the tiny model in its own process (`--replicas 1`); the
direct side loads the same backend here. Single requests alternate between the two; the
medians and 99th percentiles and their differences are printed.

    python bench/bench_serve_latency.py [--requests 200] [--tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time

import aiohttp

import rollout
from rollout.kit.process import HOST, ServerProcess, free_port
from rollout.kit.tiny_model import build_tiny_model

from common import percentile


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(tmp))
        port = free_port()
        server = ServerProcess("serve", [sys.executable, "-m", "rollout", "serve", "--backend",
                                         "hf", "--model", model, "--port", str(port)])
        url = f"http://{HOST}:{port}"
        try:
            server.wait_healthy(f"{url}/health", 300)
            backend = rollout.load_backend("hf", model=model)
            body = {"model": model, "prompt": "the ka lo", "max_tokens": args.tokens,
                    "temperature": 0.0}
            request = {"prompt": "the ka lo",
                       "sampling": {"max_tokens": args.tokens, "temperature": 0.0}}
            direct, served = [], []
            async with aiohttp.ClientSession() as session:
                async def over_http() -> None:
                    async with session.post(f"{url}/v1/completions", json=body) as response:
                        assert response.status == 200, await response.text()
                        await response.json()

                for i in range(args.requests + 10):
                    started = time.perf_counter()
                    backend.generate([request])[0].unwrap()
                    middle = time.perf_counter()
                    await over_http()
                    if i >= 10:  # warm-up
                        direct.append(middle - started)
                        served.append(time.perf_counter() - middle)
            backend.close()
        finally:
            server.stop()
        ms = 1000
        print(f"{args.requests} single requests of {args.tokens} tokens, HF backend, tiny model:")
        for name, values in (("direct, in process", direct), ("rollout serve, HTTP", served)):
            print(f"  {name:20} median {statistics.median(values) * ms:7.2f} ms   "
                  f"p99 {percentile(values, 0.99) * ms:7.2f} ms")
        print(f"  added by serve: median {(statistics.median(served) - statistics.median(direct)) * ms:+.2f} ms, "
              f"p99 {(percentile(served, 0.99) - percentile(direct, 0.99)) * ms:+.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
