"""Judges from other distributions, found through the entry-point group `rollout.judges`."""

import sys

import pytest

from rollout.contract.errors import PluginLoadError
from rollout.apps.judges import ProgramTests, Sample, available_judges, load_judge

# A judge that runs nothing and says every program passed: enough to test discovery and
# that a plugin only has to say how one case runs.
OPTIMIST = '''
from rollout.apps.judges.base import Judge
from rollout.apps.judges.harness import Limits, Outcome


class Optimist(Judge):
    name = "optimist"

    def __init__(self, concurrency=1):
        self.limits, self.concurrency = Limits(), concurrency

    def execute(self, run):
        return Outcome(exit_code=0, stdout=run.marker or run.expected)
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    info = tmp_path / "fake_judges-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-judges\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[rollout.judges]\noptimist = fake_optimist:Optimist\nbroken = fake_broken:Judge\n")
    (tmp_path / "fake_optimist.py").write_text(OPTIMIST)
    (tmp_path / "fake_broken.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[name]


def test_a_third_party_judge_is_found_and_used(site):
    assert {"local", "sandbox-fusion", "optimist", "broken"} <= set(available_judges())
    judge = load_judge("optimist", concurrency=2)
    tests = ProgramTests("def check(c):\n    assert False\n", "f")
    verdicts = judge.judge([Sample("```python\ndef f(): pass\n```", tests), Sample("none", tests)])
    assert [v.status for v in verdicts] == ["success", "no_code"]  # extraction is shared


def test_a_judge_that_fails_to_import_says_which(site):
    with pytest.raises(PluginLoadError) as info:
        load_judge("broken")
    assert "judge 'broken' (fake-judges" in str(info.value)
    assert "not_a_module_anywhere" in str(info.value)
