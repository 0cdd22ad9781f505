"""Turning a request's prompt into token ids, the same way for every backend.

Backends tokenize on the caller's side so that what only the model knows (its vocabulary,
its context length, its chat template) is checked per request, with the same error and
field name whatever engine runs behind.
"""

from __future__ import annotations

from rollout.errors import InvalidRequestError
from rollout.schemas import Request


def prompt_field(request: Request) -> str:
    if request.prompt_token_ids is not None:
        return "prompt_token_ids"
    return "messages" if request.messages is not None else "prompt"


class PromptEncoder:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; InvalidRequestError if the model cannot take them."""
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError("prompt_token_ids", f"token id {bad[0]} is out of range",
                                          f"0 to {self.vocab_size - 1}")
        elif request.messages is not None:
            ids = self._chat(request)
        else:
            ids = self.tokenizer(request.prompt).input_ids
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(prompt_field(request), f"{len(ids)} tokens is too long",
                                      f"at most {self.max_model_len - 1} tokens")
        return ids

    def _chat(self, request: Request) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "the model has no chat template",
                                      "prompt or prompt_token_ids")
        messages = [{"role": m.role, "content": m.text} for m in request.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
