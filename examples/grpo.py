"""A small GRPO loop: a torch trainer in this process, a rollout backend as its sampler.

Each step samples a group of completions per prompt from the backend, scores them with a
verifiable reward, takes one policy-gradient step in the trainer and pushes the new weights
to the backend with `update_weights`. With `--async ETA` (default 0, the synchronous
loop) the sampling of the next batches overlaps training: up to ETA + 1 batches are
sampled ahead of the trainer (rollout.apps.rl.GroupSampler), pushes let running samples
go on under the new weights (`pause="keep"`), and the loss weights each token by its
truncated importance ratio against the weights that sampled it. Two checks prove that the
sync works:

- every token's weight version (`Result.weight_versions`) is within ETA of the trainer's;
- the backend's logprob of every sampled token equals the trainer's own forward pass
  under the weights of that token's version, within `--tolerance` (the trainer keeps the
  last ETA versions' weights for this). With `--pause keep_kv` (where the backend offers
  it) running samples keep their KV cache across a push, so their tokens after it are not
  exact: the check covers the others, and the log shows their largest gap apart.

The trainer's logprob is `log_softmax(logits / --temperature)`, the engine's the processed
one (the distribution it drew from, `logprobs_mode`). With `--top-p` below 1 the engine
draws from a truncation of it: `--renormalise` asks the engine for each token's sampling
mask and renormalises the trainer's distribution over it, which makes the two equal again;
without it the check is skipped and the log shows how far apart they are (the k3 KL, the
importance ratio's mean and quantiles, the share outside [0.9, 1.1]), which `--correction`
(truncated or masked importance sampling, per token or per sequence) weighs the loss by.

Two tasks. `--task letter` (the default, on the project's tiny random model): the reward is
the fraction of generated tokens whose text contains `--target`, so even a random model
learns it within a few dozen steps. `--task sums` (on the real SmolLM2-135M-Instruct, see
rollout.kit.models): "What is a + b? Reply with only the number.", reward 1 when the
answer's last number is the sum; held-out pairs are scored greedily before and after
training (`--eval-every` also on the way). The backend is chosen by configuration alone;
the same code runs on every backend:

    python examples/grpo.py --backend hf --steps 30 --check
    python examples/grpo.py --task sums --backend vllm --backend-option dtype=float32 \
        --steps 60 --log run.jsonl
    python examples/grpo.py --backend vllm --backend-option dtype=float32
    python examples/grpo.py --config grpo.yaml   # the same keys as the flags
    python examples/grpo.py --backend hf --replicas 2   # replica processes, pushed over shm
    python examples/grpo.py --task sums --async 1   # sampling overlaps training, on every core
    python examples/grpo.py --task sums --async 1 --backend vllm \
        --backend-option dtype=float32   # the engine at nice 19: the trainer's cores first
    python examples/grpo.py --server http://127.0.0.1:8000 --model DIR   # a rollout serve

With `--lora RANK` the trainer trains a LoRA adapter of that rank on every linear layer
(peft; alpha 32, the learning rate times 10, as LoRA needs) and pushes only the adapter each
step (`load_adapter`); the prompts name it. The logprob check then holds each token to the
adapter version that made it (`Result.adapter_version`). Synchronous loop only:

    python examples/grpo.py --task sums --backend hf --lora 16 --steps 60 --log lora.jsonl

Without `--model`, the letter task builds the project's tiny model (nothing is downloaded)
and the sums task uses `smollm2`. `--log FILE` writes one JSON line per step and per
evaluation; examples/plot_grpo.py draws the reward curves from such files.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys
import tempfile
import time

import yaml

import rollout
import rollout.kit.models
from rollout.apps.datasets import sums
from rollout.apps.rl import (CORRECTIONS, GroupSampler, first_and_later_gaps, importance_weights,
                             mismatch)
from rollout.contract.plugins import load_factory
from rollout.kit.process import NICEST
from rollout.service.served import open_sampler

WORDS = "the ka lo mi ne su ta ri po def return print x y if for".split()
ADAPTER = "policy"  # the adapter that --lora trains and pushes
LORA_ALPHA = 32
LORA_LR_SCALE = 10  # LoRA's learning rate against full fine-tuning's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a YAML file with the same keys as the flags")
    parser.add_argument("--task", default="letter", choices=("letter", "sums"))
    parser.add_argument("--backend", default="hf", help="hf, vllm, sglang, ...")
    parser.add_argument("--backend-option", action="append", default=[], metavar="K=V",
                        help="passed to the backend's constructor (repeatable)")
    parser.add_argument("--model", help="model folder or known name; default: the tiny model "
                        "(letter), smollm2 (sums)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="sample from N replica processes instead of this process")
    parser.add_argument("--server", help="sample from a running `rollout serve` at this URL")
    parser.add_argument("--api-key", help="the server's API key")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--async", dest="eta", type=int, default=0, metavar="ETA",
                        help="sample up to ETA batches ahead of the trainer (0: synchronous)")
    parser.add_argument("--pause", default="keep", choices=("keep", "keep_kv"),
                        help="what a push does to running samples (update_weights' pause)")
    parser.add_argument("--tis-cap", type=float, default=2.0,
                        help="the truncation (tis) or mask (mis) bound of importance ratios")
    parser.add_argument("--correction", default="tis", choices=CORRECTIONS,
                        help="importance weights in the loss (rollout.apps.rl.mismatch)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--renormalise", action="store_true",
                        help="the trainer's distribution renormalised over each token's "
                             "sampling mask (return_sampling_mask)")
    parser.add_argument("--device", default="cpu", help="the trainer's torch device")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the trainer (and of an in-process engine); "
                        "0: torch's default")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="full fine-tuning's; with --lora, LORA_LR_SCALE times it")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train and push a LoRA adapter of this rank (0: full weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="a", help="the reward counts tokens containing it")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest allowed |backend logprob - trainer logprob|")
    parser.add_argument("--check-every", type=int, default=1, metavar="N",
                        help="check the logprobs every N steps (under --async, tokens of "
                        "older versions cost the trainer a forward pass of those weights)")
    parser.add_argument("--held-out", type=int, default=100,
                        help="sums: held-out pairs scored greedily before and after")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="sums: also score the held-out pairs every N steps")
    parser.add_argument("--log", help="write one JSON line per step and evaluation here")
    parser.add_argument("--check", action="store_true",
                        help="exit non-zero unless the reward rose")
    args = parser.parse_args(argv)
    if args.config:  # the file gives the defaults; flags given on the command line win
        with open(args.config) as f:
            config = {k.replace("-", "_"): v for k, v in (yaml.safe_load(f) or {}).items()}
        if "async" in config:
            config["eta"] = config.pop("async")
        unknown = set(config) - set(vars(args))
        if unknown:
            parser.error(f"unknown keys in {args.config}: {', '.join(sorted(unknown))}")
        if isinstance(config.get("backend_option"), dict):  # a mapping reads better in YAML
            config["backend_option"] = [f"{k}={v}" for k, v in config["backend_option"].items()]
        parser.set_defaults(**config)
        args = parser.parse_args(argv)
    if args.lora < 0 or (args.lora and args.eta):
        parser.error("--lora takes a rank >= 1, with --async 0 (a sample holds one adapter "
                     "version, so none may run across a push)")
    return args


def backend_options(pairs: list[str]) -> dict:
    """`k=v` strings to keyword arguments; values read as YAML, so 2 is an int, true a bool."""
    options = {}
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if not sep:
            sys.exit(f"--backend-option wants k=v, got {pair!r}")
        options[key.replace("-", "_")] = yaml.safe_load(value)
    return options


def sampler_options(args: argparse.Namespace) -> dict:
    """The backend's options. With --async and the trainer on the CPU, an engine that can
    yield the cores (a backend with a `nice` option: vLLM, SGLang) runs at the lowest
    priority unless told otherwise: training gets the shared cores first and sampling what
    is left, so the overlap slows training as little as it can (docs/rl-loop.md)."""
    options = backend_options(args.backend_option)
    if (args.eta and args.device == "cpu" and not args.server and "nice" not in options
            and "nice" in inspect.signature(load_factory(args.backend)).parameters):
        options["nice"] = NICEST
    return options


class LetterTask:
    """The same few prompts every step; the reward is the fraction of a sample's tokens
    whose text contains the target (an EOS counts too). No held-out set."""

    def __init__(self, args: argparse.Namespace, tokenizer):
        self.good = {i for i in range(len(tokenizer))
                     if args.target in tokenizer.decode([i], skip_special_tokens=True)}
        self.prompts = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(3 + i % 4))
                        for i in range(args.prompts)]
        self.held_out: list = []

    def batch(self, step: int) -> list[tuple[dict, object]]:
        return [({"prompt": p}, None) for p in self.prompts]

    def score(self, result, answer) -> float:
        return sum(t in self.good for t in result.token_ids) / max(len(result.token_ids), 1)


class SumsTask:
    """Chat prompts "What is a + b?" over training pairs in a seeded order; reward 1 when
    the answer's last number is the sum. Held-out pairs are never trained on."""

    def __init__(self, args: argparse.Namespace, tokenizer):
        self.train, held_out = sums.split(args.seed, held_out=args.held_out)
        self.held_out = [({"messages": sums.messages(a, b)}, a + b) for a, b in held_out]
        self.per_step = args.prompts

    def batch(self, step: int) -> list[tuple[dict, object]]:
        first = (step - 1) * self.per_step
        pairs = [self.train[(first + i) % len(self.train)] for i in range(self.per_step)]
        return [({"messages": sums.messages(a, b)}, a + b) for a, b in pairs]

    def score(self, result, answer) -> float:
        return float(sums.is_right(result.text, answer))


TASKS = {"letter": LetterTask, "sums": SumsTask}


def sequence_logprobs(model, results, temperature: float = 1.0) -> list:
    """The trainer's logprob of each sampled token, one tensor per result, with gradients:
    of `log_softmax(logits / temperature)`, renormalised over each token's sampling mask
    where the result has them (the set the engine drew it from).
    One right-padded batch: causal attention keeps padding from reaching real tokens. The
    output layer runs only where a sampled token is predicted: over a 49k vocabulary it is
    most of the memory of a forward pass over whole prompts."""
    import torch

    seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in results]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    hidden = model.get_decoder()(input_ids=ids.to(model.device),
                                 attention_mask=mask.to(model.device)).last_hidden_state
    out = []
    for i, r in enumerate(results):
        start, n = len(r.prompt_token_ids), len(r.token_ids)
        # Position t predicts token t + 1.
        logits = model.get_output_embeddings()(hidden[i, start - 1 : start - 1 + n]).float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        picked = torch.tensor(r.token_ids, device=model.device).unsqueeze(1)
        chosen = logprobs.gather(1, picked).squeeze(1)
        drawn_from = getattr(r, "sampling_mask", None)  # (a session's branch has none)
        if drawn_from is not None:
            chosen = chosen - torch.stack([logprobs[t, list(ids)].logsumexp(-1)
                                           for t, ids in enumerate(drawn_from)])
        out.append(chosen)
    return out


class Versions:
    """The trainer's weights of the versions a batch may hold tokens of (the last `eta`
    besides the current one), and each token's logprob under its version's."""

    def __init__(self, model, eta: int, adapter: bool = False, temperature: float = 1.0):
        # With --lora a result's version is its adapter's: the base weights never change.
        self.model, self.eta, self.adapter = model, eta, adapter
        self.temperature = temperature
        self.saved: dict[int, dict] = {}
        self.scratch = None  # a second model that old versions are loaded into
        self.add(0)

    @staticmethod
    def label(version: int | None) -> int:
        return 0 if version is None else version  # tokens before the first push

    def spans(self, results) -> list[tuple[int, int]]:
        """(version, tokens) for each run of the results' tokens made by one version."""
        if self.adapter:
            return [(self.label(r.adapter_version), r.completion_tokens) for r in results]
        return [(self.label(x.version), x.end - x.start)
                for r in results for x in r.weight_versions]

    def of(self, results) -> set[int]:
        """The versions that made the results' tokens."""
        return {version for version, _ in self.spans(results)}

    def add(self, version: int) -> None:
        if self.eta:
            self.saved[version] = {k: v.detach().clone()
                                   for k, v in self.model.state_dict().items()}
            self.saved.pop(version - self.eta - 1, None)

    def logprobs_under(self, current: int, results, current_logprobs):
        """The version check's callable: the trainer's own pass for the current version, a
        pass of the scratch model under a saved version's weights for an older one. With
        --lora every token is of the current adapter version (the synchronous loop, whose
        first check holds it), which it sees as the weights' one version."""
        import copy

        import torch

        mine = {id(r): lp.detach() for r, lp in zip(results, current_logprobs)}

        def under(version, holding):
            if self.adapter or self.label(version) == current:
                return [mine[id(r)] for r in holding]
            if self.scratch is None:
                self.scratch = copy.deepcopy(self.model)
            self.scratch.load_state_dict(self.saved[self.label(version)])
            with torch.no_grad():
                return sequence_logprobs(self.scratch, holding, self.temperature)
        return under


def adapter_tensors(model):
    """The adapter's tensors under PEFT's names, as `load_adapter` takes them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model).items()


def accuracy(sampler, task, max_tokens: int, adapter: str | None) -> float:
    """The share of held-out prompts answered right under greedy decoding."""
    requests = [{**fields, "adapter": adapter,
                 "sampling": {"temperature": 0.0, "max_tokens": max_tokens}}
                for fields, _ in task.held_out]
    completions = sampler.generate(requests)
    right = sum(task.score(c.unwrap()[0], answer)
                for c, (_, answer) in zip(completions, task.held_out))
    return right / len(task.held_out)


def main(argv: list[str] | None = None) -> int:
    return with_model(parse_args(argv), train)


def with_model(args: argparse.Namespace, train) -> int:
    """`train(args, folder)` on `--model`, or else the task's: smollm2 for the sums, the
    tiny model (built here) for the letter task."""
    if args.model is not None:
        return train(args, rollout.kit.models.resolve(args.model))
    if args.task == "sums":
        return train(args, rollout.kit.models.resolve("smollm2"))
    from rollout.kit.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="grpo-tiny-") as tmp:
        return train(args, str(build_tiny_model(tmp)))


def train(args: argparse.Namespace, model_dir: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    if args.threads:  # one process, one thread count: the trainer's and an in-process engine's
        torch.set_num_threads(args.threads)
    # The trainer: float32, and eval() so the forward pass is the one the sampler runs
    # (no dropout); gradients still flow.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.to(args.device)
    lora = None  # the adapter's LoraConfig, as a dict, with --lora
    if args.lora:
        from peft import LoraConfig, get_peft_model

        from rollout.weights.lora import pack_adapter

        model = get_peft_model(model, LoraConfig(
            r=args.lora, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear"))
        lora = model.peft_config["default"].to_dict()
        pack_adapter(model)  # one block: each step's push is one copy
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=args.lr * (LORA_LR_SCALE if args.lora else 1))

    # The sampler: which engine, and where it runs, is configuration only. Served ones
    # take the same calls; their weights travel through shared memory.
    sampler = open_sampler(args.backend, model_dir, sampler_options(args),
                           args.replicas, server=args.server, api_key=args.api_key)
    # Some engines cannot seed a request (SGLang on CPU); then sampling is merely unseeded.
    seeded = sampler.capabilities.supports("seed")

    task = TASKS[args.task](args, tokenizer)
    log = open(args.log, "w") if args.log else None

    def record(entry: dict) -> None:
        if log:
            log.write(json.dumps({"backend": args.backend, "replicas": args.replicas,
                                  "task": args.task, **entry}) + "\n")
            log.flush()

    def evaluate(step: int) -> float | None:
        if not task.held_out:
            return None
        score = accuracy(sampler, task, args.max_tokens, lora and ADAPTER)
        print(f"after {step:3d} steps  held-out greedy accuracy {score:.3f}", flush=True)
        record({"step": step, "accuracy": score})
        return score

    def score(request, results) -> list[float]:
        return [task.score(r, request.metadata["answer"]) for r in results]

    # Logprobs of the distribution the engine drew from (the raw one at temperature 1 and
    # top-p 1: every backend's default), and the sets it drew from where asked.
    transformed = {"logprobs_mode": "processed"} \
        if args.temperature != 1 or args.top_p < 1 else {}
    if args.renormalise:
        transformed["return_sampling_mask"] = True

    # Every batch's prompts, in order; the group sampler takes them as the bound allows.
    def prompts():
        for step in itertools.count(1):
            for i, (fields, answer) in enumerate(task.batch(step)):
                yield {**fields, "id": f"s{step}-{i}", "metadata": {"answer": answer},
                       "adapter": lora and ADAPTER,
                       "sampling": {"temperature": args.temperature,
                                    "max_tokens": args.max_tokens, "logprobs": 0,
                                    "top_p": args.top_p, **transformed,
                                    # A seed of its own per prompt, the same from run to run.
                                    **({"seed": args.seed * 1_000_003 + step * 1000 + i * 64}
                                       if seeded else {})}}

    rewards_per_step, worst_diff, timings = [], 0.0, []
    # The weights of the versions a batch may still hold tokens of, for the logprob check.
    kept = Versions(model, args.eta, adapter=lora is not None, temperature=args.temperature)
    # The engine drew from exactly the trainer's distribution (the logprob check holds)
    # unless top-p truncated it and the trainer does not renormalise over the masks.
    same_policy = args.top_p == 1 or args.renormalise
    groups = None

    def push() -> int:
        """The trainer's new weights (or adapter) to the sampler, as the next version."""
        if lora is None:
            return groups.update_weights(model.named_parameters())
        return groups.load_adapter(ADAPTER, adapter_tensors(model), lora)

    try:
        if lora is not None:  # untrained (peft starts B at zero), at the sampler's version
            sampler.load_adapter(ADAPTER, adapter_tensors(model), lora,
                                 version=sampler.weight_version or 0)
        before = evaluate(0)
        groups = GroupSampler(sampler, prompts(), group_size=args.group_size,
                              batch_size=args.prompts, eta=args.eta, score=score,
                              pause=args.pause)
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            batch = groups.next_batch(timeout=1800)
            results = [r for g in batch for r in g.results]
            sampled = time.perf_counter()
            version = groups.version

            # Sync check 1: every token came from weights no older than the bound allows.
            old = {v for v in kept.of(results) if not version - args.eta <= v <= version}
            if old:
                print(f"step {step}: tokens of weight versions {old}, the trainer at {version}")
                return 1

            # Sync check 2: each token's logprob is the one its version's weights give. The
            # forward pass under the current weights then gives the loss's gradients.
            logprobs = sequence_logprobs(model, results, args.temperature)
            engine = [r.logprobs for r in results]
            drift = mismatch([lp.detach() for lp in logprobs], engine)
            diff = kv_diff = None
            if same_policy and (step - 1) % args.check_every == 0:
                diff, later = first_and_later_gaps(
                    results, kept.logprobs_under(version, results, logprobs))
                if args.pause == "keep_kv":  # made over the KV cache older weights made
                    kv_diff = later
                else:
                    diff = max(diff, later)
                worst_diff = max(worst_diff, diff)
                if diff > args.tolerance:
                    print(f"step {step}: logprobs differ by {diff:.2e} > {args.tolerance:g}")
                    return 1

            # Group-relative advantages: each sample against the others of its prompt.
            reward = torch.tensor([g.rewards for g in batch], device=model.device)
            advantage = ((reward - reward.mean(1, keepdim=True))
                         / (reward.std(1, keepdim=True) + 1e-4))
            # Policy gradient: raise the logprob of samples better than their group, each
            # token weighted by its importance ratio, truncated or masked (1 when sampled
            # by these very weights, as in the synchronous loop).
            ratios = importance_weights(logprobs, engine, args.correction, args.tis_cap)
            loss = -(advantage.flatten() * torch.stack(
                [(w * lp).sum() for w, lp in zip(ratios, logprobs)])).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            trained = time.perf_counter()

            # Push the new weights as the next version: running samples go on under them.
            kept.add(push())
            pushed = time.perf_counter()
            rewards_per_step.append(reward.mean().item())
            tokens = sum(r.completion_tokens for r in results)
            timing = {"sample_s": sampled - started, "train_s": trained - sampled,
                      "push_s": pushed - trained, "step_s": pushed - started}
            timings.append(timing)
            stale = sum(n for v, n in kept.spans(results) if v < version) / max(tokens, 1)
            record({"step": step, "reward": rewards_per_step[-1], "max_logprob_diff": diff,
                    "kept_kv_max_logprob_diff": kv_diff,
                    **{k: round(v, 5) for k, v in drift.items()},
                    "stale_token_share": round(stale, 4), "eta": args.eta,
                    **{k: round(v, 4) for k, v in timing.items()}})
            print(f"step {step:3d}  reward {rewards_per_step[-1]:.3f}  "
                  f"max|logprob diff| {'-' if diff is None else f'{diff:.1e}'}  "
                  f"{'' if kv_diff is None else f'(over kept KV {kv_diff:.1e})  '}"
                  f"{timing['step_s']:.2f} s "
                  f"(sample {timing['sample_s']:.2f}, train {timing['train_s']:.2f}, "
                  f"push {timing['push_s']:.2f})  stale tokens {stale:.0%}  "
                  f"ratio {drift['ratio_mean']:.3f} ({drift['outside']:.0%} outside "
                  f"[0.9, 1.1])", flush=True)
            if args.eval_every and step % args.eval_every == 0 and step != args.steps:
                evaluate(step)
        groups.close()
        after = evaluate(args.steps)
    finally:
        if groups is not None:
            groups.close()
        sampler.close()
        if log:
            log.close()

    window = max(1, min(5, len(rewards_per_step) // 3))
    first = sum(rewards_per_step[:window]) / window
    last = sum(rewards_per_step[-window:]) / window
    mean = {k: round(sum(t[k] for t in timings) / len(timings), 4) for k in timings[0]} if timings else {}
    print(json.dumps({"backend": args.backend, "task": args.task, "steps": args.steps,
                      "eta": args.eta, "lora": args.lora, "pause": args.pause,
                      "first_reward": round(first, 4), "last_reward": round(last, 4),
                      "accuracy_before": before, "accuracy_after": after,
                      "max_logprob_diff": worst_diff, "mean_seconds": mean,
                      "rewards": [round(r, 4) for r in rewards_per_step]}))
    if args.check and not last > first:
        print(f"the reward did not rise: {first:.3f} over the first {window} steps, "
              f"{last:.3f} over the last {window}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
