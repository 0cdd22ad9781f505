"""The kit: what backend authors use, public and documented (docs/writing-a-backend.md).

- `prompts`: `PromptEncoder`, a request's prompt as token ids (chat templates, tools,
  vocabulary and context-length checks), the same for every backend;
- `text`: stop strings by the contract's rule (`first_stop`), texts streamed as tokens come;
- `aio`: the engine loop every request runs on, loops on threads of their own, HTTP sessions;
- `process`: engine servers as child processes that die with their parent;
- `buckets`, `checkpoint`: weights packed into buckets, checked against a model folder;
- `structured`: a choice as a grammar, an engine's refusal of a constraint as the request's
  own error;
- `tiny_model`: the tiny random model the tests and the demo build.

Nothing here imports torch or an engine at import time.
"""
