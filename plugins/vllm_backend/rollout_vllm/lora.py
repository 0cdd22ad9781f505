"""LoRA adapters from tensors, inside vLLM's worker (vLLM itself loads them from folders
only). The worker keeps each adapter's tensors under our LoRA id, which its `lora_path`
names, and vLLM's loader builds an adapter from them instead of from the path: when it is
loaded, and again whenever vLLM's LRU cache evicted it and a request needs it back (from a
path that does not exist, vLLM's loader would kill the engine). Through vLLM's server the
tensors come first (`keep`), then the server's `/v1/load_lora_adapter` loads the adapter
under an id of the server's own: the path still names ours.

Fixes to vLLM 0.32 on the way:
- its loader scales `lora_B` in place (`LoRALayerWeights.optimize`) on tensors it did not
  copy, so it gets copies: an adapter built twice would be scaled twice;
- on CPU (`fix_cpu_ops`, from the worker's start): its ops (`torch_ops.bgmv_*`) gather each
  row's adapter weights (a copy per token, 4x slower than the base model on SmolLM2), and
  rows without an adapter (index -1) take the last slot's (upstream: vllm-project/vllm#48421,
  #49656). They are replaced by one matrix product per adapter in the batch, which leaves
  rows without one as they are, as vLLM's GPU kernels do. And its LoRA on the logits
  indexes per request where prompt logprobs give a row per prompt token, which kills the
  engine: rollout loads no adapter of the head (`read_adapter` refuses it), so that step,
  which adds zeros, is left out.
"""

from __future__ import annotations

import types

# Where a request's LoRA path points: nowhere on disk. vLLM's prefix cache keys on the
# name and path, so each load (a new id) gets its own cache entries.
SCHEME = "rollout-adapter://"
PATH = SCHEME + "{name}/{lora_id}"


def lora_request(name: str, lora_id: int):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{name}@{lora_id}", lora_id, PATH.format(name=name, lora_id=lora_id))


def from_bytes(data: bytes) -> dict:
    """An adapter's tensors from the safetensors bytes it crossed a process boundary as."""
    from safetensors.torch import load

    return load(data if isinstance(data, bytes) else bytes(data))


def keep(worker, lora_id: int, config: dict, tensors: dict) -> None:
    """Keep adapter `lora_id`'s tensors (PEFT's names; tensors no one else writes to) for
    vLLM's loader."""
    manager = _tensor_loading(worker.model_runner.lora_manager)
    manager.rollout_tensors[lora_id] = (config, tensors)


def load(worker, lora_id: int, config: dict, tensors: dict) -> None:
    """Keep adapter `lora_id` and load it now, so that what vLLM refuses is refused here,
    not in a step."""
    keep(worker, lora_id, config, tensors)
    try:
        worker.model_runner.lora_manager.add_adapter(lora_request("load", lora_id))
    except BaseException:
        unload(worker, lora_id)
        raise


def unload(worker, lora_id: int) -> None:
    """Drop adapter `lora_id`'s tensors and every id vLLM loaded it under."""
    manager = worker.model_runner.lora_manager
    getattr(manager, "rollout_tensors", {}).pop(lora_id, None)
    loaded = getattr(manager, "rollout_loaded", {})
    for vllm_id in [i for i, ours in loaded.items() if ours == lora_id] or [lora_id]:
        loaded.pop(vllm_id, None)
        manager.remove_adapter(vllm_id)


def _our_id(request) -> int | None:
    path = request.lora_path or ""
    return int(path.rsplit("/", 1)[1]) if path.startswith(SCHEME) else None


def _tensor_loading(manager):
    """`manager` (vLLM's LRUCacheWorkerLoRAManager), its loader reading our tensors first."""
    if hasattr(manager, "rollout_tensors"):
        return manager
    manager.rollout_tensors = {}
    manager.rollout_loaded = {}  # vLLM's id of each adapter built from our tensors -> ours
    from_path = manager._load_adapter

    def load_adapter(self, request):
        ours = _our_id(request)
        kept = self.rollout_tensors.get(ours)
        if kept is None:
            return from_path(request)
        self.rollout_loaded[request.lora_int_id] = ours
        from vllm.lora.peft_helper import PEFTHelper

        config, tensors = kept
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": self.max_position_embeddings})
        helper.validate_legal(self.lora_config)
        model = self._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        adapter = self._lora_model_cls.from_lora_tensors(
            lora_model_id=request.lora_int_id,
            tensors={k: v.clone() for k, v in tensors.items()},
            peft_helper=helper, device="cpu", dtype=self.lora_config.lora_dtype,
            model_vocab_size=self.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        self._adapter_manager._validate_modules_to_save(adapter)
        return adapter

    manager._load_adapter = types.MethodType(load_adapter, manager)
    return manager


def fix_cpu_ops() -> None:
    """Where vLLM runs on CPU: its LoRA ops replaced (the module's docstring says why)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu
    from vllm.lora.ops.torch_ops import lora_ops

    punica_cpu.PunicaWrapperCPU.add_lora_logits = _no_head_adapter
    for name, grouped in (("bgmv_shrink", _shrink), ("bgmv_expand", _expand),
                          ("bgmv_expand_slice", _expand_slice)):
        op = getattr(lora_ops, name)
        if getattr(op, "grouped", False):
            continue
        fixed = _by_adapter(grouped, op)
        setattr(lora_ops, name, fixed)  # the sgmv_* ops call these through the module
        setattr(punica_cpu, name, fixed)


def _no_head_adapter(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs) -> None:
    return None  # no adapter of the head is ever loaded: its delta is zero


def _by_adapter(grouped, original):
    """vLLM's op as one matrix product per adapter in the batch, on that adapter's rows
    (vLLM's gathers every row's weights first: a copy of them per token); rows without an
    adapter (index -1) are left as they are. Shapes it does not cover go to vLLM's op."""
    def run(inputs, weights, output, indices, *args, **kwargs):
        if not inputs.shape[0] == indices.shape[0] == output.shape[0]:
            return original(inputs, weights, output, indices, *args, **kwargs)
        stacked = weights.squeeze(1) if weights.dim() == 4 else weights  # [slots, out, in]
        x = inputs.to(output.dtype)
        slots = indices.unique().tolist()
        if len(slots) == 1:  # one adapter for the whole batch (an RL policy's): no gathers
            if slots[0] >= 0:
                grouped(output, slice(None), x @ stacked[slots[0]].to(output.dtype).T,
                        *args, **kwargs)
            return None
        for slot in slots:
            if slot < 0:
                continue
            rows = (indices == slot).nonzero().squeeze(1)
            product = x.index_select(0, rows) @ stacked[slot].to(output.dtype).T
            grouped(output, rows, product, *args, **kwargs)
        return None
    run.grouped = True
    return run


def _shrink(output, rows, product, scaling: float = 1.0) -> None:
    output[rows, :product.shape[1]] = scaling * product


def _expand(output, rows, product, add_inputs: bool = True) -> None:
    width = min(product.shape[1], output.shape[1])
    _put(output, rows, slice(0, width), product[:, :width], add_inputs)


def _expand_slice(output, rows, product, slice_offset: int, slice_size: int,
                  add_inputs: bool = True) -> None:
    _put(output, rows, slice(slice_offset, slice_offset + slice_size), product, add_inputs)


def _put(output, rows, columns: slice, values, add: bool) -> None:
    if isinstance(rows, slice):  # a view of `output`: written in place
        view = output[rows, columns]
        view.add_(values) if add else view.copy_(values)
    else:
        output[rows, columns] = output[rows, columns] + values if add else values
