"""The sums task: a seeded split with no pair in both halves, the answer check, and the
batch job's count of right answers."""

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from rollout.apps.datasets import sums
from rollout.apps.jobs.tables import answer_counts


def test_the_split_is_seeded_and_disjoint():
    train, held_out = sums.split(seed=3, held_out=100)
    assert len(train) == 300 and len(held_out) == 100
    assert not set(train) & set(held_out)
    assert sums.split(seed=3, held_out=100) == (train, held_out)
    assert sums.split(seed=4, held_out=100)[1] != held_out


def test_the_last_number_is_the_answer():
    assert sums.is_right("3 + 4 = 7", 7) and sums.is_right("7", "7")
    assert not sums.is_right("7 + 4 = 3", 7) and not sums.is_right("seven", 7)
    assert sums.is_right("-2", "-2")
    assert sums.is_right(" Paris ", "Paris") and not sums.is_right("Lyon", "Paris")


def test_answer_counts_cover_every_sample_and_failed_rows():
    table = pa.table({"answer": ["5", "3", None, "4"],
                      "responses": [["2 + 3 = 5", "6"], ["3"], ["x"], None]})
    assert answer_counts(table) == {"answers": {"checked": 4, "right": 2, "accuracy": 0.5}}
    assert answer_counts(pa.table({"responses": [["1"]]})) == {}


def test_data_sums_writes_prompts_with_answers(tmp_path):
    out = tmp_path / "sums.parquet"
    done = subprocess.run([sys.executable, "-m", "rollout", "data", "sums", str(out), "--count", "5",
                           "--high", "9", "--seed", "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 5
    for row in rows:
        a, b = map(int, row["prompt"][0]["content"].removeprefix("What is ").split("?")[0]
                   .split(" + "))
        assert 1 <= a <= 9 and 1 <= b <= 9 and row["answer"] == str(a + b)
