"""LoRA adapters for tests, made without peft: seeded random `lora_A`/`lora_B` under PEFT's
names (what `get_peft_model_state_dict` gives and `adapter_model.safetensors` holds) for
the linear layers of a model folder, and that model with an adapter merged into its
weights (W + scale * B @ A, what peft's `merge_and_unload` computes), to check that a
backend's output with the adapter equals the merged model's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollout.testing.model_folders import WEIGHTS_FILE, load_weights

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_adapter(model_dir: str | Path, rank: int = 8, alpha: int = 16, seed: int = 1,
                 targets: tuple[str, ...] = TARGETS, std: float = 0.5) -> tuple[dict, dict]:
    """(PEFT-named tensors, LoraConfig as a dict) of a rank-`rank` adapter of every linear
    layer named in `targets`. Both factors are random (peft starts B at zero), so the
    adapter changes what the model writes."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in load_weights(model_dir).items():
        module = name.removesuffix(".weight")
        if weight.dim() != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        out_features, in_features = weight.shape
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = std * torch.randn(
            rank, in_features, generator=generator) / in_features ** 0.5
        tensors[f"{prefix}.lora_B.weight"] = std * torch.randn(
            out_features, rank, generator=generator) / rank ** 0.5
    config = {"r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "use_dora": False, "use_rslora": False}
    return tensors, config


def merged_copy(model_dir: str | Path, out_dir: str | Path, tensors: dict,
                config: dict) -> Path:
    """A copy of the model folder with the adapter merged into its weights."""
    import shutil

    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out_dir)
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(WEIGHTS_FILE))
    scale = config["lora_alpha"] / config["r"]
    weights = load_weights(src)
    for name in list(weights):
        prefix = "base_model.model." + name.removesuffix(".weight")
        a, b = tensors.get(f"{prefix}.lora_A.weight"), tensors.get(f"{prefix}.lora_B.weight")
        if a is not None:
            weights[name] = weights[name] + scale * (b @ a)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / WEIGHTS_FILE))
    return out


def merged_references(model_dir: str | Path, adapters: dict, folder: Callable[[str], Path],
                      run: Callable) -> dict:
    """What `run(backend)` gives on the HF backend (float32) with the base model (under
    None) and with each adapter of `adapters` (name -> (tensors, config)) merged into the
    weights, in the folder `folder(name)` gives: the references of adapter tests."""
    import rollout

    folders = {None: Path(model_dir)}
    for name, (tensors, config) in adapters.items():
        folders[name] = merged_copy(model_dir, folder(name), tensors, config)
    out = {}
    for name, path in folders.items():
        with rollout.load_backend("hf", model=str(path), dtype="float32") as hf:
            out[name] = run(hf)
    return out


def peft_folder(out_dir: str | Path, tensors: dict, config: dict) -> Path:
    """The adapter as `save_pretrained` writes it: adapter_config.json and
    adapter_model.safetensors."""
    import json

    from safetensors.torch import save_file

    from rollout.weights.lora import CONFIG_FILE, WEIGHTS_FILE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps({**config, "peft_type": "LORA"}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    return out
