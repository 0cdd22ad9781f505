"""Every body the backend sends is checked against SGLang's own request classes from the
installed version: a field SGLang renames or drops fails here, not in a user's run."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import rollout_sglang
from rollout.contract.schemas import SamplingParams
from rollout_sglang import protocol

SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.0, max_tokens=3, logprobs=0),
    SamplingParams(temperature=0.7, top_p=0.5, top_k=5, n=3, stop=("a", "b."),
                   stop_token_ids=(2, 7), logprobs=4, ignore_eos=True),
    # The set drawn from, with processed logprobs (the top ones from it) and without.
    SamplingParams(temperature=0.7, top_p=0.8, logprobs=3, logprobs_mode="processed",
                   return_sampling_mask=True),
    SamplingParams(top_k=5, return_sampling_mask=True, return_routed_experts=True),
]


def struct_fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)  # msgspec.Struct


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_generate_body_fits_generate_req_input(sampling):
    body = protocol.generate_body("0" * 32, [5, 6, 7], sampling, vocab_size=100)
    cls = protocol.struct("generate")
    assert set(body) <= struct_fields(cls), set(body) - struct_fields(cls)
    request = cls(**body)
    request.normalize_batch_and_arguments()
    if sampling.return_sampling_mask:  # SGLang's set needs a finite top_k
        assert body["sampling_params"]["top_k"] == (sampling.top_k or 100)


def test_image_bodies_fit_generate_req_input():
    """Images go as `image_data`, one per placeholder, in generation and scoring bodies."""
    from PIL import Image

    from rollout_sglang.engines import InProcessEngine, ServerEngine
    from rollout.kit.images import PromptImage

    images = (PromptImage(Image.new("RGB", (30, 20)), "a"),
              PromptImage(Image.new("RGB", (20, 30)), "b"))
    cls = protocol.struct("generate")
    server = ServerEngine({"model_path": "m"}, 1.0, 1.0)
    for image_data in (InProcessEngine.image_data(images), server.image_data(images)):
        assert len(image_data) == 2
        for body in (protocol.generate_body("0" * 32, [5, 6, 5], SamplingParams(), image_data),
                     protocol.score_body("0" * 32, [5, 6, 5], [7], 0, image_data, 40)):
            assert body["image_data"] == image_data
            request = cls(**body)
            request.normalize_batch_and_arguments()
    # The scoring prefill starts where SGLang's expanded prompt (40 tokens) ends.
    assert protocol.score_body("0" * 32, [5, 6, 5], [7], 0, ["x"], 40)["logprob_start_len"] == 39
    urls = server.image_data(images)
    assert urls[0].startswith("data:image/png;base64,")
    assert server.image_data(images)[0] is urls[0]  # each image encoded once


def test_dict_engine_args_are_json_on_the_server_command_line():
    from rollout_sglang.engines import ServerEngine

    argv = ServerEngine({"model_path": "m", "mm_process_config": {"image": {"size": {
        "shortest_edge": 1, "longest_edge": 2}}}}, 1, 1).argv()
    config = argv[argv.index("--mm-process-config") + 1]
    assert json.loads(config) == {"image": {"size": {"shortest_edge": 1, "longest_edge": 2}}}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_sampling_body_fits_sampling_params(sampling, tiny_model):
    from transformers import AutoTokenizer

    body = protocol.sampling_body(sampling)
    cls = protocol.struct("sampling")
    assert set(body) <= struct_fields(cls), set(body) - struct_fields(cls)
    params = cls(**body)
    params.normalize(AutoTokenizer.from_pretrained(str(tiny_model)))
    params.verify(512)


@pytest.mark.parametrize(("name", "body"), [
    ("begin_weight_update", {}),
    ("update_weights_from_tensor", protocol.update_tensor_body("gASV")),
    ("end_weight_update", {}),
    ("update_weights_from_disk", protocol.update_disk_body("/tmp/model")),
    ("init_weights_update_group",
     protocol.init_group_body("127.0.0.1", 29500, "rollout-x", "gloo")),
    ("update_weights_from_distributed", protocol.update_distributed_body(
        [("w", torch.zeros(2, 3, dtype=torch.bfloat16))], "rollout-x")),
    ("destroy_weights_update_group", {"group_name": "rollout-x"}),
    ("release", {"tags": ["weights", "kv_cache"]}),
    ("resume", {"tags": ["kv_cache"]}),
])
def test_control_bodies_fit_sglang_structs(name, body):
    cls = protocol.struct(name)
    assert set(body) <= struct_fields(cls), set(body) - struct_fields(cls)
    built = cls(**body)  # keyword construction rejects unknown fields
    for key, value in body.items():
        assert getattr(built, key) == value


def test_the_payload_is_what_sglang_deserializes():
    import torch
    from sglang.srt.utils import MultiprocessingSerializer

    from rollout_sglang.weights import serialize

    group = [("lm_head.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
    for as_text in (False, True):
        back = MultiprocessingSerializer.deserialize(serialize(group, as_text))
        assert [n for n, _ in back] == ["lm_head.weight"]
        assert torch.equal(back[0][1], group[0][1])


def test_package_holds_no_cpu_scaffolding():
    package = Path(rollout_sglang.__file__).parent
    names = {p.name for p in package.rglob("*")}
    assert not {"sitecustomize.py", "libcuda_stub.c", "libcuda.so.1"} & names
