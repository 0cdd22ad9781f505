"""One step after any reload of vLLM's weights, shared by the worker extension
(`rollout_vllm.worker`) and the gloo transfer engine (`rollout_vllm.transfer_engine`), so
that neither imports the other: a tied output layer packed again."""

from __future__ import annotations


def refresh_tied_output(model, names) -> None:
    """Pack a tied output layer again after its embedding was reloaded. vLLM's reload skips
    `lm_head` when it shares the embedding's weight, and its CPU kernels run the output
    layer from a packed copy made at load time: without this, a model with tied embeddings
    (SmolLM2, for one) keeps computing its logits from the old embedding."""
    head = getattr(model, "lm_head", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if head is None or not tied or not any(n.endswith("embed_tokens.weight") for n in names):
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
