"""LoRA adapters on vLLM (engine and server modes, the tiny model), beyond the contract
suite's: rows of two adapters and of the base in one batch (vLLM's CPU ops gave base rows
the last slot's adapter), more adapters than vLLM keeps loaded (an evicted one is rebuilt
from the tensors the worker kept), and replacing one in place. References: each adapter
merged into the model's weights, on the HF backend (whose greedy tokens equal vLLM's,
test_matches_hf)."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.adapters import lora_adapter, merged_references

PROMPTS = ("the ka lo", "def x", "1 2 3 +", "mi ne su ta ri po")
# Two adapters in a step, two kept in the worker's cache: a third evicts one.
LORA = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 8}


def requests(names):
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "adapter": name, "sampling": {
        "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}}
        for i, name in enumerate(names)]


def tokens(ro, names):
    return [c.unwrap()[0].token_ids for c in ro.generate(requests(names))]


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {"a": lora_adapter(tiny_model, seed=1), "b": lora_adapter(tiny_model, rank=4, seed=2),
            "c": lora_adapter(tiny_model, rank=8, seed=3)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters, tmp_path_factory):
    """Greedy tokens per prompt: of the base model, and of each adapter merged into it."""
    return merged_references(tiny_model, adapters,
                             lambda name: tmp_path_factory.mktemp(f"merged-{name}"),
                             lambda hf: tokens(hf, [None] * len(PROMPTS)))


@pytest.fixture(scope="module", params=["engine", "server"])
def ro(request, tiny_model):
    """In server mode vLLM's server gives each adapter an id of its own: the worker finds
    the tensors by the adapter's path, also when it rebuilds an evicted one."""
    with rollout.load_backend("vllm", model=str(tiny_model), mode=request.param,
                              engine_args=LORA, **ENGINE) as backend:
        yield backend


def want(expected, names):
    return [expected[name][i % len(PROMPTS)] for i, name in enumerate(names)]


def test_rows_of_two_adapters_and_the_base_share_a_batch(ro, adapters, expected):
    for name in ("a", "b"):
        tensors, config = adapters[name]
        ro.load_adapter(name, tensors.items(), config, version=1)
    try:
        for names in ([None, "a", None, "a"], ["a", "b", None, "b", None, "a", "b", None]):
            assert tokens(ro, names) == want(expected, names), names
    finally:
        ro.unload_adapter("a")
        ro.unload_adapter("b")


def test_more_adapters_than_vllm_keeps_loaded_each_sample_their_own(ro, adapters, expected):
    for name, (tensors, config) in adapters.items():  # three, with room for two
        ro.load_adapter(name, tensors.items(), config, version=2)
    try:
        for names in (["a", "b"], ["c", "a"], ["b", "c", None, "b"]):
            assert tokens(ro, names) == want(expected, names), names
    finally:
        for name in adapters:
            ro.unload_adapter(name)
    assert tokens(ro, [None] * 4) == want(expected, [None] * 4)


def test_a_replaced_adapter_samples_its_new_weights(ro, adapters, expected):
    tensors, config = adapters["a"]
    ro.load_adapter("p", tensors.items(), config, version=3)
    try:
        assert tokens(ro, ["p"] * 4) == want(expected, ["a"] * 4)
        tensors, config = adapters["b"]  # another rank too
        ro.load_adapter("p", tensors.items(), config, version=4)
        done = [c.unwrap()[0] for c in ro.generate(requests(["p"] * 4))]
        assert [r.token_ids for r in done] == want(expected, ["b"] * 4)
        assert {(r.adapter, r.adapter_version) for r in done} == {("p", 4)}
    finally:
        ro.unload_adapter("p")


def test_a_rank_over_the_engines_max_is_refused_by_name(ro, tiny_model):
    tensors, config = lora_adapter(tiny_model, rank=16)
    with pytest.raises(rollout.InvalidRequestError) as refused:
        ro.load_adapter("big", tensors.items(), config)
    assert refused.value.field == "config.r" and "8" in refused.value.allowed
    assert "big" not in ro.adapters
