"""TRL's own GRPOTrainer (the real package) sampling through
`rollout.integrations.trl.RolloutFunc`, for each backend's tests: a few steps of the sums
task on the real model. After every push the sampler's logprobs of what it sampled equal
the trainer's own forward pass on the same tokens, and TRL logs the reward."""

from __future__ import annotations

import os

from rollout.apps.datasets import sums
from rollout.integrations.trl import RolloutFunc
from rollout.weights.lora import one_block

STEPS, PROMPTS, GROUP, MAX_TOKENS = 2, 2, 4, 12
TOLERANCE = 1e-3  # float32 engines against the float32 trainer


def sums_reward(completions, answer, **_):
    return [float(sums.is_right(c[-1]["content"], a)) for c, a in zip(completions, answer)]


class CheckedRolloutFunc(RolloutFunc):
    """The integration, and after each call the largest gap between the returned logprobs
    and the trainer's, with the step it was sampled at."""

    def __init__(self, sampler, **kwargs):
        super().__init__(sampler, **kwargs)
        self.gaps: list[tuple[int, float]] = []
        self.packed: list[bool] = []  # the pushed LoRA adapter in one block, each call

    def __call__(self, prompts, trainer):
        import torch

        out = super().__call__(prompts, trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        worst = 0.0
        with torch.no_grad():
            for prompt, completion, logprobs in zip(out["prompt_ids"], out["completion_ids"],
                                                    out["logprobs"]):
                logits = model(input_ids=torch.tensor([prompt + completion])).logits
                mine = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1).gather(
                    1, torch.tensor(completion).unsqueeze(1)).squeeze(1)
                worst = max(worst, (mine - torch.tensor(logprobs)).abs().max().item())
        self.gaps.append((trainer.state.global_step, worst))
        if hasattr(model, "peft_config"):  # what the push sends, as the HF backend reads it
            from peft import get_peft_model_state_dict

            pushed = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
            self.packed.append(one_block(list(pushed.values())) is not None)
        return out


def train(sampler, model_dir: str, output_dir: str, push_weights: bool = True,
          peft_config=None, learning_rate: float = 1e-5):
    """STEPS steps of TRL's GRPOTrainer sampling from `sampler` (with `peft_config`, training
    a LoRA adapter): the rollout function (`gaps`: the (step, logprob gap) of each sampling
    call) and the rewards TRL logged."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental"
    pairs, _ = sums.split(0, held_out=10)
    dataset = Dataset.from_list([{"prompt": sums.messages(a, b), "answer": a + b}
                                 for a, b in pairs[:STEPS * PROMPTS]])
    config = trl.GRPOConfig(
        output_dir=output_dir, max_steps=STEPS, seed=0,
        per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        steps_per_generation=1, max_completion_length=MAX_TOKENS, temperature=1.0,
        learning_rate=learning_rate, use_cpu=True, bf16=False, disable_dropout=True,
        gradient_checkpointing=False, remove_unused_columns=False, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True)
    func = CheckedRolloutFunc(sampler, push_weights=push_weights)
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model_dir), reward_funcs=sums_reward,
        args=config, train_dataset=dataset, rollout_func=func, peft_config=peft_config)
    trainer.train()
    return func, [log["reward"] for log in trainer.state.log_history if "reward" in log]


def check_grpo_trainer_through_rollout(sampler, model_dir: str, output_dir: str) -> None:
    func, rewards = train(sampler, model_dir, output_dir)
    gaps = func.gaps
    # One call per step, each after the push of that step's weights (at step 0 as well).
    assert [step for step, _ in gaps] == list(range(STEPS))
    assert max(gap for _, gap in gaps) < TOLERANCE, gaps
    assert len(rewards) == STEPS and all(0.0 <= r <= 1.0 for r in rewards)


def check_lora_grpo_trainer_through_rollout(sampler, model_dir: str, output_dir: str) -> None:
    """TRL training a LoRA adapter (`peft_config`): each step pushes the adapter alone, and
    the sampler's logprobs of what it sampled equal the trainer's adapted model's. The
    learning rate is LoRA's (100x full fine-tuning's), so that without the pushes the gap
    would show at step 1."""
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    func, rewards = train(sampler, model_dir, output_dir, peft_config=lora,
                          learning_rate=1e-3)
    gaps = func.gaps
    assert [step for step, _ in gaps] == list(range(STEPS))
    assert max(gap for _, gap in gaps) < TOLERANCE, gaps
    # Packed at the first push (one process, nothing wraps the model), after TRL made its
    # optimizer: the gaps say that the optimizer still trains what is pushed.
    assert func.packed == [True] * STEPS
    assert len(rewards) == STEPS
    assert sampler.adapters == {"policy": STEPS - 1}  # pushed each step, as the adapter
    assert sampler.weight_version is None  # the full weights never went
