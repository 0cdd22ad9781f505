"""The kit: what backend authors use, public and documented (docs/writing-a-backend.md).

- `prompts`: `PromptEncoder`, a request's prompt as token ids (chat templates, tools,
  vocabulary and context-length checks), the same for every backend;
- `text`: stop strings by the contract's rule (`first_stop`), texts streamed as tokens come;
- `aio`: the engine loop every request runs on, loops on threads of their own, HTTP sessions;
- `process`, `child_server`: engine servers as child processes that die with their parent,
  started, waited for, watched and stopped the same way for every engine;
- (weights in buckets, their transports and checks against a model folder: `rollout.weights`);
- `structured`: a choice as a grammar, an engine's refusal of a constraint as the request's
  own error;
- `sampler`: sampling in PyTorch with the contract's meaning of every field, for an engine
  that hands the backend logits (the HF and example backends);
- `tiny_model`: the tiny random model the tests and the demo build.

Only `sampler` imports torch at import time; nothing here imports an engine.
"""
