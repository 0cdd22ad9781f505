"""3-turn tool trajectories against the same token work as independent single-turn requests,
on any backend, side by side in one process.

`--trajectories` trajectories of `rollout.testing.agents.ToolTask(calls=2)` (two forced
`add` calls, then a forced answer; greedy) run through `AgentRunner`, which records every
request it sends. The same requests (same prompt tokens, same constraint, same outputs)
then go out all at once as independent `agenerate` calls. Rounds alternate and medians are
compared; prints sampled tokens per second for both and the ratio trajectories /
independent (target: >= 0.8: turns that wait on their history and tools cost little).

    python bench/bench_agents.py --backend hf -o batch_size=64
    python bench/bench_agents.py --backend vllm -o dtype=float32 -o enforce_eager=true
    python bench/bench_agents.py --backend sglang -o mode=engine -o dtype=float32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from common import add_backend_arguments, prepare_engine

TARGET = 0.8


def main() -> None:
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prepare_engine(args.backend)

    import rollout
    from rollout.apps.agents import AgentConfig, AgentRunner
    from rollout.kit.tiny_model import build_tiny_model
    from rollout.testing.agents import ToolTask

    rows = [{"prompt": f"what is {i % 10} + {i % 7}?"} for i in range(args.trajectories)]
    config = AgentConfig(sampling=rollout.SamplingParams(temperature=0.0, max_tokens=128),
                         check_render=False)
    with tempfile.TemporaryDirectory() as tmp:
        ro = rollout.load_backend(args.backend, model=str(build_tiny_model(tmp)),
                                  **dict(args.options))
        sent: list = []  # every request the runner sends
        generate = ro.agenerate

        async def recorded(request, timeout=None):
            sent.append(request)
            return await generate(request, timeout)

        ro.agenerate = recorded  # (this instance only)
        runner = AgentRunner(ro, ToolTask(calls=2), config)

        def trajectories() -> int:
            sent.clear()
            done = asyncio.run(runner.run_many(rows))
            assert all(t.end_reason == "done" and t.num_turns == 3 for t in done), \
                {t.end_reason for t in done}
            return sum(sum(t.mask) for t in done)

        tokens = trajectories()  # warm up, and the requests to replay
        replay = list(sent)

        def independent() -> int:
            async def go():
                return await asyncio.gather(*(generate(r) for r in replay))

            return sum(c.unwrap()[0].completion_tokens for c in asyncio.run(go()))

        assert independent() == tokens  # the same token work
        agent_s, independent_s = [], []
        for _ in range(args.rounds):
            agent_s.append(_timed(trajectories))
            independent_s.append(_timed(independent))
        ro.close()

    agent, alone = statistics.median(agent_s), statistics.median(independent_s)
    ratio = alone / agent
    print(f"{args.backend}: {args.trajectories} trajectories x 3 turns, {tokens} sampled "
          f"tokens ({len(replay)} requests)")
    print(f"  trajectories: {tokens / agent:8.0f} tokens/s  (median of {args.rounds})")
    print(f"  independent:  {tokens / alone:8.0f} tokens/s")
    print(f"  ratio trajectories/independent: {ratio:.3f} (target >= {TARGET})")


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
