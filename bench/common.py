"""What every benchmark here shares: the prompts, the stopwatch, and the engine benches'
workload arguments."""

from __future__ import annotations

import argparse
import json
import os
import time

WORDS = "the ka lo mi ne su ta ri po def return print x y".split()


TINY = "tiny"  # `--model`'s default: the tiny random model, built fresh for the run

TOPICS = ("the sea", "bread", "a bicycle", "rain", "the moon", "chess", "a garden", "music",
          "volcanoes", "a library", "winter", "honey", "trains")
ASKS = ("What is {a} + {b}?",
        "Write one sentence about {topic}.",
        "Explain {topic} to a child in a few words.",
        "Give me three facts about {topic}, one line each.",
        "Tell a very short story about {topic} and the number {a}.",
        "List {b} words that describe {topic}, separated by commas, and say why.")


def prompts(count: int, chat_tokenizer=None) -> list[str]:
    """`count` deterministic prompts: without `chat_tokenizer`, 3 to 15 words in the tiny
    model's vocabulary; with it, questions for an instruct model (sums, sentences, facts
    and stories about everyday topics) rendered as one user turn through its chat template,
    as text that tokenizes to the template's tokens."""
    if chat_tokenizer is None:
        return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 13))
                for i in range(count)]
    asks = [ASKS[i % len(ASKS)].format(a=i % 20 + 1, b=(i * 7) % 9 + 2,
                                       topic=TOPICS[(i * 5) % len(TOPICS)])
            for i in range(count)]
    return [chat_tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                               add_generation_prompt=True, tokenize=False)
            for ask in asks]


def backend_option(text: str) -> tuple[str, object]:
    """`key=value`; the value is read as JSON where it parses (numbers, true, null)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"-o takes key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """`--backend` (hf by default) and `-o KEY=VALUE` backend options (`args.options`)."""
    parser.add_argument("--backend", default="hf")
    parser.add_argument("-o", "--option", dest="options", action="append", default=[],
                        type=backend_option, metavar="KEY=VALUE",
                        help="a backend option (repeat for several)")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=TINY,
                        help=f"`{TINY}` (default: the tiny random model, built for the run), "
                             "a known model's name (`smollm2`) or a model folder")


def model_folder(model: str, tmp: str) -> str:
    """`--model` as a folder: the tiny model built into `tmp`, or a known name's cached
    conversion (made first if needed), or the folder as given."""
    if model == TINY:
        from rollout.kit.tiny_model import build_tiny_model

        return str(build_tiny_model(tmp))
    from rollout.kit.models import resolve

    return resolve(model)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def workload_parser(model: bool = False) -> argparse.ArgumentParser:
    """`--prompts`, `--tokens` and `--rounds`, as the engine throughput benches take them
    (and `--model`, for those that take another model)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    if model:
        add_model_argument(parser)
    return parser


def use_cpu_defaults() -> None:
    """A vLLM KV cache that fits a small machine, and no model hub. Here rather than in
    bench_vllm, which imports this module: the vLLM benches and `prepare_engine` share it."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def prepare_engine(backend: str, images: bool = False) -> None:
    """What an engine needs on this machine before it loads: vLLM a KV cache that fits a
    small machine (and for images the test-only stand-in for torchvision), SGLang without a
    GPU the test-only CPU scaffolding (each from its tests' conftest)."""
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent.parent / "plugins" / f"{backend}_backend" / "tests"
    if backend == "vllm":
        use_cpu_defaults()
        if images:
            sys.path.insert(0, str(tests))
            import conftest  # noqa: F401 - the torchvision stand-in, on import
    elif backend == "sglang":
        import torch

        if not torch.cuda.is_available():
            sys.path.insert(0, str(tests))
            import conftest  # noqa: F401 - sets up the CPU scaffolding on import
