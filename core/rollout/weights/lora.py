"""LoRA adapters as trainers hand them over, checked before any backend loads one: PEFT's
tensors (`get_peft_model_state_dict`, `adapter_model.safetensors`:
`base_model.model.<module>.lora_A.weight` and `.lora_B.weight`) and its `LoraConfig` as a
dict (`r`, `lora_alpha`, `use_rslora`). What a plain LoRA of linear layers is not (DoRA,
biases, `modules_to_save`) is refused by name, as are unknown modules and wrong shapes,
so that a bad adapter never reaches an engine (vLLM's dies on some). A trainer may keep its
adapter in one block of memory (`pack_adapter`), which a backend then copies at once."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from rollout.contract.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# LoraConfig settings that change what the adapter computes, and the values allowed.
PLAIN = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
         "lora_bias": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None)}


# What of a LoraConfig `read_adapter` reads (and the engines take): the rest is left out.
CONFIG_KEYS = ("r", "lora_alpha", "use_rslora", "target_modules", *PLAIN)


def plain_config(config: Mapping) -> dict:
    """A LoraConfig's dict (`LoraConfig.to_dict()`, or adapter_config.json) reduced to what
    is read, in JSON's types (peft keeps `target_modules` as a set)."""
    if not isinstance(config, Mapping):
        raise InvalidRequestError("config", f"got {type(config).__name__}",
                                  "a LoraConfig as a dict (r, lora_alpha, ...)")
    plain = {}
    for key in CONFIG_KEYS:
        value = config.get(key)
        if value is not None:
            plain[key] = sorted(value) if isinstance(value, set | frozenset | tuple) else value
    return plain


def no_such_adapter(name, loaded: Iterable[str]) -> InvalidRequestError:
    """The error for a request or call naming an adapter that is not loaded."""
    return InvalidRequestError("adapter", f"no adapter named {name!r}",
                               ", ".join(loaded) or "none loaded")


def linear_modules(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """The linear layers engines adapt, from a checkpoint's tensor shapes (module name ->
    (out_features, in_features)): not the embeddings, not the head."""
    return {name.removesuffix(".weight"): tuple(shape) for name, shape in shapes.items()
            if name.endswith(".weight") and len(shape) == 2
            and not name.endswith(("embed_tokens.weight", "lm_head.weight"))}


@attrs.frozen
class Adapter:
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)
    weights: dict  # module name -> (A [r, in], B [out, r]), the tensors as given

    def target_modules(self) -> list[str]:
        """The adapted modules' own names (`q_proj`, ...), as PEFT's `target_modules`."""
        return sorted({module.rsplit(".", 1)[-1] for module in self.weights})

    def peft_tensors(self) -> dict:
        """The tensors under PEFT's names (`base_model.model.<module>.lora_A.weight`, ...),
        contiguous, as engines load them."""
        return {f"base_model.model.{module}.lora_{which}.weight": t.contiguous()
                for module, pair in self.weights.items() for which, t in zip("AB", pair)}


@functools.lru_cache(maxsize=8192)
def peft_name(tensor_name: str) -> tuple[str, str] | None:
    """(module, "A" or "B") of a PEFT tensor name, or None. Cached: a policy's adapter
    comes again each step under the same names, and a match per tensor cost a us."""
    match = PEFT_NAME.match(tensor_name)
    return None if match is None else match.groups()


def read_adapter(config: Mapping, tensors: Iterable,
                 linears: Mapping[str, tuple[int, int]], max_rank: int | None = None) -> Adapter:
    """The adapter of `config` and (name, tensor) pairs `tensors`, for a model whose
    adaptable linear layers are `linears` (module name -> (out_features, in_features))."""
    if not isinstance(config, Mapping):
        raise InvalidRequestError("config", f"got {type(config).__name__}",
                                  "a LoraConfig as a dict (r, lora_alpha, ...)")
    for key, allowed in PLAIN.items():
        if config.get(key) not in allowed:
            raise InvalidRequestError(f"config.{key}", f"got {config[key]!r}: not a plain "
                                      "LoRA of linear layers", repr(allowed[0]))
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or (max_rank is not None and rank > max_rank):
        raise InvalidRequestError("config.r", f"got {rank!r}", "an integer >= 1" + (
            "" if max_rank is None else f" and <= {max_rank} (the engine's max LoRA rank)"))
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise InvalidRequestError("config.lora_alpha", f"got {alpha!r}", "a number")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    parts: dict[str, dict] = {}
    for tensor_name, tensor in tensors:
        parsed = peft_name(tensor_name)
        if parsed is None:
            raise InvalidRequestError("tensors", f"{tensor_name!r} is no LoRA weight",
                                      "PEFT names: base_model.model.<module>.lora_A.weight "
                                      "and .lora_B.weight")
        module, which = parsed
        if module not in linears:
            raise InvalidRequestError("tensors", f"{tensor_name!r}: the model has no "
                                      f"adaptable linear module {module!r}",
                                      "the model's linear layers")
        parts.setdefault(module, {})[which] = tensor
    if not parts:
        raise InvalidRequestError("tensors", "no LoRA weight given",
                                  "lora_A and lora_B of each adapted module")
    for module, pair in parts.items():
        out_features, in_features = linears[module]
        for which, shape in (("A", (rank, in_features)), ("B", (out_features, rank))):
            got = pair.get(which)
            if got is None:
                raise InvalidRequestError("tensors", f"{module!r} has no lora_{which}",
                                          "both lora_A and lora_B of each module")
            if got.shape != shape:  # torch.Size is a tuple
                raise InvalidRequestError(
                    "tensors", f"{module}.lora_{which} has shape {tuple(got.shape)}",
                    f"shape {shape} (r={rank})")
    return Adapter(rank, scale, {m: (p["A"], p["B"]) for m, p in parts.items()})


def pack_adapter(model, adapter_name: str = "default") -> None:
    """Keep the LoRA parameters of a PEFT model's adapter `adapter_name` in one block of
    memory, in the order `get_peft_model_state_dict` gives them, so that a backend in this
    process copies each push of them as one block (`one_block`). On CPU a copy of hundreds
    of small tensors runs on one thread, and the block's on every core: into the HF backend
    SmolLM2's rank-16 adapter pushed 14x faster than the full model, packed 20x
    (bench/bench_lora.py). The parameters stay the same objects, so an optimizer made before
    keeps working. Calling it again on a packed adapter does nothing."""
    marks = (f".lora_A.{adapter_name}.", f".lora_B.{adapter_name}.")
    params = [p for name, p in model.named_parameters() if any(m in name for m in marks)]
    if params and one_block(params) is None:  # (packed already: left as it is)
        pack_tensors(params)


def pack_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Move `tensors` (of one dtype and device) back to back into one new block, in order:
    each one's `.data` becomes its view of the block, with the same values."""
    import torch

    if not tensors:
        return
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise ValueError("tensors to pack are of one dtype and device, got "
                         f"{sorted(map(str, kinds))}")
    block = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                        device=tensors[0].device)
    start = 0
    for tensor in tensors:
        view = block[start:start + tensor.numel()].view_as(tensor)
        view.copy_(tensor.data)
        tensor.data = view
        start += tensor.numel()


def one_block(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one flat tensor where they lie back to back, in this order, in one
    block of memory (`pack_tensors`), else None."""
    first, last = tensors[0], tensors[-1]
    end, dtype = first.data_ptr(), first.dtype
    for tensor in tensors:
        if tensor.data_ptr() != end or tensor.dtype != dtype or not tensor.is_contiguous():
            return None
        end += tensor.nbytes
    # Back to back from the first to the last, both in one storage: so is all between.
    if first.untyped_storage().data_ptr() != last.untyped_storage().data_ptr():
        return None
    return first.as_strided(((end - first.data_ptr()) // first.element_size(),), (1,))


def read_peft_folder(path: str | Path) -> tuple[dict, dict]:
    """(tensors, config) of a PEFT adapter folder (`save_pretrained`):
    `adapter_config.json` and `adapter_model.safetensors`."""
    import json

    from safetensors.torch import load_file

    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise InvalidRequestError("path", f"{str(folder)!r} has no {file.name}",
                                      f"a PEFT adapter folder ({CONFIG_FILE}, {WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise InvalidRequestError("path", f"{config_file} is not JSON: {exc}",
                                  "a PEFT adapter_config.json") from None
    return load_file(str(weights_file)), config
