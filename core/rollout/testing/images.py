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


# --- agent trajectories with an image in each tool result ----------------------------------

LOOK_REGEX = r'<tool_call>\{"name": "look", "arguments": \{"n": [0-9]\}\}</tool_call>'
SEEN_REGEX = r"I saw [0-9] pictures\."


def look(n: int) -> list:
    """Look at a picture.

    Args:
        n: which picture
    """
    return [f"picture {n}:", picture(40 + n, (56 + 8 * n, 56))]


def look_task(calls: int = 3):
    """`calls` turns forced to call `look` (each tool result holds a new picture), then one
    forced to answer."""
    from rollout.apps.agents import Environment

    class LookTask(Environment):
        def sampling(self, row, turn, messages):
            regex = LOOK_REGEX if turn < calls else SEEN_REGEX
            return {"structured_outputs": {"regex": regex}}

    return LookTask([look], reward_fn=lambda row, messages: 1.0)


LOOK_ROWS = [{"prompt": "look at the pictures"}, {"messages": [ask(picture(7), "and these")]}]


def run_look(ro, rows=LOOK_ROWS, calls: int = 3, **config) -> list:
    """Greedy trajectories of `look_task` on a Rollout."""
    import asyncio

    return asyncio.run(run_look_async(ro, rows, calls, **config))


async def run_look_async(target, rows=LOOK_ROWS, calls: int = 3, tokenizer=None, **config
                         ) -> list:
    """Greedy trajectories of `look_task` on `target` (a Sampler; one in other processes
    with the model's `tokenizer`)."""
    from rollout import SamplingParams
    from rollout.apps.agents import AgentConfig, AgentRunner

    sampling = SamplingParams(temperature=0, max_tokens=100, logprobs=0)
    runner = AgentRunner(target, look_task(calls), AgentConfig(sampling=sampling, **config),
                         tokenizer=tokenizer)
    return await runner.run_many(rows)


def check_against_the_processor(t, model_dir) -> None:
    """verl's delta check: the tokens and images a trajectory built turn by turn are what
    the model's processor makes of the whole conversation at once. Tokens are compared as
    text (the model's own samples keep their token boundaries, which a re-tokenization may
    not), with one placeholder per image in the same places; each image's pixels processed
    alone are its rows of the whole conversation's pixels."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from rollout.kit.images import load_image
    from rollout.kit.prompts import template_message

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    held = (t.prompt_ids + t.response_ids)[:t.turns[-1].prompt_tokens]
    # The conversation up to the last turn's prompt: all but its own answer.
    before = [template_message(m) for m in t.messages[:-1]]
    text = tokenizer.apply_chat_template(before, tools=[_spec()], add_generation_prompt=True,
                                         tokenize=False)
    assert tokenizer.decode(held, skip_special_tokens=False) == text
    assert held.count(pad) == tokenizer(text, add_special_tokens=False).input_ids.count(pad)
    parts = [p for m in t.messages for p in m.images]
    assert [image.id for image in t.images] == [load_image(p.image, "x").id for p in parts]
    pictures = [image.image for image in t.images]
    whole = processor(images=pictures, return_tensors="pt")
    alone = [processor(images=[p], return_tensors="pt") for p in pictures]
    assert torch.equal(whole["pixel_values"], torch.cat([a["pixel_values"] for a in alone]))
    assert torch.equal(whole["image_grid_thw"], torch.cat([a["image_grid_thw"] for a in alone]))


def _spec() -> dict:
    from rollout.apps.agents.tools import function_tool

    return function_tool(look).spec.as_openai()
