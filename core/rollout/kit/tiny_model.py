"""A tiny random Llama, a tiny random Qwen3-MoE and their tokenizer, built offline, for
tests and demos.

Nothing can be downloaded from a model hub here, so the tokenizer is trained on text made
up on the spot. Head size 32 is the smallest that vLLM's CPU attention accepts.
"""

from __future__ import annotations

import random
from pathlib import Path

VOCAB_SIZE = 512
# Tool definitions in a system turn, calls hermes-style (`<tool_call>{"name", "arguments"}
# </tool_call>`, the format vLLM's and SGLang's `hermes` parsers read), results in tool turns.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|><tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools></s>"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}"
    ", \"arguments\": {% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}"
    "</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
# Ordinary tokens (kept in decoded text) that tool-call parsers look for.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
SYLLABLES = "ka lo mi ne su ta ri po an el is on ur ex th qu ing ed er ly".split()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(400)]
    words += "the a of to and is in it you that def return if for print x y 0 1 2 3 + = ( ) : ,".split()
    return [" ".join(rng.choices(words, k=rng.randint(4, 16))) + rng.choice(".!?:\n") for _ in range(lines)]


def build_tokenizer(seed: int = 0, special: list[str] = SPECIAL,
                    chat_template: str = CHAT_TEMPLATE, **names: str | None):
    """A byte-level BPE trained on made-up text. `special`: its special tokens (the first
    three are pad, bos and eos unless `names` say otherwise, e.g. `bos_token=None`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    names = {"pad_token": special[0], "bos_token": special[1], "eos_token": special[2],
             **names}
    named = set(names.values())
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, **names, chat_template=chat_template,
        additional_special_tokens=[t for t in special if t not in named],
    )


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tokenizer and a seeded random Llama (safetensors) to `out_dir`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Wide initial weights make logits far apart, so greedy decoding has few near-ties
        # and outputs agree across engines.
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_moe(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model's tokenizer and a seeded random Qwen3-MoE (8 experts, 2 per
    token, in each of 2 layers) to `out_dir`: routed experts to read and replay."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
