"""Least-in-flight balancing against an even split, on a long-tail workload, in one run.

Two replicas of the HF backend (separate processes, tiny model). A few prompts ask for 10x
longer outputs and sit at the front of the data, as in a sorted dataset. The even split
gives each replica a contiguous half of the prompts (the long ones land together); the
balancer sends each request to the replica with the fewest in flight. Both use the same
replicas and the same cap of requests in flight per replica; rounds alternate; medians.

    python bench/bench_balancer.py [--prompts 64] [--long 4] [--tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from rollout.contract import convert
from rollout.contract.schemas import Request
from rollout.service.pool import ReplicaPool
from rollout.service.replicas import start_replicas
from rollout.kit.tiny_model import build_tiny_model

from common import prompts


async def makespan(pools: list[ReplicaPool], shares: list[list[Request]]) -> float:
    started = time.perf_counter()
    results = await asyncio.gather(*(asyncio.gather(*(pool.generate(r) for r in share))
                                     for pool, share in zip(pools, shares)))
    elapsed = time.perf_counter() - started
    assert all(c.ok for share in results for c in share)
    return elapsed


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(tmp))
        cap = args.batch_size
        pool = await start_replicas("hf", model, {"batch_size": args.batch_size}, 2,
                                    max_in_flight=cap)
        try:
            def request(i: int, text: str) -> Request:
                tokens = args.tokens * (10 if i < args.long else 1)
                return convert.structure({"id": f"r{i}", "prompt": text, "sampling": {
                    "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0}}, Request)

            work = [request(i, t) for i, t in enumerate(prompts(args.prompts))]
            half = len(work) // 2
            # The same replicas, one pool each: the even split, with the same cap.
            singles = [await ReplicaPool([r], name=f"replica-{i}", max_in_flight=cap).start()
                       for i, r in enumerate(pool.replicas)]
            await makespan([pool], [work])  # warm up
            even, balanced = [], []
            for _ in range(args.rounds):
                even.append(await makespan(singles, [work[:half], work[half:]]))
                balanced.append(await makespan([pool], [work]))
            a, b = statistics.median(even), statistics.median(balanced)
            print(f"{args.prompts} prompts ({args.long} with {10 * args.tokens} tokens, the rest "
                  f"{args.tokens}), 2 HF replicas, {cap} in flight each, median of {args.rounds}:")
            print(f"  even split (contiguous halves): {a:7.3f} s")
            print(f"  least in flight:                {b:7.3f} s")
            print(f"  makespan ratio (even split / least in flight): {a / b:.2f}")
            for single in singles:
                await single.close(stop_replicas=False)
        finally:
            await pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
