"""Small sums, a task with a verifiable answer: "What is a + b? Reply with only the number."

An answer is right when the last number in it is the sum, so "3 + 4 = 7" counts and so does
"7". Every pair (a, b) of a range is split once, by a seed, into training pairs and held-out
pairs, so an evaluation never sees a pair the policy trained on.
"""

from __future__ import annotations

import random
import re

PROMPT = "What is {a} + {b}? Reply with only the number."
NUMBER = re.compile(r"-?\d+")


def messages(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": PROMPT.format(a=a, b=b)}]


def split(seed: int = 0, low: int = 1, high: int = 20, held_out: int = 100
          ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every pair with both numbers in [low, high], shuffled by `seed`: (training pairs,
    the `held_out` pairs kept for evaluation)."""
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    if not 0 < held_out < len(pairs):
        from rollout.contract.errors import InvalidRequestError

        raise InvalidRequestError("held_out", f"got {held_out}", f"1 to {len(pairs) - 1}")
    random.Random(seed).shuffle(pairs)
    return pairs[held_out:], pairs[:held_out]


def last_number(text: str) -> int | None:
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


def is_right(text: str, answer) -> bool:
    """A numeric `answer` (a number or its text) is right when it is the text's last number;
    any other answer when the text, stripped, is it."""
    try:
        return last_number(text) == int(answer)
    except ValueError:
        return text.strip() == str(answer).strip()


def rows(count: int, seed: int = 0, low: int = 1, high: int = 20) -> list[dict]:
    """`count` prompts as chat messages with their `answer`, pairs drawn with `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(low, high), rng.randint(low, high)
        out.append({"prompt": messages(a, b), "answer": str(a + b)})
    return out


def write(path: str, count: int, seed: int = 0, low: int = 1, high: int = 20) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows(count, seed, low, high))
    pq.write_table(table, path)
    return table.num_rows
