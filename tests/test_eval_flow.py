"""`rollout data humaneval`, `rollout generate` and `rollout eval` end to end, and the
figures, the code extraction and the tests format they rest on."""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.contract.errors import InvalidRequestError
from rollout.apps.judges import STATUSES, ProgramTests, StdioTests, parse_tests
from rollout.apps.judges.extract import extract_code, syntax_error
from rollout.apps.pass_at_k import ks_for, pass_at_k, summarize
from test_generate_job import rollout_cli


def test_whole_flow_with_the_hf_backend(tiny_model, tmp_path):
    problems = tmp_path / "humaneval.parquet"
    rollout_cli("data", "humaneval", problems)
    table = pq.read_table(problems)
    assert table.num_rows == 164
    assert set(table.column_names) == {"task_id", "prompt", "tests", "canonical_solution"}
    few = tmp_path / "few.parquet"
    pq.write_table(table.slice(0, 3), few)
    generated = tmp_path / "generated.parquet"
    rollout_cli("generate", "--backend", "hf", "--model", tiny_model, "--input", few,
                "--output", generated, "--n", 2, "--temperature", 1.0, "--max-tokens", 24,
                "--seed", 0, "--quiet")
    judged = tmp_path / "judged.parquet"
    result = rollout_cli("eval", "--input", generated, "--output", judged, "--quiet")
    assert result.stdout.strip() == str(judged)
    summary = json.loads((tmp_path / "judged.json").read_text())
    rows = pq.read_table(judged).to_pylist()
    assert len(rows) == summary["samples"] == 6 and summary["problems"] == 3
    assert [(r["problem_id"], r["sample"]) for r in rows] == [
        (f"HumanEval/{i}", s) for i in range(3) for s in range(2)]
    assert all(r["status"] in STATUSES for r in rows)
    assert summary["statuses"] == {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    assert set(summary["pass@k"]) == {"1", "2"}
    assert 0 <= summary["accepted@1"] <= summary["pass@k"]["2"] <= 1
    assert summary["mean_pass_ratio"] == pytest.approx(sum(r["pass_ratio"] for r in rows) / 6,
                                                       abs=1e-6)
    assert summary["judge"]["name"] == "local" and summary["skipped_rows"] == 0
    assert (tmp_path / "judged.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_of_canonical_answers_with_bad_rows(tmp_path):
    rows = [{"task_id": "a", "responses": ["```python\ndef f():\n    return 1\n```", "no"],
             "tests": json.dumps({"test": "def check(c):\n    assert c() == 1\n",
                                  "entry_point": "f"}), "error": None},
            {"task_id": "b", "responses": ["```python\nprint(input())\n```"],
             "tests": json.dumps({"inputs": ["x"], "outputs": ["x"]}), "error": None},
            {"task_id": "c", "responses": ["x"], "tests": '{"inputs": ["1"]}', "error": None},
            {"task_id": "d", "responses": None, "tests": "{}", "error": "prompt: too long"}]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    result = rollout_cli("eval", "--input", source, "--output", tmp_path / "out.parquet",
                         "--summary", tmp_path / "s.json", "--no-chart", "-o", "timeout=120")
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["problems"] == 2 and summary["samples"] == 3
    assert summary["accepted@1"] == 1.0 and summary["pass@k"] == {"1": 0.75}
    assert summary["statuses"]["success"] == 2 and summary["statuses"]["no_code"] == 1
    assert [s["row"] for s in summary["skipped"]] == [2, 3]
    assert "tests.outputs" in summary["skipped"][0]["reason"]
    assert "too long" in summary["skipped"][1]["reason"]
    assert "skipped row 2 (c)" in result.stderr
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize("args, message", [
    (["--judge", "docker"], "installed"),
    (["-o", "colour=red"], "judge_options.colour"),
    (["-o", "timeout=-1"], "judge_options.timeout"),
    (["--id-column", "name"], "id_column"),
])
def test_bad_settings_exit_2_before_judging(tmp_path, args, message):
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"responses": [["x"]], "tests": ['{"inputs": ["1"], "outputs": ["1"]}']}),
                   source)
    result = rollout_cli("eval", "--input", source, "--output", tmp_path / "o.parquet", *args,
                         check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "o.parquet").exists()


def test_missing_columns_and_unreadable_input(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"], "responses": [["x"]]}), tmp_path / "in.parquet")
    for source, message in [(tmp_path / "in.parquet", "no 'tests' column"),
                            (tmp_path / "absent.parquet", "cannot read")]:
        result = rollout_cli("eval", "--input", source, "--output", tmp_path / "o.parquet",
                             check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("n, c, k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (5, 2, 4),
                                     (10, 0, 10), (10, 9, 2), (7, 3, 7)])
def test_pass_at_k_is_the_chance_that_one_of_k_draws_passes(n, c, k):
    draws = list(combinations([True] * c + [False] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_pass_at_k_is_stable_for_large_n():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 500, 100) == pytest.approx(
        1 - math.comb(500, 100) / math.comb(1000, 100))
    assert ks_for(1) == [1] and ks_for(8) == [1, 2, 5, 8] and ks_for(0) == []


def test_summary_counts_the_first_sample_for_accepted_at_1():
    figures = summarize([["wrong_answer", "success"], ["success", "timeout"]],
                        [0.5, 1.0, 1.0, 0.0], ["success"] * 3)
    assert figures["accepted@1"] == 0.5 and figures["pass@k"] == {"1": 0.5, "2": 1.0}
    assert figures["statuses"]["timeout"] == 1 and figures["mean_pass_ratio"] == 0.625


@pytest.mark.parametrize("response, code", [
    ("Sure:\n```python\nx = 1\n```\nand\n```python\ny = 2\n```", "x = 1"),
    ("```\nplain = 1\n```", "plain = 1"),
    ("```bash\nls\n```\n```py\nz = 3\n```", "z = 3"),
    ("```bash\nls\n```", None),
    ("  ```python\n  def f():\n      return 1\n  ```", "def f():\n    return 1"),
    ("```python\ncut = [1,", "cut = [1,"),  # cut off at the token limit
    ("~~~python\nt = 1\n~~~", "t = 1"),
    ("no code at all", None),
    ("```python\n   \n```", None),
])
def test_code_extraction(response, code):
    assert extract_code(response) == code


def test_whole_response_and_syntax_check():
    assert extract_code("x = 1", whole_response=True) == "x = 1"
    assert extract_code("  \n", whole_response=True) is None
    assert syntax_error("def f(:\n    pass") .startswith("SyntaxError")
    assert "outside function" in syntax_error("return 1")  # found by compiling, not parsing
    assert "null bytes" in syntax_error("a = 1\0")
    assert syntax_error("def f():\n    return 1") is None


@pytest.mark.parametrize("cell, field", [
    ("not json", "tests"), ("[1]", "tests"), ('{"cases": []}', "tests"),
    ('{"inputs": ["1"], "outputs": []}', "tests.outputs"),
    ('{"inputs": [], "outputs": []}', "tests.inputs"),
    ('{"test": "", "entry_point": "f"}', "tests.test"),
    ('{"test": "x", "entry_point": "f", "colour": 1}', "tests.colour"),
    ('{"test": "x", "entry_point": 3}', "tests.entry_point"),
])
def test_bad_tests_cells_name_the_field(cell, field):
    with pytest.raises(InvalidRequestError) as info:
        parse_tests(cell)
    assert info.value.field == field, info.value


def test_tests_cells_as_json_or_struct():
    assert parse_tests('{"inputs": ["1"], "outputs": ["2"]}') == StdioTests(("1",), ("2",))
    struct = {"test": "t", "entry_point": "f", "prefix": None, "inputs": None}
    assert parse_tests(struct) == ProgramTests("t", "f")


def test_killed_eval_resumes_without_judging_again(tmp_path):
    slow = "```python\nimport time\ntime.sleep(0.2)\nprint(input())\n```"
    count = 16
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"responses": [[slow]] * count,
                             "tests": [json.dumps({"inputs": [str(i)], "outputs": [str(i)]})
                                       for i in range(count)]}), source)
    out = tmp_path / "out.parquet"
    args = ["eval", "--input", source, "--output", out, "--chunk-size", 2, "--quiet",
            "--no-chart", "-o", "concurrency=1"]
    run = subprocess.Popen([sys.executable, "-m", "rollout", *map(str, args)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = Path(str(out) + ".parts")
    deadline = time.monotonic() + 60
    while len(list(parts.glob("part-*.parquet"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)
    run.wait(30)
    done = len(list(parts.glob("part-*.parquet")))
    assert 2 <= done < count // 2 and not out.exists()
    other = rollout_cli(*args[:-1], "concurrency=2", check=False)
    assert other.returncode == 2 and "different evaluation" in other.stderr
    rollout_cli(*args)
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["resumed_samples"] == 2 * done and summary["samples"] == count
    rows = pq.read_table(out).to_pylist()
    assert [r["row"] for r in rows] == list(range(count))
    assert all(r["status"] == "success" for r in rows) and not parts.exists()
    # The killed run's case folder (SIGKILL skips every clean-up) went with the next run.
    assert not list(Path(tempfile.gettempdir()).glob(f"rollout-judge-{run.pid}-*"))
