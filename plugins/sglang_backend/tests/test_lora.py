"""LoRA adapters on SGLang (server mode; the engine mode runs the contract suite's adapter
tests, test_engine_contract), beyond the contract's: rows of two adapters and of the base
in one batch, more adapters in a batch than SGLang runs together, replacing one in place
with another rank, and rsLoRA's scale. References: each adapter merged into the model's
weights, on the HF backend, whose greedy tokens SGLang's equal up to a near-tie
(rollout.testing.agreement)."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.adapters import lora_adapter, merged_references
from rollout.testing.agreement import check_greedy_tokens
from rollout_sglang.backend import lora_args

PROMPTS = ("the ka lo", "def x", "1 2 3 +", "mi ne su ta ri po")
# Two adapters per batch: a batch naming three runs in two.
LORA = {"enable_lora": True, "max_loras_per_batch": 2, "max_lora_rank": 8}


def requests(names):
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "adapter": name, "sampling": {
        "temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 2}}
        for i, name in enumerate(names)]


def results(ro, names):
    return [c.unwrap()[0] for c in ro.generate(requests(names))]


def rslora(tensors, config):
    """The adapter as rsLoRA (scale alpha / sqrt(r)), and the plain config that scales the
    same (alpha * sqrt(r)), which merged_copy takes."""
    rank, alpha = config["r"], config["lora_alpha"]
    return tensors, {**config, "use_rslora": True}, {**config, "lora_alpha": alpha * rank ** 0.5}


@pytest.fixture(scope="module")
def adapters(tiny_model):
    return {"a": lora_adapter(tiny_model, seed=1), "b": lora_adapter(tiny_model, rank=4, seed=2),
            "c": lora_adapter(tiny_model, rank=8, seed=3)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters, tmp_path_factory):
    """HF's greedy results per prompt: of the base model, of each adapter merged into it,
    and of adapter "b" as rsLoRA."""
    tensors, _, plain = rslora(*adapters["b"])
    return merged_references(tiny_model, {**adapters, "b-rs": (tensors, plain)},
                             lambda name: tmp_path_factory.mktemp(f"merged-{name}"),
                             lambda hf: results(hf, [None] * len(PROMPTS)))


@pytest.fixture(scope="module")
def ro(tiny_model):
    with rollout.load_backend("sglang", model=str(tiny_model), mode="server",
                              engine_args=LORA, **ENGINE) as backend:
        yield backend


def check(expected, names, got, as_names=None):
    want = [expected[name][i % len(PROMPTS)] for i, name in enumerate(as_names or names)]
    check_greedy_tokens(list(zip(want, got)))


def test_rows_of_two_adapters_and_the_base_share_a_batch(ro, adapters, expected):
    for name in ("a", "b"):
        tensors, config = adapters[name]
        ro.load_adapter(name, tensors.items(), config, version=1)
    try:
        for names in ([None, "a", None, "a"], ["a", "b", None, "b", None, "a", "b", None]):
            check(expected, names, results(ro, names))
    finally:
        ro.unload_adapter("a")
        ro.unload_adapter("b")


def test_a_batch_of_more_adapters_than_sglang_runs_together(ro, adapters, expected):
    for name, (tensors, config) in adapters.items():  # three, two per SGLang batch
        ro.load_adapter(name, tensors.items(), config, version=2)
    try:
        names = ["a", "b", "c", None, "c", "a"]
        check(expected, names, results(ro, names))
    finally:
        for name in adapters:
            ro.unload_adapter(name)
    check(expected, [None] * 4, results(ro, [None] * 4))


def test_a_replaced_adapter_samples_its_new_weights(ro, adapters, expected):
    tensors, config = adapters["a"]
    ro.load_adapter("p", tensors.items(), config, version=3)
    try:
        check(expected, ["p"] * 4, results(ro, ["p"] * 4), ["a"] * 4)
        tensors, config = adapters["b"]  # another rank too
        ro.load_adapter("p", tensors.items(), config, version=4)
        done = results(ro, ["p"] * 4)
        check(expected, ["p"] * 4, done, ["b"] * 4)
        assert {(r.adapter, r.adapter_version) for r in done} == {("p", 4)}
    finally:
        ro.unload_adapter("p")


def test_rslora_scales_by_the_root_of_the_rank(ro, adapters, expected):
    tensors, config, _ = rslora(*adapters["b"])
    ro.load_adapter("rs", tensors.items(), config)
    try:
        check(expected, ["rs"] * 4, results(ro, ["rs"] * 4), ["b-rs"] * 4)
    finally:
        ro.unload_adapter("rs")


def test_a_rank_over_the_engines_max_is_refused_by_name(ro, tiny_model):
    tensors, config = lora_adapter(tiny_model, rank=16)
    with pytest.raises(rollout.InvalidRequestError) as refused:
        ro.load_adapter("big", tensors.items(), config)
    assert refused.value.field == "config.r" and "8" in refused.value.allowed
    assert "big" not in ro.adapters


def test_enable_lora_is_refused_where_host_memory_cannot_be_pinned(monkeypatch):
    """A CPU-only torch cannot pin memory, and SGLang's LoRA layers would crash its
    scheduler on that (the tests' CPU scaffolding gives them a torch that pins nothing):
    stood in for by a torch whose pinning fails, as that error cannot be had here on
    demand."""
    from sglang.srt.lora import layers

    empty = layers.torch.empty

    def no_pinning(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("Found no NVIDIA driver on your system")
        return empty(*args, **kwargs)

    monkeypatch.setattr(layers.torch, "empty", no_pinning)
    with pytest.raises(rollout.InvalidRequestError) as refused:
        lora_args("cpu", {}, {"enable_lora": True})
    assert refused.value.field == "engine_args.enable_lora"
    assert "NVIDIA" in refused.value.detail
    assert lora_args("cpu", {}, {}) == {}  # without enable_lora, nothing is asked of torch
