"""Strict tools at volume: how many returned calls validate against their schemas.

`--schemas` Hypothesis-made schemas (rollout.testing.strict_tools.json_schemas: strings with
lengths, patterns, formats and enums, bounded numbers, nested objects, arrays with item
bounds, anyOf, $defs/$ref), each used as a strict tool under tool_choice "auto", "required"
and a named tool, sampled at temperature 1 from the tiny random model through `rollout
serve` (in a thread of this process), until at least `--calls` calls came back. Prints the
valid fraction, the calls that came back as text, the cut samples, and the failures.

    python bench/bench_strict_tools.py --backend hf
    python bench/bench_strict_tools.py --backend vllm -o dtype=float32 -o enforce_eager=true
    python bench/bench_strict_tools.py --backend sglang -o mode=server -o dtype=float32
    python bench/bench_strict_tools.py --backend hf --raw   # schemas as given (the old way)

`--raw` hands the schemas to the grammar engine unrewritten and unchecked, to show what the
rewrite prevents; the server's own strict check still runs (its catches count as invalid).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from common import backend_option, prepare_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--schemas", type=int, default=60)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--n", type=int, default=4, help="samples per chat call")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=8, help="chat calls at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw", action="store_true",
                        help="give the grammar the schemas as they are (no rewrite, no refusal)")
    parser.add_argument("-o", "--option", dest="options", action="append", default=[],
                        type=backend_option, metavar="KEY=VALUE")
    args = parser.parse_args()
    prepare_engine(args.backend)

    import openai
    from transformers import AutoTokenizer

    import rollout
    from rollout.apps.serving.app import ServerThread
    from rollout.apps.tool_parsers import strict
    from rollout.service.service import LocalService
    from rollout.testing.model_folders import tiny_model_dir
    from rollout.testing.strict_tools import KEY, MODEL, MODES, Tally, sample_schemas, strict_calls

    if args.raw:
        strict.prepare = lambda schema, where, refuse=True: schema
    schemas = sample_schemas(args.schemas, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model_dir(tmp))
        opening = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<tool_call>")
        options = dict(args.options)
        if args.backend in ("hf", "vllm"):  # room for the schemas in the prompt
            options.setdefault("max_model_len", 2048)
        elif args.backend == "sglang":
            options.setdefault("engine_args", {"context_length": 2048})
        with rollout.load_backend(args.backend, model=model, **options) as ro, \
                ServerThread(LocalService(ro, MODEL), api_key=KEY) as server:
            seeded = ro.capabilities.supports("seed")
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                   timeout=600)
            total, by_mode = Tally(), {mode: Tally() for mode in MODES}
            started, rounds = time.monotonic(), 0

            def one(job):
                schema, mode, seed = job
                return mode, strict_calls(client, schema, mode, model=MODEL, opening=opening,
                                          n=args.n, seed=seed if seeded else None,
                                          max_tokens=args.max_tokens)

            with ThreadPoolExecutor(args.parallel) as pool:
                while total.calls < args.calls:
                    jobs = [(schema, mode, args.seed + rounds * 1000 + i)
                            for i, schema in enumerate(schemas) for mode in MODES]
                    for mode, tally in pool.map(one, jobs):
                        by_mode[mode].add(tally)
                        total.add(tally)
                    rounds += 1
            seconds = time.monotonic() - started
    for mode, tally in by_mode.items():
        print(f"{mode:>8}: {tally.valid}/{tally.calls} valid, {tally.as_text} as text, "
              f"{tally.invalid} invalid, {tally.cut} cut, {tally.errors} errors")
    fraction = total.valid / total.calls if total.calls else float("nan")
    print(f"{args.backend}{' (raw schemas)' if args.raw else ''}: {len(schemas)} schemas x "
          f"{len(MODES)} modes x {rounds} rounds, {total.calls} calls returned, "
          f"valid fraction {fraction:.4f} ({total.valid}/{total.calls}); "
          f"{total.as_text} as text, {total.invalid} invalid, {total.cut} samples cut, "
          f"{total.errors} samples in failed calls; "
          f"{seconds:.0f} s")
    reasons = collections.Counter(re.sub(r"'[^']*'|\d+", "_", str(e[3:]))[-160:]
                                  for e in total.examples)
    for reason, count in reasons.most_common(8):
        print(f"  {count} x {reason}")
    for example in total.examples[:3]:
        print("  failure:", example[0], example[2], str(example[3:])[:300],
              json.dumps(example[1])[:300])


if __name__ == "__main__":
    main()
