"""Images in prompts, for Qwen2-VL models: pixels, expanded placeholders, M-RoPE positions.

The core hands a prompt with one `<|image_pad|>` per image (the collapsed form); the model
wants each image's run of pads (one per merged patch) and its pixels. Qwen2-VL places the
tokens of an image on a 3D grid of positions (M-RoPE), so after an image a row's positions
run behind its token count by a fixed amount, its rope delta. The model keeps that delta
for the one batch it last saw; here rows of many requests share one KV cache and join and
leave at every step, so the engine computes positions itself: 3D ones at the prefill, and
token count + the row's own delta at every decode step (batch.py).

The image processor's output is cached per image (by `PromptImage.id`): a later turn that
repeats earlier images processes only its new ones.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
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


PROCESS_WAIT_S = 300.0  # for an image another request is processing


class Vision:
    def __init__(self, model, image_processor, device: torch.device, cache_bytes: int = 0):
        self.model = model
        self.image_processor = image_processor
        self.image_token_id = model.config.image_token_id
        self.merge = image_processor.merge_size
        self.device = device
        # id -> (pixel rows, grid [1, 3]) on the CPU, least recently used first.
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._cache_bytes = cache_bytes  # the bound; 0: no cache
        self._held = 0  # bytes in the cache
        self._lock = threading.Lock()  # requests prepare on threads of their own
        # id -> the result of an image another request is processing now: two requests
        # with one new image process it once.
        self._pending: dict[str, concurrent.futures.Future] = {}
        self.processed = 0  # images the processor ran on
        self.hits = 0  # images taken from the cache

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"images_processed": self.processed, "image_cache_hits": self.hits}

    def _process(self, images) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each image's pixel rows and grid: from the cache, the misses from one processor
        call (per image, not per request: the processor's output is the same either way)."""
        found, misses, joined = {}, {}, {}
        with self._lock:
            for im in images:
                if im.id in found or im.id in misses or im.id in joined:
                    continue
                if im.id in self._cache:
                    self._cache.move_to_end(im.id)
                    found[im.id] = self._cache[im.id]
                elif im.id in self._pending:  # another request is processing it now
                    joined[im.id] = self._pending[im.id]
                else:
                    misses[im.id] = im
                    self._pending[im.id] = concurrent.futures.Future()
            self.hits += len(found) + len(joined)
        if misses:
            try:
                out = self.image_processor(images=[im.image for im in misses.values()],
                                           return_tensors="pt")
                grid = out["image_grid_thw"]
                rows = out["pixel_values"].split(grid.prod(dim=-1).tolist())
            except BaseException as exc:
                with self._lock:
                    for key in misses:
                        self._pending.pop(key).set_exception(exc)
                raise
            with self._lock:
                self.processed += len(misses)
                for k, key in enumerate(misses):
                    # Clones: a slice would keep the whole output's storage alive.
                    found[key] = entry = (rows[k].clone(), grid[k:k + 1].clone())
                    self._keep(key, entry)
                    self._pending.pop(key).set_result(entry)
        for key, processing in joined.items():
            found[key] = processing.result(timeout=PROCESS_WAIT_S)
        return [found[im.id] for im in images]

    def _keep(self, key: str, entry: tuple[torch.Tensor, torch.Tensor]) -> None:
        size = sum(t.nbytes for t in entry)
        if key in self._cache or size > self._cache_bytes:
            return
        self._cache[key] = entry
        self._held += size
        while self._held > self._cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._held -= sum(t.nbytes for t in old)

    def prepare(self, prompt: list[int], images, max_model_len: int, field: str,
                ) -> tuple[list[int], VisionInputs]:
        """The prompt with each image's placeholder expanded to its run, and the pixels
        (the core has checked that there is one placeholder per image)."""
        processed = self._process(images)
        grid = torch.cat([g for _, g in processed])
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
        pixels = torch.cat([p for p, _ in processed]).to(self.device, self.model.dtype)
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
