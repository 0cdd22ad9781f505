"""A tiny random Qwen2-VL (a vision-language model) and its processor, built offline.

It loads on transformers, vLLM and SGLang (../shared/MULTIMODAL.md has what was measured):
head size 32 (vLLM's CPU attention), `mrope_section` [4, 6, 6] (half the head size), one
image = 16 tokens (the image processor's pixel limits), and `in_chans` in the vision config,
which SGLang reads and transformers 5 does not write.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollout.kit.tiny_model import build_tokenizer

IMAGE_PIXELS = (56 * 56, 112 * 112)  # min, max: an image becomes 4x4 merged patches
SPECIAL = ["<pad>", "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|vision_start|>",
           "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# ChatML. Images (one `<|image_pad|>` each, which the processor or engine expands) may sit in
# user and tool messages; tools and tool calls hermes-style, as the text tiny model's.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'tool' %}</tool_response>{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}"
    ", \"arguments\": {% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer_and_images(seed: int = 0):
    """The tokenizer (trained locally) and the image processor of a `Qwen2VLProcessor`.

    The processor object itself is not made: transformers builds it only with its video
    processor, which needs torchvision (absent here). The saved folder names it
    (processor_config.json) for engines that load it whole."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = build_tokenizer(seed, SPECIAL, CHAT_TEMPLATE, pad_token="<pad>",
                                bos_token=None, eos_token="<|im_end|>")
    images = Qwen2VLImageProcessorPil(min_pixels=IMAGE_PIXELS[0], max_pixels=IMAGE_PIXELS[1])
    return tokenizer, images


def build_tiny_vlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a processor and a seeded random Qwen2-VL (safetensors) to `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, images = build_tokenizer_and_images(seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [4, 6, 6]},
            eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"], bos_token_id=None,
            # Wide weights, far-apart logits: few greedy near-ties (as the text tiny model).
            initializer_range=0.2),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    images.save_pretrained(out)
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n")
    saved = json.loads((out / "config.json").read_text())
    saved["vision_config"]["in_chans"] = 3  # SGLang reads it
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return out
