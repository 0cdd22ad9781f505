"""Turning a request's prompt into token ids, the same way for every backend.

Backends tokenize on the caller's side so that what only the model knows (its vocabulary,
its context length, its chat template) is checked per request, with the same error and
field name whatever engine runs behind.
"""

from __future__ import annotations

import json

from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import ImagePart, Message, Request


def prompt_field(request: Request) -> str:
    if request.prompt_token_ids is not None:
        return "prompt_token_ids"
    return "messages" if request.messages is not None else "prompt"


class PromptEncoder:
    """`image_token_id`: a vision-language model's image placeholder. A prompt holds it once
    per image (the collapsed form, which every engine takes: each backend expands it to the
    image's run of tokens for its model), and must hold exactly as many as it has images."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 image_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.image_token_id = image_token_id
        self._decode = _text_decoder(tokenizer)

    @classmethod
    def from_folder(cls, folder: str, max_model_len: int | None = None) -> PromptEncoder:
        """A model folder's encoder, as its backends build it: for a sampler whose engine
        runs in other processes (the folder's tokenizer and config are all it reads)."""
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(folder)
        text = config.get_text_config()  # (a vision-language model's is its text model's)
        return cls(AutoTokenizer.from_pretrained(folder), text.vocab_size,
                   max_model_len or getattr(text, "max_position_embeddings", 2048),
                   image_token_id=getattr(config, "image_token_id", None))

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; InvalidRequestError if the model cannot take them."""
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            if max(ids) >= self.vocab_size:  # (the schema refused an empty prompt)
                bad = next(t for t in ids if t >= self.vocab_size)
                raise InvalidRequestError("prompt_token_ids", f"token id {bad} is out of range",
                                          f"0 to {self.vocab_size - 1}")
        elif request.messages is not None:
            ids = self._chat(request)
        else:
            ids = self.tokenizer(request.prompt).input_ids
        bad = [t for t in request.sampling.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"sampling.logit_bias.{bad[0]}", "token id out of range",
                                      f"0 to {self.vocab_size - 1}")
        trace = request.sampling.trace_decode_token_ids
        if trace and max(trace) >= self.vocab_size:
            raise InvalidRequestError("sampling.trace_decode_token_ids",
                                      f"token id {max(trace)} is out of range",
                                      f"0 to {self.vocab_size - 1}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(prompt_field(request), f"{len(ids)} tokens is too long",
                                      f"at most {self.max_model_len - 1} tokens")
        if self.image_token_id is not None:
            self._check_placeholders(request, ids)
        return ids

    def _check_placeholders(self, request: Request, ids: list[int]) -> None:
        images = len(request.images) if request.messages is None else sum(
            len(m.images) for m in request.messages)
        placeholders = ids.count(self.image_token_id)
        if placeholders != images:
            field = "messages" if request.messages is not None else prompt_field(request)
            raise InvalidRequestError(
                field, f"{placeholders} image placeholders (token {self.image_token_id}) for "
                f"{images} images", "one placeholder token per image, in order")

    def _chat(self, request: Request) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "the model has no chat template",
                                      "prompt or prompt_token_ids")
        messages = [template_message(m) for m in request.messages]
        tools = [t.as_openai() for t in request.tools] if request.tools else None
        text = self._render(messages, tools)
        # A template that ignores tools or tool calls would drop them without a word.
        if tools and self._render(messages, None) == text:
            raise InvalidRequestError("tools", "the model's chat template does not render "
                                      "tool definitions", "a model whose template takes tools")
        calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
        if calls:
            bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
            if self._render(bare, tools) == text:
                raise InvalidRequestError(
                    f"messages[{calls[0]}].tool_calls", "the model's chat template does not "
                    "render tool calls", "a model whose template renders tool_calls")
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template raises what it likes
            raise InvalidRequestError("messages", f"the model's chat template failed: {exc}",
                                      "messages the template accepts") from None

    def decode(self, token_ids) -> str:
        """The text of `token_ids`, special tokens left out (streams call this twice a token)."""
        return self._decode(token_ids)


def _text_decoder(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight from the Rust tokenizer
    where transformers' decode is nothing more than that (a third of the time): a fast
    tokenizer whose class keeps transformers' own `_decode` and does no space clean-up."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    owner = next((c for c in type(tokenizer).__mro__ if "_decode" in vars(c)), None)
    plain = owner is not None and owner.__module__ == "transformers.tokenization_utils_tokenizers"
    if plain and backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces",
                                                     True):
        return lambda ids: backend.decode(list(ids), skip_special_tokens=True)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def template_message(message: Message) -> dict:
    """A message as chat templates take it (transformers' convention): content as text, or
    as parts where it has images; tool calls in OpenAI's shape with their arguments as an
    object where they parse as one."""
    out = {"role": message.role, "content": message.text}
    if message.images:  # parts, where the template places each image
        out["content"] = [{"type": "image"} if isinstance(p, ImagePart)
                          else {"type": "text", "text": p.text} for p in message.content]
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in message.tool_calls]
    for name in ("tool_call_id", "name"):
        if getattr(message, name) is not None:
            out[name] = getattr(message, name)
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text  # the model's own malformed call, rendered as it was
    return value if isinstance(value, dict) else text
