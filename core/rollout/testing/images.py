"""Image prompts that every backend with the `images` capability is checked on against the
HF backend (greedy tokens on the tiny Qwen2-VL of `rollout.kit.tiny_vlm`): random pictures,
messages with image parts, and the cases compared."""

from __future__ import annotations

import numpy as np
from PIL import Image

TOOLS = [{"name": "look", "description": "Look at a picture.",
          "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}]


def picture(seed: int, size=(100, 80)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def ask(*parts, role="user") -> dict:
    """A message of text (str) and image (anything else) parts."""
    return {"role": role, "content": [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p}
        for p in parts]}


def greedy(messages, max_tokens=12, **fields) -> dict:
    return {"messages": messages, **fields,
            "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}


CASES = {
    "one image": greedy([ask(picture(0), "what is this?")]),
    "two images": greedy([ask("compare", picture(1, (112, 112)), "and", picture(2, (60, 140)))],
                         9),
    "a large image": greedy([{"role": "system", "content": "be brief"},
                             ask(picture(3, (300, 200)), "then?")], 15),
    "text only": greedy([{"role": "user", "content": "hello there"}], 10),
    "an image in a tool message": greedy([
        {"role": "user", "content": "look at it"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "name": "look", "arguments": "{\"x\": 1}"}]},
        {**ask(picture(5), "here it is", role="tool"), "tool_call_id": "c1"},
    ], tools=TOOLS),
}
