"""LoRA adapters served (HF backend, tiny model): `--lora`-style adapters loaded from PEFT
folders before the server listens, vLLM's load and unload routes, /v1/models listing them,
`model` choosing one on completions, chat and responses; a trainer's push of an adapter's
tensors through the weight-update protocol; and a pool of two replicas, where a killed
replica comes back with the pool's adapters before it serves them."""

import json
import os
import signal
import urllib.error
import urllib.request

import openai
import pytest

from rollout import load_backend
from rollout.apps.serving.app import ServerThread
from rollout.service.served import ServedRollout
from rollout.service.service import LocalService
from rollout.testing.adapters import lora_adapter, merged_references, peft_folder
from rollout.testing.contract import probe_requests
from rollout.testing.waiting import wait_for

PROMPT = "the ka lo"
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {"a": lora_adapter(tiny_model, seed=1), "b": lora_adapter(tiny_model, rank=4, seed=2)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters, tmp_path_factory):
    """Greedy tokens of the probe prompts: the base model's, and each adapter's merged."""
    return merged_references(
        tiny_model, adapters, lambda name: tmp_path_factory.mktemp(f"merged-{name}"),
        lambda hf: [c.unwrap()[0].token_ids for c in hf.generate(probe_requests())])


@pytest.fixture(scope="module")
def server(tiny_model, adapters, tmp_path_factory):
    folder = peft_folder(tmp_path_factory.mktemp("peft-a"), *adapters["a"])
    rollout = load_backend("hf", str(tiny_model), dtype="float32")
    with ServerThread(LocalService(rollout, "tiny"), lora_modules={"a": str(folder)}) as server:
        yield server.url
    rollout.close()


def post(url: str, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def completion_ids(client, model: str) -> list[int]:
    answer = client.completions.create(model=model, prompt=PROMPT, extra_body={
        "return_token_ids": True, "ignore_eos": True}, **GREEDY)
    return answer.choices[0].token_ids


def test_models_list_the_adapters_and_model_chooses_one(server, expected):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="-")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a"}
    assert models["a"].parent == "tiny" and models["tiny"].parent is None
    assert completion_ids(client, "a") == list(expected["a"][0][:8])
    assert completion_ids(client, "tiny") == list(expected[None][0][:8])
    chat = client.chat.completions.create(model="a", messages=[
        {"role": "user", "content": "hi"}], **GREEDY)
    assert chat.model == "a"
    response = client.responses.create(model="a", input="hi", max_output_tokens=4,
                                       temperature=0.0)
    assert response.model == "a"
    with pytest.raises(openai.NotFoundError) as missing:
        completion_ids(client, "nope")
    assert "'a'" in str(missing.value)  # the adapters it serves are named


def test_load_and_unload_routes_as_vllms(server, adapters, expected, tmp_path):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="-")
    folder_b = peft_folder(tmp_path / "b", *adapters["b"])
    status, text = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "b", "lora_path": str(folder_b)})
    assert status == 200 and "b" in text
    assert completion_ids(client, "b") == list(expected["b"][0][:8])
    # Loaded already: refused unless in place, which replaces its weights.
    assert post(server, "/v1/load_lora_adapter",
                {"lora_name": "b", "lora_path": str(folder_b)})[0] == 400
    folder_a = peft_folder(tmp_path / "a", *adapters["a"])
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(folder_a),
                                                  "load_inplace": True})[0] == 200
    assert completion_ids(client, "b") == list(expected["a"][0][:8])
    status, text = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "c", "lora_path": str(tmp_path / "absent")})
    assert status == 400 and "adapter_config.json" in text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 404
    with pytest.raises(openai.NotFoundError):
        completion_ids(client, "b")
    assert {m.id for m in client.models.list().data} == {"tiny", "a"}


def test_a_trainer_pushes_an_adapters_tensors(server, adapters, expected):
    with ServedRollout.connect(server) as trainer:
        tensors, config = adapters["b"]
        trainer.load_adapter("pushed", tensors.items(), config, version=7)
        done = [c.unwrap()[0] for c in trainer.generate(probe_requests("pushed"))]
        assert [r.token_ids for r in done] == expected["b"]
        assert {(r.adapter, r.adapter_version) for r in done} == {("pushed", 7)}
        trainer.unload_adapter("pushed")
        (refused,) = trainer.generate([{"prompt": "x", "adapter": "pushed"}])
        assert refused.error.field == "adapter"


def test_a_killed_replica_comes_back_with_the_pools_adapters(tiny_model, adapters, expected):
    many = probe_requests("a") * 4  # enough to reach both replicas
    with ServedRollout.start("hf", str(tiny_model), replicas=2,
                             options={"dtype": "float32"}) as trainer:
        tensors, config = adapters["a"]
        trainer.load_adapter("a", tensors.items(), config, version=3)
        victim = trainer.service.replicas[0]
        old_url = victim.service.url
        os.killpg(victim.process.proc.pid, signal.SIGKILL)
        wait_for(lambda: victim.service.url != old_url, 120, "the pool to restart the replica")
        # Restarted without adapters, it serves none until the pool has pushed it "a".
        wait_for(lambda: victim.adapters == {"a": 3}, 120, "the replica to get adapter a")
        for completion, want in zip(trainer.generate(many), expected["a"] * 4):
            [result] = completion.unwrap()
            assert result.token_ids == want and result.adapter_version == 3
        assert trainer.service.adapters() == {"a": 3}
        trainer.unload_adapter("a")
        assert all(r.adapters == {} for r in trainer.service.replicas)


def test_the_lora_flag_takes_name_equals_path(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "rollout", "serve", "--backend", "hf",
                          "--model", str(tmp_path), "--lora", "no-path"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--lora" in run.stderr and "NAME=PATH" in run.stderr
