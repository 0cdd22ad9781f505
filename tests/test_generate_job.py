"""`rollout generate` end to end: real CLI process, real HF backend, tiny model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]


def rollout_cli(*args, check=True, **kwargs):
    out = subprocess.run([sys.executable, "-m", "rollout", *map(str, args)],
                         capture_output=True, text=True, timeout=300, **kwargs)
    if check and out.returncode != 0:
        raise AssertionError(out.stderr)
    return out


def write_prompts(path, prompts, **extra_columns):
    pq.write_table(pa.table({"prompt": prompts, **extra_columns}), path)
    return path


def test_shipped_example_runs_with_n_responses(tiny_model, tmp_path):
    out = tmp_path / "out.parquet"
    result = rollout_cli("generate", "--backend", "hf", "--model", tiny_model,
                         "--input", ROOT / "examples" / "prompts.parquet", "--output", out,
                         "--n", 3, "--temperature", 0.8, "--max-tokens", 8, "--seed", 1)
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    table = pq.read_table(out).to_pylist()
    source = pq.read_table(ROOT / "examples" / "prompts.parquet").to_pylist()
    assert len(table) == len(source) == stats["prompts"]
    assert stats["samples"] == 3 * len(source) and stats["errors"] == 0
    for row, original in zip(table, source):
        assert row["id"] == original["id"] and row["topic"] == original["topic"]
        assert len(row["responses"]) == len(row["finish_reasons"]) == 3
        assert all(0 < c <= 8 for c in row["completion_tokens"])
        assert [len(t) for t in row["response_token_ids"]] == row["completion_tokens"]
        assert row["prompt_tokens"] > 0 and row["error"] is None


def test_config_file_and_text_prompts(tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "in.parquet", ["the ka lo", "def x", "mi ne"])
    config = tmp_path / "job.yaml"
    config.write_text(f"backend: hf\nmodel: {tiny_model}\ninput: {prompts}\n"
                      f"output: {tmp_path / 'out.parquet'}\n"
                      "sampling: {temperature: 0, max_tokens: 5}\n"
                      "backend_options: {batch_size: 2}\n")
    rollout_cli("generate", "--config", config)
    first = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [len(r["responses"]) for r in first] == [1, 1, 1]
    # The command line wins over the file.
    rollout_cli("generate", "--config", config, "--max-tokens", 2,
                "--output", tmp_path / "short.parquet")
    short = pq.read_table(tmp_path / "short.parquet").to_pylist()
    assert all(r["completion_tokens"] == [2] for r in short)
    assert [r["response_token_ids"][0] for r in short] == [
        r["response_token_ids"][0][:2] for r in first]  # greedy: a prefix


def test_the_whole_sampling_vocabulary_from_a_config_file(tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "in.parquet", ["the ka lo", "def x"])
    config = tmp_path / "job.yaml"
    config.write_text(f"backend: hf\nmodel: {tiny_model}\ninput: {prompts}\n"
                      f"output: {tmp_path / 'out.parquet'}\n"
                      "sampling: {n: 3, temperature: 1.0, max_tokens: 16, min_p: 0.05,\n"
                      "  repetition_penalty: 1.2, frequency_penalty: 0.5, min_tokens: 1,\n"
                      "  logit_bias: {5: -100},\n"
                      "  structured_outputs: {choice: ['yes', 'no', maybe]}}\n")  # YAML: yes is true
    rollout_cli("generate", "--config", config)
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert all(set(r["responses"]) <= {"yes", "no", "maybe"} for r in rows)
    assert all(r["error"] is None and len(r["responses"]) == 3 for r in rows)


def test_a_bad_row_fails_alone(tiny_model, tmp_path):
    rows = [[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}],
            [{"role": "user", "content": "the ka"}]]
    prompts = write_prompts(tmp_path / "in.parquet", rows)
    rollout_cli("generate", "--backend", "hf", "--model", tiny_model, "--input", prompts,
                "--output", tmp_path / "out.parquet", "--max-tokens", 3, "--temperature", 0)
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert table[0]["error"] is None and table[2]["error"] is None
    assert "role" in table[1]["error"] and table[1]["responses"] is None


def test_image_prompts_from_parquet(tmp_path):
    """Image parts as Arrow structs (the image as bytes); a bad image fails its row alone."""
    import io

    from PIL import Image

    import rollout
    from rollout.kit.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "vlm")
    png = io.BytesIO()
    Image.new("RGB", (60, 40), (200, 10, 90)).save(png, format="PNG")

    def ask(image):
        return [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "what is it?"}]}]

    prompts = write_prompts(tmp_path / "in.parquet",
                            [ask(png.getvalue()), ask(b"not an image")])
    rollout_cli("generate", "--backend", "hf", "--model", model, "--input", prompts,
                "--output", tmp_path / "out.parquet", "--max-tokens", 4, "--temperature", 0)
    good, bad = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert "messages[0].content[0]" in bad["error"] and "not a readable image" in bad["error"]
    with rollout.load_backend("hf", model=str(model)) as ro:
        alone = ro.generate([{"messages": ask(png.getvalue()),
                              "sampling": {"temperature": 0, "max_tokens": 4}}])[0]
    assert good["error"] is None
    assert good["response_token_ids"] == [list(alone.unwrap()[0].token_ids)]


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "sampling.temperature"),
    (["--n", "2", "--temperature", "0"], "sampling.n"),
    (["--backend", "nope"], "installed backends"),
    (["-o", "batch_size=0"], "batch_size"),
    (["-o", "colour=red"], "backend_options"),
])
def test_bad_settings_stop_before_generation(tiny_model, tmp_path, args, message):
    prompts = write_prompts(tmp_path / "in.parquet", ["a"])
    base = ["--backend", "hf", "--model", tiny_model, "--input", prompts,
            "--output", tmp_path / "out.parquet"]
    result = rollout_cli("generate", *base, *args, check=False)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out.parquet").exists()


def test_missing_column_and_unreadable_input(tmp_path):
    pq.write_table(pa.table({"question": ["a"]}), tmp_path / "in.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    for source, message in [(tmp_path / "in.parquet", "no 'prompt' column"),
                            (tmp_path / "junk.parquet", "cannot read"),
                            (tmp_path / "absent.parquet", "cannot read")]:
        result = rollout_cli("generate", "--backend", "hf", "--model", tmp_path, "--input",
                             source, "--output", tmp_path / "o.parquet", check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_killed_job_resumes_without_losing_or_repeating_rows(tiny_model, tmp_path):
    count = 24
    prompts = write_prompts(tmp_path / "in.parquet", [f"the ka {i}" for i in range(count)],
                            idx=list(range(count)))
    out = tmp_path / "out.parquet"
    args = ["generate", "--backend", "hf", "--model", tiny_model, "--input", prompts,
            "--output", out, "--chunk-size", 2, "--max-tokens", 48, "--temperature", 0.7,
            "--seed", 3, "--quiet", "-o", "batch_size=2"]
    job = subprocess.Popen([sys.executable, "-m", "rollout", *map(str, args)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = Path(str(out) + ".parts")
    deadline = time.monotonic() + 120
    while len(list(parts.glob("part-*.parquet"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(job.pid, signal.SIGKILL)
    job.wait(30)
    done_before = len(list(parts.glob("part-*.parquet")))
    assert 2 <= done_before < count // 2 and not out.exists()

    result = rollout_cli(*args)
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["samples"] == count - 2 * done_before  # finished chunks were kept
    table = pq.read_table(out).to_pylist()
    assert [r["idx"] for r in table] == list(range(count))
    assert all(len(r["responses"]) == 1 and r["error"] is None for r in table)
    assert not parts.exists()

    again = tmp_path / "again.parquet"
    rollout_cli(*[again if a == out else a for a in args])
    assert pq.read_table(again).to_pylist() == table  # seeded: same as an unbroken run


def test_backends_command_lists_hf_with_capabilities():
    result = rollout_cli("backends")
    assert "hf  (rollout-hf" in result.stdout
    lines = [line.split(None, 1) for line in result.stdout.splitlines()[1:]]
    assert ["images", "yes"] in lines  # with a vision-language model
    assert ["structured_outputs.grammar", "yes"] in lines and ["tools", "yes"] in lines
