"""Model folders for the contract suite: the tiny model, and a copy with other weights."""

from __future__ import annotations

import shutil
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"


def tiny_model_dir(root: str | Path, seed: int = 0) -> Path:
    """Build the tiny model under `root` once; later calls reuse it."""
    from rollout.kit.tiny_model import build_tiny_model

    out = Path(root) / f"tiny-{seed}"
    if not (out / WEIGHTS_FILE).exists():
        build_tiny_model(out, seed=seed)
    return out


def load_weights(model_dir: str | Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / WEIGHTS_FILE))


def perturbed_copy(model_dir: str | Path, out_dir: str | Path, scale: float = 0.5,
                   seed: int = 1) -> Path:
    """Copy a model folder with every weight changed by seeded noise; returns the folder."""
    import torch
    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out_dir)
    if not (out / WEIGHTS_FILE).exists():
        shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(WEIGHTS_FILE))
        generator = torch.Generator().manual_seed(seed)
        weights = {
            name: t + scale * t.std() * torch.randn(t.shape, generator=generator, dtype=t.dtype)
            if t.is_floating_point() and t.numel() > 1 else t
            for name, t in load_weights(src).items()
        }
        save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out
