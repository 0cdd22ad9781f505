"""examples/grpo.py on the HF backend: weights pushed after every step reach the sampler
(versions and logprobs match the trainer), and the reward rises."""

import json

from rollout.testing.grpo import run_grpo, run_grpo_script, sampler_options


def test_reward_rises_and_logprobs_match(tiny_model):
    run = run_grpo("hf", {}, tiny_model, "--steps", 20, "--prompts", 4, "--group-size", 8,
                   "--seed", 0, "--check", timeout=120)
    assert len(run.steps) == 20
    assert run.summary["max_logprob_diff"] <= 1e-3
    # It rises by far more than this on most seeds (0.15 to 0.5 in 20 steps).
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary


def test_an_engine_in_this_process_takes_no_priority_option():
    """HF's engine is a thread of the trainer's process: nothing to renice, and its backend
    takes no `nice` (vLLM's tests check the default where there is one)."""
    assert sampler_options("--backend", "hf", "--async", "1") == {}


def test_config_file_and_a_failed_logprob_check(tiny_model, tmp_path):
    config = tmp_path / "grpo.yaml"
    # A tolerance no engine meets: the check must fail the run, on the first batch.
    config.write_text(f"model: {tiny_model}\nsteps: 3\ngroup-size: 2\ntolerance: 0.0\n"
                      "backend-option: {batch_size: 4}\n")
    done = run_grpo_script("--config", config, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "step 1: logprobs differ by" in done.stdout


def test_the_same_loop_through_two_replica_processes(tiny_model):
    """The sampler in two `rollout serve` replicas: weights reach both every step."""
    run = run_grpo("hf", {}, tiny_model, "--replicas", 2, "--steps", 8, "--prompts", 4,
                   "--group-size", 4, "--seed", 0, timeout=300)
    assert run.summary["max_logprob_diff"] <= 1e-3 and len(run.summary["rewards"]) == 8


def test_the_asynchronous_loop_learns_with_each_tokens_logprob_checked(tiny_model):
    """--async 1: a batch is sampled ahead while the trainer trains; every token's logprob
    is checked against the trainer's weights of that token's version."""
    run = run_grpo("hf", {}, tiny_model, "--async", 1, "--steps", 20, "--prompts", 4,
                   "--group-size", 8, "--seed", 0, "--check", timeout=120)
    assert run.summary["eta"] == 1 and len(run.steps) == 20
    assert run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary


def test_kept_kv_pushes_check_the_exact_tokens_and_log_the_others_apart(tiny_model,
                                                                         tmp_path):
    """--pause keep_kv: running samples keep their KV cache across a push. The tokens
    their own weights' cache made pass the check; the largest gap of those made over an
    older cache is logged apart each step."""
    log = tmp_path / "steps.jsonl"
    run = run_grpo("hf", {}, tiny_model, "--async", 1, "--pause", "keep_kv", "--steps", 12,
                   "--prompts", 4, "--group-size", 8, "--max-tokens", 32, "--seed", 0,
                   "--log", log, timeout=120)
    assert run.summary["pause"] == "keep_kv" and len(run.steps) == 12
    assert run.summary["max_logprob_diff"] <= 1e-3
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "reward" in r]
    assert len(steps) == 12 and all(s["kept_kv_max_logprob_diff"] >= 0 for s in steps)


def test_the_asynchronous_loop_through_two_replica_processes(tiny_model):
    run = run_grpo("hf", {}, tiny_model, "--replicas", 2, "--async", 2, "--steps", 8,
                   "--prompts", 4, "--group-size", 4, "--seed", 0, timeout=300)
    assert run.summary["max_logprob_diff"] <= 1e-3 and len(run.summary["rewards"]) == 8


def test_top_p_is_on_policy_once_the_trainer_renormalises_over_the_masks(tiny_model, tmp_path):
    """--top-p 0.8 at temperature 0.7: the engine's processed logprobs against the trainer's
    distribution renormalised over each token's sampling mask pass the logprob check, and
    the importance ratio is 1; without the masks the check is skipped and the ratio is the
    kept mass."""
    common = ("--steps", 3, "--prompts", 2, "--group-size", 4, "--seed", 0,
              "--top-p", 0.8, "--temperature", 0.7)

    def steps(*args) -> list[dict]:
        log = tmp_path / f"{len(args)}.jsonl"
        run_grpo("hf", {}, tiny_model, *common, *args, "--log", log, timeout=300)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        return [r for r in records if "reward" in r]

    renormalised = steps("--renormalise")
    assert len(renormalised) == 3
    assert all(s["max_logprob_diff"] <= 1e-3 for s in renormalised)
    assert all(abs(s["ratio_mean"] - 1) < 1e-3 and s["outside"] == 0 for s in renormalised)
    plain = steps("--correction", "mis")
    assert all(s["max_logprob_diff"] is None for s in plain)
    assert all(s["ratio_mean"] < 0.95 and s["outside"] > 0.5 for s in plain)
