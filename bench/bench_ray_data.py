"""The batch job on Ray Data against the single-driver job, side by side: the same prompts
(100k by default), the tiny model, the same backend, replica count, chunk size and engine
batch. Each run is a fresh driver process, which reports its own wall time (from its
replicas' start; for Ray Data, on a running local cluster) and peak RSS; the modes take
turns for `--rounds` rounds. Prints each, the throughput ratio (target >= 0.9) and the
drivers' peak RSS.

    python bench/bench_ray_data.py [--rows 100000] [--replicas 2] [--tokens 8] [--rounds 1]
                                   [--backend hf|vllm] [--modes driver,ray-data,ray-llm]

The `ray-llm` mode (with `--backend vllm`) runs Ray's own LLM batch API, `ray.data.llm`, on
the same prompts with as many vLLM engines; it needs Ray Serve's dependencies beside Ray
(`pip install grpcio-reflection`), which the test environment does not hold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import prompts


BACKENDS = ("hf", "vllm")
VLLM = {"dtype": "float32", "enforce_eager": True}  # on vLLM's CPU build, as its tests run it


def job_config(source: str, output: str, model: str, args, ray_data: bool):
    from rollout.apps.jobs.config import GenerateConfig
    from rollout.contract import convert

    return convert.structure({
        "input": source, "output": output, "backend": args.backend, "model": model,
        "sampling": {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 1.0,
                     "seed": 1},
        "chunk_size": args.chunk_size, "replicas": args.replicas, "ray_data": ray_data},
        GenerateConfig)


def options(backend: str, batch: int) -> dict:
    """The same engine batch on each backend."""
    if backend == "hf":
        return {"batch_size": batch}
    return {**VLLM, "engine_args": {"max_num_seqs": batch}}


def run_driver_job(config, batch: int) -> dict:
    from rollout.apps.jobs import run_job

    # config.replicas local replica processes, as `rollout generate --replicas` starts.
    return run_job(config, options(config.backend, batch), progress=False)


def run_ray_data_job(config, batch: int) -> dict:
    from rollout.apps.jobs.ray_data import RayDataJob

    return RayDataJob(config).run(options(config.backend, batch), progress=False)


def run_ray_llm(config, batch: int) -> dict:
    """Ray's own LLM batch API on the same prompts, sampling and engine count."""
    import pyarrow.parquet as pq
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    sampling = {"max_tokens": config.sampling.max_tokens, "ignore_eos": True,
                "temperature": 1.0, "seed": 1}
    processor = build_processor(
        vLLMEngineProcessorConfig(
            model_source=config.model, engine_kwargs={**VLLM, "max_num_seqs": batch},
            concurrency=config.replicas, batch_size=config.chunk_size,
            placement_group_config={"bundles": [{"CPU": 1}]}, chat_template_stage=False),
        preprocess=lambda row: {"prompt": row["prompt"], "sampling_params": sampling},
        postprocess=lambda row: {"tokens": row["num_generated_tokens"]})
    rows = processor(ray.data.from_arrow(pq.read_table(config.input))).take_all()
    return {"completion_tokens": sum(int(r["tokens"]) for r in rows),
            "errors": len(pq.read_table(config.input)) - len(rows)}


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started (getrusage's would count the
    parent's, which it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def one_run(args) -> None:
    """The child: one job, then its figures as the last line of stdout."""
    config = job_config(args.input, args.output, args.model_dir, args, args.mode == "ray-data")
    run = {"driver": run_driver_job, "ray-data": run_ray_data_job,
           "ray-llm": run_ray_llm}[args.mode]
    if args.backend == "vllm":
        from common import prepare_engine

        prepare_engine("vllm")
    if args.mode != "driver":  # a running cluster, as a job finds it: its start not timed
        import ray

        # Logical CPUs: one per actor, and room for Ray Data's own work on a small machine.
        ray.init(num_cpus=config.replicas + 2, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    stats = run(config, args.batch)
    print(json.dumps({"seconds": time.perf_counter() - started,
                      "peak_rss_mb": peak_rss_mb(),
                      "tokens": stats["completion_tokens"], "errors": stats["errors"]}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128, help="each replica's engine batch")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--backend", choices=BACKENDS, default="hf")
    parser.add_argument("--modes", default="driver,ray-data",
                        help="which jobs to run, of driver, ray-data, ray-llm (ray.data.llm, "
                             "--backend vllm)")
    parser.add_argument("--mode", choices=["driver", "ray-data", "ray-llm"],
                        help=argparse.SUPPRESS)
    for hidden in ("--input", "--output", "--model-dir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return one_run(args)

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollout.kit.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(tmp))
        source = f"{tmp}/prompts.parquet"
        pq.write_table(pa.table({"prompt": prompts(args.rows)}), source)
        results: dict[str, list[dict]] = {mode: [] for mode in args.modes.split(",")}
        for round_ in range(args.rounds):
            for mode in results:
                output = f"{tmp}/out-{mode}-{round_}" + (".parquet" if mode == "driver" else "")
                command = [sys.executable, __file__, "--mode", mode, "--input", source,
                           "--output", output, "--model-dir", model,
                           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                             if k in ("rows", "replicas", "tokens", "chunk_size", "batch",
                                      "backend"))]
                done = subprocess.run(command, capture_output=True, text=True, check=False,
                                      cwd=Path(__file__).parent, timeout=3600)
                if done.returncode:
                    sys.exit(f"{mode} failed:\n{done.stderr[-4000:]}")
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                assert figures["errors"] == 0 and figures["tokens"] == args.rows * args.tokens
                results[mode].append(figures)
                print(f"round {round_ + 1} {mode:8s} {figures['seconds']:8.1f} s "
                      f"{figures['tokens'] / figures['seconds']:9.0f} tokens/s  driver peak "
                      f"RSS {figures['peak_rss_mb']:.0f} MB", flush=True)
    best = {mode: min(runs, key=lambda r: r["seconds"]) for mode, runs in results.items()}
    print(f"\n{args.rows} prompts x {args.tokens} tokens, {args.backend}, {args.replicas} "
          f"replicas")
    if "driver" in best:
        print(f"Ray Data throughput / single driver = "
              f"{best['driver']['seconds'] / best['ray-data']['seconds']:.2f} (target >= 0.9); "
              f"driver peak RSS {best['driver']['peak_rss_mb']:.0f} MB (single driver) vs "
              f"{best['ray-data']['peak_rss_mb']:.0f} MB (Ray Data)")
    if "ray-llm" in best:
        print(f"rollout --ray-data throughput / ray.data.llm = "
              f"{best['ray-llm']['seconds'] / best['ray-data']['seconds']:.2f}; ray.data.llm "
              f"driver peak RSS {best['ray-llm']['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
