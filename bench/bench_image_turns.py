"""Per-turn cost of multi-turn image conversations: each turn adds one image. Sending each
turn as tokens with only its new image's pixels (earlier images named by uuid, as the agent
runner does) against re-sending the whole conversation, every image included, as messages.
Side by side in one process, on any backend with the `images` capability.

`--trajectories` conversations of `--turns` turns run at once; turn k of all of them is one
step, timed. Each step gives a user message with a new picture (`--size`, sent as PNG bytes,
as a client sends a screenshot) and samples `--tokens` tokens. The two ways use pictures of
their own (no cache serves one with the other's work), and take turns each round. A third
way, the same conversation with no pictures, shows what the context alone costs. Prints the
median seconds per turn of each, and each way's growth (last turn / first turn): the later
turns must not grow with the number of earlier images, that is, no more than text alone.

    python bench/bench_image_turns.py --backend hf
    python bench/bench_image_turns.py --backend vllm -o dtype=float32 -o enforce_eager=true \
        -o 'engine_args={"block_size": 32}'   # blocks that short prompts fill (docs/images.md)
    python bench/bench_image_turns.py --backend sglang -o mode=engine -o dtype=float32
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
import uuid

import numpy as np

from common import add_backend_arguments, prepare_engine

# Growth over the turns of sending only new images: at most this, or at most what the
# context alone costs (an engine without a prefix cache prefills it all at every turn).
GROWTH_TARGET = 1.25


def main() -> None:
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="640x480", help="WIDTHxHEIGHT of each picture")
    args = parser.parse_args()
    prepare_engine(args.backend, images=True)
    size = tuple(int(x) for x in args.size.split("x"))

    import rollout
    from rollout.kit.tiny_vlm import build_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_vlm(tmp)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        with rollout.load_backend(args.backend, model=str(model), **dict(args.options)) as ro:
            assert ro.capabilities.supports("images"), ro.capabilities.unsupported["images"]
            ways = {"new images only": Delta(tokenizer), "whole conversation": Whole(),
                    "text only": Whole(images=False)}
            seconds = {name: [[] for _ in range(args.turns)] for name in ways}
            for round_ in range(args.rounds + 1):  # the first round warms up
                order = list(ways) if round_ % 2 else list(reversed(ways))
                for name in order:
                    pictures = [[_png(size, (round_, name, t, k)) for k in range(args.turns)]
                                for t in range(args.trajectories)]
                    times = asyncio.run(_run(ro, ways[name], pictures, args.tokens))
                    if round_:
                        for k, s in enumerate(times):
                            seconds[name][k].append(s)

    medians = {name: [statistics.median(s) for s in per_turn]
               for name, per_turn in seconds.items()}
    delta, whole, text = (medians[name] for name in ways)
    print(f"{args.backend}: {args.trajectories} conversations x {args.turns} turns, one "
          f"{args.size} picture more each turn, {args.tokens} tokens sampled per turn; "
          f"median of {args.rounds} rounds")
    print(f"  {'turn':>4}  {'images':>6}  {'new only s':>10}  {'whole s':>9}  {'text s':>8}"
          "  whole/new")
    for k in range(args.turns):
        print(f"  {k + 1:>4}  {k + 1:>6}  {delta[k]:10.3f}  {whole[k]:9.3f}  {text[k]:8.3f}"
              f"  {whole[k] / delta[k]:9.2f}")
    growth = [way[-1] / way[0] for way in (delta, whole, text)]
    print(f"  growth, last turn / first: new images only {growth[0]:.2f} (target <= "
          f"{max(GROWTH_TARGET, growth[2]):.2f}: {GROWTH_TARGET} or text only's), whole "
          f"conversation {growth[1]:.2f}, text only {growth[2]:.2f}")


class Delta:
    """Turn k: the conversation as token ids, with turn k's picture as PNG bytes under a
    uuid of the client's and the earlier ones by their uuids alone (the agent runner's
    way: its tokens are built turn by turn; here the template renders them once ahead)."""

    images = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def requests(self, messages: list[dict], pictures: list[bytes], names: list[str]):
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        images = [None] * (len(pictures) - 1) + [pictures[-1]]
        return {"prompt_token_ids": ids, "images": images, "image_uuids": names}


class Whole:
    """Turn k: the whole conversation as messages, every picture in it as PNG bytes (or
    none: the text-only control)."""

    def __init__(self, images: bool = True):
        self.images = images

    def requests(self, messages: list[dict], pictures: list[bytes], names: list[str]):
        return {"messages": messages}


async def _run(ro, way, pictures: list[list[bytes]], tokens: int) -> list[float]:
    """Every conversation's turns, turn k of all at once: the seconds of each turn."""
    from rollout import Request
    from rollout.contract import convert

    sampling = {"temperature": 0, "max_tokens": tokens, "ignore_eos": True}
    conversations = [[] for _ in pictures]
    names = [[] for _ in pictures]  # the client's uuid of each picture sent
    times = []
    for k in range(len(pictures[0])):
        requests = []
        for t, messages in enumerate(conversations):
            image = [{"type": "image", "image": pictures[t][k]}] if way.images else []
            messages.append({"role": "user", "content": image + [
                {"type": "text", "text": f"and picture {k}?"}]})
            names[t].append(uuid.uuid4().hex)
            fields = way.requests(messages, pictures[t][:k + 1], names[t])
            requests.append(convert.structure({"sampling": sampling, **fields}, Request))
        started = time.perf_counter()
        done = await asyncio.gather(*(ro.agenerate(r) for r in requests))
        times.append(time.perf_counter() - started)
        for messages, completion in zip(conversations, done):
            messages.append({"role": "assistant", "content": completion.unwrap()[0].text})
    return times


def _png(size: tuple[int, int], seed) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(abs(hash(seed)) % 2**32)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


if __name__ == "__main__":
    main()
