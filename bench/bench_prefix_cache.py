"""Prefix-cache hits on the history of multi-turn trajectories, over two replicas, with and
without sessions.

`--trajectories` trajectories of 3 turns (a distinct first prompt each, then user turns;
sampled, so every history is its own) run through `AgentRunner` over a pool of two
`rollout serve` replicas of the backend. Turns vary in length (4 to 2 x `--tokens`) and the
environment answers each after 0 to 0.5 s, as tools and users take their time. With
sessions every turn of a trajectory goes to the replica that served its first turn;
without, the pool sends each turn to the replica with the fewest requests in flight.
Prints, for turns after the first, the share of prompt tokens the engines took from their
prefix caches (target with sessions: >= 0.9), the most a cache of full `--block`-token
blocks could have held, and the share of turns that found their history elsewhere.

    python bench/bench_prefix_cache.py --backend vllm -o dtype=float32 -o enforce_eager=true
    python bench/bench_prefix_cache.py --backend sglang -o dtype=float32 --block 1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile

from common import WORDS, backend_option, prepare_engine

TARGET = 0.9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument("--tokens", type=int, default=48, help="mean sampled tokens per turn")
    parser.add_argument("--block", type=int, default=16, help="the engine's cache block size")
    parser.add_argument("-o", "--option", dest="options", action="append", default=[],
                        type=backend_option, metavar="KEY=VALUE")
    args = parser.parse_args()
    prepare_engine(args.backend)

    import rollout
    from rollout.apps.agents import AgentConfig, AgentRunner, Environment, Reply
    from rollout.kit.tiny_model import build_tiny_model

    class GoOn(Environment):
        """Turns of varied length, answered after a varied while (tools, users): under a
        uniform load, least-in-flight alone would send each turn back to the replica that
        its previous turn just left."""

        async def respond(self, row, messages):
            await asyncio.sleep(random.uniform(0.0, 0.5))
            turns = sum(m.role == "assistant" for m in messages)
            return Reply([{"role": "user", "content": "go on"}], done=turns >= 3)

        def sampling(self, row, turn, messages):
            return {"max_tokens": random.randint(4, 2 * args.tokens)}

    def rows(offset: int) -> list[dict]:  # distinct per trajectory and per run
        return [{"prompt": " ".join(WORDS[(i * 31 + j * 7 + offset) % len(WORDS)] + str(i + offset)
                                    for j in range(args.prompt_words))}
                for i in range(args.trajectories)]

    async def measure(pool, model, sessions: bool, offset: int) -> tuple[float, ...]:
        config = AgentConfig(sampling=rollout.SamplingParams(
            temperature=1.0, max_tokens=args.tokens, ignore_eos=True),
            sessions=sessions, check_render=False)
        runner = AgentRunner(pool, GoOn(), config, tokenizer=model)
        done = await runner.run_many(rows(offset))
        later = [turn for t in done for turn in t.turns if turn.index > 0]
        assert all(t.end_reason == "done" for t in done) and later, \
            {(t.end_reason, t.end_detail[:300]) for t in done}
        assert all(turn.cached_tokens is not None for turn in later), "no cache figures"
        prompt = sum(turn.prompt_tokens for turn in later)
        cached = sum(turn.cached_tokens for turn in later)
        # The history a cache of full blocks can hold: the previous prompt and turn.
        best = sum((turn.prompt_tokens - 1) // args.block * args.block for turn in later)
        cold = sum(turn.cached_tokens < turn.prompt_tokens // 2 for turn in later)
        return cached / prompt, best / prompt, cold / len(later)

    def run(model: str) -> None:
        with rollout.ServedRollout.start(args.backend, model, 2, dict(args.options)) as pool:
            results = {}
            for offset, sessions in enumerate((True, False)):
                results[sessions] = asyncio.run(measure(pool, model, sessions,
                                                        1000 * (offset + 1)))
        print(f"{args.backend}, 2 replicas, {args.trajectories} trajectories x 3 turns, "
              f"turns after the first:")
        for sessions, (rate, best, cold) in results.items():
            print(f"  {'with' if sessions else 'without'} sessions: prefix-cache hit rate "
                  f"{rate:.3f} (full blocks could hold {best:.3f}); turns that found less "
                  f"than half their prompt cached: {cold:.2f}")
        print(f"  target with sessions: >= {TARGET}")

    with tempfile.TemporaryDirectory() as tmp:
        run(str(build_tiny_model(tmp)))


if __name__ == "__main__":
    main()
