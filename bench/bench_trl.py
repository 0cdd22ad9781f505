"""TRL's `GRPOTrainer` (its own transformers generation) against examples/grpo.py (a
`rollout` backend as the sampler, vLLM by default) on the same GRPO run, each at its best
setting on these cores: TRL's loop as it is, grpo.py with `--async 1` (sampling one batch
ahead while the trainer trains, the engine yielding the cores to it; one step off-policy,
with truncated importance weights; `--async 0`: its synchronous loop).

The task is examples/grpo.py's `--task sums` on SmolLM2-135M-Instruct: "What is a + b? Reply
with only the number.", reward 1 when the answer's last number is the sum. Both sides take
the training pairs in the same order (`sums.split(seed)[0]`, `--prompts` a step), `--group`
samples each at temperature 1 (no top-p, top-k or repetition penalty), at most `--max-tokens`
new tokens, one Adam step of `--lr` per batch (constant, no weight decay), no KL term, the
same seed. Our loss, -(mean over samples of advantage x the sum of its token logprobs) with
advantages (r - group mean) / (group std + 1e-4), is TRL's `loss_type="dr_grpo"` with
`scale_rewards="group"` divided by `--max-tokens`; with TRL's gradient clipping at
1 / `--max-tokens` (ours: 1.0) and its Adam epsilon at 1e-8 / `--max-tokens` (ours: 1e-8), its
updates are ours exactly. The sampling itself differs (each
engine's own random numbers), so rewards agree only within noise.

Printed per side: the mean training reward over the last 5 steps, the held-out greedy
accuracy before and after training (TRL's model scored with transformers `generate`, the same
chat template and token limit), seconds per step (mean from step 2 on: step 1 warms up) with
the part spent sampling (TRL: generating and scoring), and the ratios. Target: rewards equal within noise, TRL s/step / rollout s/step >= 1.5.

A third side, `trl+rollout`, is TRL's trainer unchanged but for
`rollout_func=rollout.integrations.trl.RolloutFunc(sampler)`: it samples from the same
`rollout` backend and pushes the trainer's weights into it before each step's sampling.

Run in the vLLM environment with TRL added (one environment holds both):
    source scripts/env.sh vllm requirements/test.txt requirements/trl.txt
    pip install --no-deps -e . -e plugins/hf_backend -e plugins/vllm_backend
    python bench/bench_trl.py [--steps 20] [--seed 0] [--backend vllm] [--async 1]
        [--sides rollout,trl,trl+rollout]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# vLLM on CPU: a KV cache that fits a small machine, and no model hub anywhere. (Its worker
# stays in a process of its own, vLLM's default there, which the engine's `nice` needs.)
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
VLLM_OPTIONS = ["dtype=float32", "enforce_eager=true"]
WINDOW = 5  # steps the final training reward is averaged over
SIDES = ("rollout", "trl", "trl+rollout")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--held-out", type=int, default=100)
    parser.add_argument("--model", default="smollm2", help="model folder or known name")
    parser.add_argument("--backend", default="vllm", help="rollout's sampler: vllm, hf, ...")
    parser.add_argument("--async", dest="eta", type=int, default=1, metavar="ETA",
                        help="examples/grpo.py's --async (its best setting on shared cores: "
                        "1; 0: the synchronous loop)")
    parser.add_argument("--check-every", type=int, default=10, metavar="N",
                        help="examples/grpo.py's logprob check every N steps (TRL runs none; "
                        "under --async a check of older tokens costs a forward pass)")
    parser.add_argument("--backend-option", action="append", default=None, metavar="K=V",
                        help="for the backend (repeatable); vLLM's default: "
                        + " ".join(VLLM_OPTIONS))
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="which of " + ", ".join(SIDES) + " to run (comma-separated)")
    args = parser.parse_args()
    args.sides = args.sides.split(",")
    if set(args.sides) - set(SIDES) or "trl" not in args.sides and len(args.sides) > 1:
        parser.error(f"--sides: some of {', '.join(SIDES)}; with trl to compare against")
    if args.backend_option is None:
        args.backend_option = VLLM_OPTIONS if args.backend == "vllm" else []
    return args


# --- rollout: examples/grpo.py in a child process ------------------------------------------

def run_rollout(args: argparse.Namespace, model_dir: str) -> dict:
    """examples/grpo.py --task sums with the same settings; its per-step log gives the
    step times, its summary line the rewards and accuracies."""
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        log = Path(tmp) / "steps.jsonl"
        argv = [sys.executable, str(ROOT / "examples" / "grpo.py"), "--task", "sums",
                "--model", model_dir, "--backend", args.backend,
                *[a for option in args.backend_option for a in ("--backend-option", option)],
                "--steps", str(args.steps), "--prompts", str(args.prompts),
                "--group-size", str(args.group), "--max-tokens", str(args.max_tokens),
                "--temperature", "1.0", "--lr", str(args.lr), "--seed", str(args.seed),
                "--held-out", str(args.held_out), "--async", str(args.eta),
                "--check-every", str(args.check_every),
                "--log", str(log)]
        print("rollout:", " ".join(argv[1:]), flush=True)
        started = time.perf_counter()
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env={**os.environ, **CPU_ENV})
        summary, output = None, []
        for line in child.stdout:
            output.append(line)
            if line.startswith(("step ", "after ", "{")):  # grpo.py's own lines, not vLLM's log
                print("  [rollout]", line.rstrip(), flush=True)
            if line.startswith("{"):
                summary = json.loads(line)
        if child.wait() != 0 or summary is None:
            sys.stdout.writelines(output[-60:])
            sys.exit(f"examples/grpo.py failed (exit {child.returncode})")
        wall = time.perf_counter() - started
        entries = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in entries if "reward" in e]
    return {"rewards": [e["reward"] for e in steps], "step_s": [e["step_s"] for e in steps],
            "sample_s": [e["sample_s"] for e in steps],
            "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], "wall_s": wall}


# --- TRL: GRPOTrainer in this process ------------------------------------------------------

def text_of(completion) -> str:
    """A completion as TRL hands it to a reward function: messages for chat prompts."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def sums_reward(completions, answer, **_) -> list[float]:
    from rollout.apps.datasets import sums

    return [float(sums.is_right(text_of(c), a)) for c, a in zip(completions, answer)]


def greedy_accuracy(model, tokenizer, held_out, max_tokens: int, batch: int = 25) -> float:
    """The share of held-out pairs answered right, greedily with transformers `generate`:
    the chat template rendered as rollout renders it (text, then tokens without special
    tokens added), prompts left-padded."""
    import torch
    from transformers import GenerationConfig

    from rollout.apps.datasets import sums

    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens,
                              pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=model.generation_config.eos_token_id)
    model.eval()
    right = 0
    for first in range(0, len(held_out), batch):
        pairs = held_out[first:first + batch]
        ids = [tokenizer(tokenizer.apply_chat_template(sums.messages(a, b), tokenize=False,
                                                       add_generation_prompt=True),
                         add_special_tokens=False).input_ids for a, b in pairs]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask,
                                 generation_config=config)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        right += sum(sums.is_right(t, a + b) for t, (a, b) in zip(texts, pairs))
    return right / len(held_out)


def run_trl(args: argparse.Namespace, model_dir: str, rollout_func=None) -> dict:
    """TRL's GRPOTrainer; with `rollout_func`, sampling through it instead of transformers."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout.apps.datasets import sums

    class Steps(TrainerCallback):
        """Seconds per optimizer step, from the end of the previous one (data, generation,
        rewards, forward, backward, clipping, optimizer, logging), and TRL's logged reward."""

        def __init__(self):
            self.step_s, self.sample_s, self.rewards, self.last = [], [], [], None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.last is None:
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])
                print(f"  [trl] step {state.global_step:3d}  reward {logs['reward']:.3f}  "
                      f"mean length {logs['completions/mean_length']:.1f}  "
                      f"{self.step_s[-1]:.2f} s (sample {self.sample_s[-1]:.2f})", flush=True)

    class Trainer(GRPOTrainer):
        """TRL's trainer as is; only its generation and scoring are timed."""

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timer.sample_s.append(time.perf_counter() - started)
            return out

    started = time.perf_counter()
    train, held_out = sums.split(args.seed, held_out=args.held_out)
    # grpo.py's order: step k takes pairs (k-1)*prompts ... k*prompts - 1, wrapping around.
    needed = args.steps * args.prompts
    pairs = [train[i % len(train)] for i in range(needed)]
    dataset = Dataset.from_list([{"prompt": sums.messages(a, b), "answer": a + b}
                                 for a, b in pairs])

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = greedy_accuracy(model, tokenizer, held_out, args.max_tokens)
    print(f"  [trl] held-out greedy accuracy before {before:.3f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=args.steps, seed=args.seed,
            # One generation batch per optimizer step, used once (on-policy): 2 prompts x 8.
            per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group, steps_per_generation=1, num_iterations=1,
            gradient_accumulation_steps=1,
            # The prompts in the dataset's order (TRL shuffles by default).
            shuffle_dataset=False,
            # Sampling: temperature 1 over the raw distribution.
            max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
            min_p=None, repetition_penalty=1.0,
            # The loss: no KL, group-scaled advantages, sum over tokens / a constant
            # (max_completion_length x samples), truncated completions kept.
            beta=0.0, loss_type="dr_grpo", scale_rewards="group",
            mask_truncated_completions=False, top_entropy_quantile=1.0,
            # Optimizer: Adam (TRL's default AdamW, fused, without decay), constant lr; the
            # clipping norm and Adam's epsilon scaled as the loss is, so the updates are ours.
            learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8 / args.max_tokens,
            max_grad_norm=1.0 / args.max_tokens,
            # As grpo.py's trainer: float32, no dropout, no gradient checkpointing (TRL turns
            # it on by default: about 20% slower, it says).
            use_cpu=True, bf16=False, disable_dropout=True, gradient_checkpointing=False,
            # The reward reads the `answer` column.
            remove_unused_columns=False,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        )
        timer = Steps()
        trainer = Trainer(model=model, reward_funcs=sums_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[timer],
                          rollout_func=rollout_func)
        trainer.remove_callback(PrinterCallback)  # its whole log dict every step
        trainer.train()
        after = greedy_accuracy(trainer.model, tokenizer, held_out, args.max_tokens)
    print(f"  [trl] held-out greedy accuracy after {after:.3f}", flush=True)
    return {"rewards": timer.rewards, "step_s": timer.step_s, "sample_s": timer.sample_s,
            "accuracy_before": before,
            "accuracy_after": after, "wall_s": time.perf_counter() - started}


# --- the report ----------------------------------------------------------------------------

def mean_after_first(values: list[float]) -> float:
    return statistics.fmean(values[1:] if len(values) > 1 else values)


def main() -> None:
    import warnings

    args = parse_args()
    # TRL 1.16 names vLLM 0.22 to 0.31 on import; its vLLM path is not used here.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    import rollout.kit.models

    model_dir = rollout.kit.models.resolve(args.model)
    print(f"{args.steps} steps, {args.prompts} prompts x {args.group} samples, max "
          f"{args.max_tokens} tokens, lr {args.lr:g}, seed {args.seed}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results = {}
    if "rollout" in args.sides:
        results[f"rollout-{args.backend} eta {args.eta}"] = run_rollout(args, model_dir)
    if "trl" in args.sides:
        results["trl"] = run_trl(args, model_dir)
    if "trl+rollout" in args.sides:
        from rollout.integrations.trl import RolloutFunc

        options = {k.replace("-", "_"): yaml.safe_load(v) for k, _, v in
                   (o.partition("=") for o in args.backend_option)}
        with rollout.load_backend(args.backend, model_dir, **options) as sampler:
            results[f"trl+rollout-{args.backend}"] = run_trl(args, model_dir,
                                                             RolloutFunc(sampler))
    load = os.getloadavg()

    window = min(WINDOW, args.steps)
    print(f"\nreward: the mean over the last {window} steps; s/step and sampling (its part "
          "spent sampling): means from step 2 on")
    print(f"  {'':20s} {'reward':>7s} {'acc before':>10s} {'acc after':>9s} "
          f"{'s/step':>7s} {'sampling':>8s} {'wall s':>7s}")
    summary = {"steps": args.steps, "seed": args.seed, "backend": args.backend,
               "load_average": [round(x, 2) for x in load]}
    for name, r in results.items():
        r["last_reward"] = statistics.fmean(r["rewards"][-window:])
        r["mean_step_s"] = mean_after_first(r["step_s"])
        r["mean_sample_s"] = mean_after_first(r["sample_s"])
        print(f"  {name:20s} {r['last_reward']:7.3f} {r['accuracy_before']:10.3f} "
              f"{r['accuracy_after']:9.3f} {r['mean_step_s']:7.2f} {r['mean_sample_s']:8.2f} "
              f"{r['wall_s']:7.1f}")
        summary[name] = {k: (round(v, 4) if isinstance(v, float) else
                             [round(x, 4) for x in v] if isinstance(v, list) else v)
                         for k, v in r.items()}
    trl = results.get("trl")
    for name, ours in results.items():
        if name == "trl" or trl is None:
            continue
        speedup = trl["mean_step_s"] / ours["mean_step_s"]
        # Both sides train on the same prompts step by step: compare them step by step.
        diffs = [a - b for a, b in zip(ours["rewards"][-window:], trl["rewards"][-window:])]
        error = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        print(f"  {name}: s/step ratio (TRL / it) {speedup:.2f} (target >= 1.5); sampling "
              f"alone {trl['mean_sample_s'] / ours['mean_sample_s']:.2f}; reward difference "
              f"(it - TRL) {ours['last_reward'] - trl['last_reward']:+.3f} +- {error:.3f} "
              "(standard error of the step-by-step difference); held-out accuracy after, "
              f"difference {ours['accuracy_after'] - trl['accuracy_after']:+.3f}")
        summary[name].update(speedup=round(speedup, 3),
                             reward_difference=round(ours["last_reward"] - trl["last_reward"], 4),
                             reward_difference_stderr=round(error, 4))
    print(f"  load average at the end: {' '.join(f'{x:.2f}' for x in load)}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
