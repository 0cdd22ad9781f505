"""Images in prompts, for Qwen2-VL models: pixels, expanded placeholders, M-RoPE positions.

The core hands a prompt with one `<|image_pad|>` per image (the collapsed form); the model
wants each image's run of pads (one per merged patch) and its pixels. Qwen2-VL places the
tokens of an image on a 3D grid of positions (M-RoPE), so after an image a row's positions
run behind its token count by a fixed amount, its rope delta. The model keeps that delta
for the one batch it last saw; here rows of many requests share one KV cache and join and
leave at every step, so the engine computes positions itself: 3D ones at the prefill, and
token count + the row's own delta at every decode step (batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout import InvalidRequestError

# Model types whose image inputs (pixel_values, image_grid_thw) and positions
# (`get_rope_index`) this module knows.
MODEL_TYPES = ("qwen2_vl",)


@dataclass
class VisionInputs:
    """The images of one request, processed: what its rows' prefill feeds the model."""

    pixel_values: torch.Tensor  # [patches, channels x patch volume]
    image_grid_thw: torch.Tensor  # [images, 3]: each image's grid of patches


class Vision:
    def __init__(self, model, image_processor, device: torch.device):
        self.model = model
        self.image_processor = image_processor
        self.image_token_id = model.config.image_token_id
        self.merge = image_processor.merge_size
        self.device = device

    def prepare(self, prompt: list[int], images, max_model_len: int, field: str,
                ) -> tuple[list[int], VisionInputs]:
        """The prompt with each image's placeholder expanded to its run, and the pixels
        (the core has checked that there is one placeholder per image)."""
        out = self.image_processor(images=[im.image for im in images], return_tensors="pt")
        grid = out["image_grid_thw"]
        counts = (grid.prod(dim=-1) // self.merge**2).tolist()
        expanded: list[int] = []
        k = 0
        for token in prompt:
            if token == self.image_token_id:
                expanded += [token] * counts[k]
                k += 1
            else:
                expanded.append(token)
        if len(expanded) >= max_model_len:
            raise InvalidRequestError(field, f"{len(expanded)} tokens with the images' tokens "
                                      "is too long", f"at most {max_model_len - 1} tokens")
        pixels = out["pixel_values"].to(self.device, self.model.dtype)
        return expanded, VisionInputs(pixels, grid.to(self.device))


def prefill_inputs(model, rows, input_ids: torch.Tensor, mask: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """For a prefill in which some rows have images: 3D position ids [3, rows, width], each
    row's rope delta [rows, 1] (0 for a text row), and the image inputs of the forward."""
    inputs = [v for v in (getattr(row.owner, "vision", None) for row in rows) if v is not None]
    grid = torch.cat([v.image_grid_thw for v in inputs])
    positions, deltas = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
        image_grid_thw=grid, attention_mask=mask)
    pixels = torch.cat([v.pixel_values for v in inputs])
    return positions, deltas.to(mask.device), {"pixel_values": pixels, "image_grid_thw": grid}
