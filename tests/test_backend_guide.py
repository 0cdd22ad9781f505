"""docs/writing-a-backend.md shows the example backend's code: every excerpt that names a
file of the repository must be in that file, word for word, so the guide cannot drift."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "writing-a-backend.md"
EXCERPT = re.compile(r"```(?:python|toml)\n# (plugins/\S+)\n(.*?)```", re.S)


def test_every_excerpt_of_the_guide_is_in_the_named_file():
    excerpts = EXCERPT.findall(GUIDE.read_text())
    assert len(excerpts) >= 5  # the guide walks through the example's parts
    for path, code in excerpts:
        source = (ROOT / path).read_text()
        assert code in source, f"the guide's excerpt of {path} differs from the file:\n{code}"
