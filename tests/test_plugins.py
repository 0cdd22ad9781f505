"""Backend discovery through real entry points (distributions written to a temp folder)."""

import sys
import textwrap

import pytest

import rollout
from rollout import PluginLoadError, UnknownBackendError
from rollout.contract.plugins import BLOCK_ENV, available_backends

# A backend that is no engine at all: it returns the prompt's token ids reversed. It tests
# discovery and the contract checks of registration, nothing an engine does.
REVERSER = '''
import rollout


class Ids:
    def encode(self, request):
        return list(request.prompt_token_ids or (1,))

    def decode(self, token_ids):
        return ""


class Reverser:
    def __init__(self, model, greeting="hi"):
        self.model = model

    @rollout.hookimpl
    def capabilities(self):
        return rollout.Capabilities(unsupported={
            c: "reverser has none" for c in
            ("release", "update_weights", "logprobs", "seed", "chat", "images")})

    @rollout.hookimpl
    def prompt_encoder(self):
        return Ids()

    @rollout.hookimpl
    async def generate(self, request, prompt_token_ids):
        ids = tuple(reversed(prompt_token_ids))[: request.sampling.max_tokens]
        for i in range(request.sampling.n):
            yield rollout.Chunk(i, ids, finish_reason="length")
'''


def install(root, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[rollout.backends]\n{lines}\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(BLOCK_ENV, raising=False)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[name]


def test_loads_only_the_chosen_backend(site):
    install(site, "fake-one", {"one": "fake_one:Reverser"}, {"fake_one": REVERSER})
    install(site, "fake-two", {"two": "fake_two:Reverser"}, {"fake_two": REVERSER})
    backend = rollout.load_backend("one", model="m")
    assert "fake_one" in sys.modules and "fake_two" not in sys.modules
    (completion,) = backend.generate([{"prompt_token_ids": [1, 2, 3]}])
    assert completion.unwrap()[0].token_ids == (3, 2, 1)


def test_unknown_name_lists_installed_and_how_to_install(site):
    install(site, "fake-one", {"one": "fake_one:Reverser"}, {"fake_one": REVERSER})
    with pytest.raises(UnknownBackendError) as info:
        rollout.load_backend("nope", model="m")
    assert "one" in str(info.value)
    assert 'pip install "rollout-core[nope]"' in str(info.value)


def test_broken_plugin_is_named_and_others_still_work(site):
    install(site, "fake-broken", {"broken": "fake_broken:Backend"},
            {"fake_broken": "import does_not_exist_anywhere\n"})
    install(site, "fake-one", {"one": "fake_one:Reverser"}, {"fake_one": REVERSER})
    with pytest.raises(PluginLoadError) as info:
        rollout.load_backend("broken", model="m")
    message = str(info.value)
    assert "broken" in message and "fake-broken" in message
    assert "does_not_exist_anywhere" in message and BLOCK_ENV in message
    assert rollout.load_backend("one", model="m").generate([{"prompt": "x"}])[0].ok


def test_environment_variable_blocks_a_backend(site, monkeypatch):
    install(site, "fake-one", {"one": "fake_one:Reverser"}, {"fake_one": REVERSER})
    monkeypatch.setenv(BLOCK_ENV, "one, other")
    assert "one" not in available_backends()
    with pytest.raises(UnknownBackendError, match="blocked"):
        rollout.load_backend("one", model="m")


def test_two_providers_of_one_name_is_an_error(site):
    install(site, "fake-one", {"dup": "fake_one:Reverser"}, {"fake_one": REVERSER})
    install(site, "fake-two", {"dup": "fake_two:Reverser"}, {"fake_two": REVERSER})
    with pytest.raises(PluginLoadError, match="provided twice"):
        rollout.load_backend("dup", model="m")


def test_unknown_backend_option_is_named(site):
    install(site, "fake-one", {"one": "fake_one:Reverser"}, {"fake_one": REVERSER})
    with pytest.raises(rollout.InvalidRequestError) as info:
        rollout.load_backend("one", model="m", batch=3)
    assert info.value.field == "backend_options" and "greeting" in info.value.allowed


def test_hf_backend_is_registered():
    assert "hf" in available_backends()
