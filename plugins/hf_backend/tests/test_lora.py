"""LoRA adapters on the HF backend, on the tiny model, beyond the contract suite's (one
adapter beside the base, errors): two adapters of other ranks, each equal to its merged
model, and rows of both and of the base in one batch; replacing in place; configs that
are no plain LoRA."""

import pytest

import rollout
from rollout import InvalidRequestError
from rollout.testing.adapters import lora_adapter, merged_references

PROMPTS = ("the ka lo", "def x", "1 2 3 +", "mi ne su ta ri po")


def greedy(ro, adapter=None, prompts=PROMPTS):
    done = ro.generate([{"prompt": p, "adapter": adapter, "sampling": {
        "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}} for p in prompts])
    return [c.unwrap()[0] for c in done]


@pytest.fixture(scope="module")
def adapters(tiny_model):
    # "a2" has a's layout (written over it in place), "b" another rank (a new buffer).
    return {"a": lora_adapter(tiny_model, seed=1), "b": lora_adapter(tiny_model, rank=4, seed=2),
            "a2": lora_adapter(tiny_model, seed=3)}


@pytest.fixture(scope="module")
def ro(tiny_model, adapters):
    with rollout.load_backend("hf", model=str(tiny_model), dtype="float32") as backend:
        for name, (tensors, config) in adapters.items():
            backend.load_adapter(name, tensors.items(), config, version=1)
        yield backend


@pytest.fixture(scope="module")
def merged(tiny_model, adapters, tmp_path_factory):
    """Greedy tokens of each adapter merged into the model's weights (and of the base)."""
    return merged_references(tiny_model, adapters,
                             lambda name: tmp_path_factory.mktemp(f"merged-{name}"),
                             lambda hf: [r.token_ids for r in greedy(hf)])


def test_an_adapter_samples_what_the_merged_model_does(ro, merged):
    base = [r.token_ids for r in greedy(ro)]
    for name in ("a", "b"):
        results = greedy(ro, name)
        assert [r.token_ids for r in results] == merged[name]
        assert [r.token_ids for r in results] != base  # the adapter changes the output
        assert {(r.adapter, r.adapter_version) for r in results} == {(name, 1)}
    assert {(r.adapter, r.adapter_version) for r in greedy(ro)} == {(None, None)}


def test_rows_of_several_adapters_and_the_base_share_a_batch(ro, merged):
    names = [None, "a", "b", "a", None, "b"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    done = ro.generate([{"prompt": p, "adapter": n, "sampling": {
        "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}}
        for p, n in zip(prompts, names)])
    for i, (name, completion) in enumerate(zip(names, done)):
        assert completion.unwrap()[0].token_ids == merged[name][i % len(PROMPTS)], (i, name)


def test_a_config_that_is_no_plain_lora_is_refused(ro, adapters):
    tensors, config = adapters["a"]
    for key, value in (("use_dora", True), ("modules_to_save", ["lm_head"]), ("r", 0)):
        with pytest.raises(InvalidRequestError) as refused:
            ro.load_adapter("c", tensors.items(), {**config, key: value})
        assert refused.value.field == f"config.{key}"
    assert "c" not in ro.adapters


def test_replace_and_unload(tiny_model, adapters, merged):
    with rollout.load_backend("hf", model=str(tiny_model), dtype="float32") as ro:
        tensors, config = adapters["a"]
        ro.load_adapter("p", tensors.items(), config, version=3)
        assert [r.token_ids for r in greedy(ro, "p")] == merged["a"]
        assert merged["a2"] != merged["a"]
        for name, version in (("a2", 4), ("b", 5), ("a", 6)):  # same layout, other rank, back
            tensors, config = adapters[name]
            ro.load_adapter("p", tensors.items(), config, version=version)
            results = greedy(ro, "p")
            assert [r.token_ids for r in results] == merged[name]
            assert {r.adapter_version for r in results} == {version}
        ro.unload_adapter("p")
        (refused,) = ro.generate([{"prompt": "x", "adapter": "p"}])
        assert refused.error.field == "adapter" and refused.error.allowed == "none loaded"
        with pytest.raises(InvalidRequestError):
            ro.unload_adapter("p")


def test_a_packed_adapter_replaces_in_one_copy_of_its_own(tiny_model, adapters, merged):
    """A trainer's adapter kept in one block (`pack_tensors`, as `pack_adapter` keeps a
    peft model's) replaces the loaded one as the separate tensors do, and the backend
    keeps its own copy: the block changing after the load changes nothing."""
    from rollout.weights.lora import pack_tensors

    with rollout.load_backend("hf", model=str(tiny_model), dtype="float32") as ro:
        tensors, config = adapters["a"]
        ro.load_adapter("p", tensors.items(), config, version=1)
        packed = {k: t.clone() for k, t in adapters["a2"][0].items()}
        pack_tensors(list(packed.values()))
        ro.load_adapter("p", packed.items(), config, version=2)
        for tensor in packed.values():
            tensor.zero_()
        assert [r.token_ids for r in greedy(ro, "p")] == merged["a2"]


def test_a_mixed_batch_of_adapters_of_different_modules(tiny_model, tmp_path):
    """A module that one adapter of the batch adapts and another does not: the other's
    rows get no delta there (its columns are zeros in the side-by-side product)."""
    full, full_config = lora_adapter(tiny_model, seed=1)
    tensors, config = lora_adapter(tiny_model, rank=4, seed=2)
    q_only = {k: v for k, v in tensors.items() if ".q_proj." in k}
    merged = merged_references(tiny_model, {"full": (full, full_config), "q": (q_only, config)},
                               lambda name: tmp_path / name,
                               lambda hf: [r.token_ids for r in greedy(hf)])
    assert merged["q"] != merged[None]
    names = ["q", None, "full", "q", "full", None]
    with rollout.load_backend("hf", model=str(tiny_model), dtype="float32") as ro:
        ro.load_adapter("full", full.items(), full_config)
        ro.load_adapter("q", q_only.items(), config)
        done = ro.generate([{"prompt": PROMPTS[i % len(PROMPTS)], "adapter": name,
                             "sampling": {"temperature": 0.0, "max_tokens": 12,
                                          "ignore_eos": True}}
                            for i, name in enumerate(names)])
    for i, (name, completion) in enumerate(zip(names, done)):
        assert completion.unwrap()[0].token_ids == merged[name][i % len(PROMPTS)], (i, name)
