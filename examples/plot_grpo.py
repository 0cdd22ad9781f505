"""Reward curves from examples/grpo.py's (and grpo_agent.py's) `--log` files: one line per run (engine and mode),
training reward per step (a moving mean over `--window` steps) and held-out greedy accuracy,
saved as a PNG; and a Markdown table of what each run measured.

    python examples/plot_grpo.py hf.jsonl vllm.jsonl sglang.jsonl -o docs/rl-curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_run(path: str) -> dict:
    steps, evals, label, eta = [], [], Path(path).stem, 0
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        replicas = entry.get("replicas") or 0
        eta = entry.get("eta", eta)  # (on step lines only)
        label = entry["backend"] + (f", {replicas} replicas" if replicas else ", in process")
        label += f", async {eta}" if eta else ""
        label += f", through {entry['agent']}" if entry.get("agent") else ""
        (evals if "accuracy" in entry else steps).append(entry)
    return {"label": label, "steps": steps, "evals": evals}


def moving_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(values))]


def table(runs: list[dict]) -> str:
    rows = ["| run | steps | held-out accuracy before | after | gain (points) | "
            "s/step | sample | train | push | (sample + push) / step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        steps, evals = run["steps"], run["evals"]
        timed = steps[1:] or steps  # the first step pays for warm-up
        mean = {k: sum(s[k] for s in timed) / len(timed)
                for k in ("step_s", "sample_s", "train_s", "push_s")}
        before, after = evals[0]["accuracy"], evals[-1]["accuracy"]
        rows.append(f"| {run['label']} | {len(steps)} | {before:.2f} | {after:.2f} | "
                    f"{100 * (after - before):+.0f} | {mean['step_s']:.1f} | "
                    f"{mean['sample_s']:.1f} | {mean['train_s']:.1f} | {mean['push_s']:.2f} | "
                    f"{(mean['sample_s'] + mean['push_s']) / mean['step_s']:.2f} |")
    return "\n".join(rows)


TITLE = "GRPO on SmolLM2-135M-Instruct: small sums (examples/grpo.py --task sums)"


def plot(runs: list[dict], out: str, window: int, by_time: bool = False,
         title: str = TITLE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = [s["step"] for s in run["steps"]]
        # Seconds of training steps so far (evaluations not counted), or step numbers.
        at, spent = {0: 0.0}, 0.0
        for s in run["steps"]:
            spent += s["step_s"]
            at[s["step"]] = spent
        x = [at[k] for k in steps] if by_time else steps
        line, = left.plot(x, moving_mean([s["reward"] for s in run["steps"]], window),
                          label=run["label"])
        evals = [e for e in run["evals"] if e["step"] in at]
        right.plot([at[e["step"]] if by_time else e["step"] for e in evals],
                   [e["accuracy"] for e in evals],
                   marker="o", color=line.get_color(), label=run["label"])
    xlabel = "seconds of training steps" if by_time else "step"
    left.set(xlabel=xlabel, ylabel=f"training reward (mean of {window} steps)",
             title="Mean reward of the sampled answers")
    right.set(xlabel=xlabel, ylabel="accuracy", ylim=(0, 1),
              title="Held-out sums, greedy, through the sampler")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="--log files of examples/grpo.py")
    parser.add_argument("-o", "--output", default="grpo.png")
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--by-time", action="store_true",
                        help="against the seconds the steps took, not the step number")
    parser.add_argument("--title", default=TITLE)
    args = parser.parse_args(argv)
    runs = [read_run(path) for path in args.logs]
    plot(runs, args.output, args.window, args.by_time, args.title)
    print(table(runs))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
