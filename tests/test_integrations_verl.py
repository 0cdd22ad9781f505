"""verl's own classes drive `rollout` as its rollout engine (rollout.integrations.verl), on a
local Ray cluster: verl's server manager starts the replica from its registry by name, its
client generates through its load balancer, and its trainer-side adapter pushes weights.
Runs in the verl environment (scripts/test.sh); elsewhere verl is not installed."""

import asyncio
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed in this environment")

import ray  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import rollout  # noqa: E402
from rollout.contract.errors import InvalidRequestError  # noqa: E402
from rollout.testing.fixtures import LOOPBACK, check_ray_on_loopback  # noqa: E402
import rollout.integrations.verl  # noqa: E402,F401 - what VERL_USE_EXTERNAL_MODULES does

PROMPT = [5, 17, 33, 8, 2, 41]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
          "logprobs": True}


@pytest.fixture(scope="module")
def config(tiny_model):
    import verl

    with initialize_config_dir(str(Path(verl.__file__).parent / "trainer" / "config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.rollout.name=rollout",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.prompt_length=16",
            "actor_rollout_ref.rollout.response_length=8",
            "+actor_rollout_ref.rollout.engine_kwargs.rollout.backend=hf",
        ])


@pytest.fixture(scope="module")
def manager(config):
    from verl.workers.rollout.llm_server import LLMServerManager

    # A cluster of its own ("local"): a bare ray.init() joins whatever cluster this machine
    # last started, such as another test step's running beside this one. On loopback
    # (rollout.testing.fixtures), so the replicas serve there too.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address=LOOPBACK)
    check_ray_on_loopback()
    try:
        yield LLMServerManager.create(config)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    with rollout.load_backend("hf", model=str(tiny_model)) as backend:
        yield backend


def greedy(reference, max_tokens=8):
    [result] = reference.generate([{"prompt_token_ids": PROMPT, "sampling": {
        "temperature": 0.0, "max_tokens": max_tokens, "logprobs": 0}}])[0].unwrap()
    return result


def run(coro, timeout=300):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def generate(manager, sampling=GREEDY, request_id="r"):
    client = manager.get_client()
    return run(client.generate(request_id, prompt_ids=PROMPT, sampling_params=dict(sampling)))


def test_verl_generates_through_its_registry_and_load_balancer(manager, reference):
    [replica] = manager.get_replicas()
    assert type(replica).__name__ == "Replica"
    output = generate(manager)
    expected = greedy(reference)
    # response_length (8) is the length when verl's caller names none, as on verl's servers
    assert output.token_ids == list(expected.token_ids) and len(output.token_ids) == 8
    assert output.stop_reason == "completed"
    assert output.log_probs == pytest.approx(list(expected.logprobs), abs=1e-4)


def test_openai_api_is_served_on_the_replica_address(manager):
    [address] = manager.get_addresses()
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=30) as response:
        assert response.status == 200 and b'"data"' in response.read()


def test_unknown_sampling_field_is_refused_by_name(manager):
    with pytest.raises(InvalidRequestError, match="sampling_params.best_of"):
        generate(manager, {**GREEDY, "best_of": 2})


def test_abort_holds_or_rejects_until_resume(manager):
    [replica] = manager.get_replicas()
    run(replica.abort_all_requests(reject_request=True))
    rejected = generate(manager)
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    run(replica.resume_generation())
    assert generate(manager).stop_reason == "completed"


def test_trainer_adapter_pushes_weights(manager, config, reference, tiny_model):
    from transformers import AutoModelForCausalLM
    from verl.workers.rollout.base import get_rollout_class

    adapter_class = get_rollout_class("rollout", "async")
    adapter = adapter_class(config=config.actor_rollout_ref.rollout,
                            model_config=config.actor_rollout_ref.model, device_mesh=None)
    adapter.bucket_bytes = 64 << 10  # several buckets; the version comes with the last
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    torch.manual_seed(0)
    weights = {name: tensor + 0.05 * torch.randn_like(tensor)
               for name, tensor in model.state_dict().items()}
    before = generate(manager)
    run(adapter.update_weights(iter(weights.items()), global_steps=3))
    reference.update_weights(weights.items())
    after, expected = generate(manager), greedy(reference)
    [server] = manager.get_replicas()[0].servers
    assert ray.get(server.health.remote(), timeout=60)["weight_version"] == 3
    assert after.log_probs != pytest.approx(before.log_probs, abs=1e-3)
    assert after.token_ids == list(expected.token_ids)
    assert after.log_probs == pytest.approx(list(expected.logprobs), abs=1e-4)


def test_trainer_adapter_pushes_a_lora_adapter(manager, config, tiny_model, tmp_path):
    """A LoRA run that does not merge: verl syncs the base model once, under peft's wrapped
    names, then pushes the adapter alone (peft's LoraConfig, PEFT-named tensors) each
    step; the replica then samples with it, as the model with the adapter merged does."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from verl.workers.rollout.base import get_rollout_class

    from rollout.testing.adapters import lora_adapter, merged_copy

    adapter = get_rollout_class("rollout", "async")(
        config=config.actor_rollout_ref.rollout, model_config=config.actor_rollout_ref.model,
        device_mesh=None)
    tensors, lora = lora_adapter(tiny_model, rank=4, alpha=8)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=lora["target_modules"])
    # The base, as verl names it in a peft model (earlier tests pushed other weights).
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model)).state_dict()
    wrapped = {name.replace(".weight", ".base_layer.weight")
               if name.split(".")[-2] in lora["target_modules"] else name: tensor
               for name, tensor in base.items()}
    run(adapter.update_weights(iter(wrapped.items()), peft_config=peft_config,
                               base_sync_done=False, global_steps=4))
    run(adapter.update_weights(iter(tensors.items()), peft_config=peft_config,
                               base_sync_done=True, global_steps=4))
    with rollout.load_backend("hf", model=str(merged_copy(
            tiny_model, tmp_path / "merged", tensors, lora))) as merged:
        expected = greedy(merged)
    output = generate(manager)
    assert output.token_ids == list(expected.token_ids)
    assert output.log_probs == pytest.approx(list(expected.logprobs), abs=1e-4)
