"""A trainer's forward pass over recorded tokens, for the tests that hold a sampler's
logprobs to it (torch, on a transformers causal LM)."""

from __future__ import annotations


def response_logprobs(model, prompt_ids, response_ids):
    """The model's logprob of each response token after the prompt and those before it."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt_ids) + list(response_ids)])
                       ).logits[0].float()
    scores = torch.log_softmax(logits[len(prompt_ids) - 1:-1], -1)
    return scores.gather(1, torch.tensor(list(response_ids))[:, None])[:, 0]


def logprobs_under(model):
    """`rollout.apps.rl.largest_gap`'s callable over trajectories (`prompt_ids`,
    `response_ids`), under the model's present weights whatever the version asked: the
    caller loads a version's weights first."""
    return lambda version, trajectories: [
        response_logprobs(model, t.prompt_ids, t.response_ids) for t in trajectories]
