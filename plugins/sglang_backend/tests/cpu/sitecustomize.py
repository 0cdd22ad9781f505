"""Test-only CPU patches to torch, for SGLang's CUDA wheel on a machine without a GPU.

1. Make torch.get_device_module() (no argument) return torch.cpu when CUDA is
unavailable. A CUDA build of torch otherwise returns torch.cuda (its compile-time accelerator),
and SGLang's release/resume_memory_occupation then crashes the scheduler on a CPU-only machine
("Found no NVIDIA driver"). Activated by putting this folder on PYTHONPATH; the patch is applied
lazily, right after `torch` is first imported, so processes that never import torch pay nothing.

2. Placeholder CPU kernel ops. On CPU, SGLang's Qwen3.5 module looks up CPU ops of its kernel
library when it is imported; the CUDA kernel wheel has none, so the import fails, and with it
every module that imports it: SGLang's Qwen-VL multimodal processor among them ("No processor
registered for architecture: ['Qwen2VLForConditionalGeneration']"). Those few names resolve
to placeholders that raise if ever called; Qwen2-VL (the tiny vision model of the tests)
never calls them. Only names the kernel library lacks, and only these.
"""
import importlib.abc
import sys

# Looked up when sglang/srt/models/qwen3_5.py is imported on CPU (SGLang 0.5.23).
PLACEHOLDER_OPS = frozenset({"fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu",
                             "fused_qk_gemma_rmsnorm_with_gate_cpu",
                             "fused_qkvzba_split_reshape_cat_contiguous_cpu"})


def _patch(torch):
    if getattr(torch, "_rollout_cpu_patch", False):
        return
    import functools

    orig = torch.get_device_module

    # functools.wraps keeps `__wrapped__`: torch.compile looks it up on torch functions
    # (SGLang's compiled repetition penalty failed without it).
    @functools.wraps(orig)
    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return orig(device)

    torch.get_device_module = get_device_module

    namespace = torch._ops._OpNamespace
    lookup = namespace.__getattr__

    @functools.wraps(lookup)
    def op_or_placeholder(self, op_name):
        try:
            return lookup(self, op_name)
        except AttributeError:
            if self.name != "sgl_kernel" or op_name not in PLACEHOLDER_OPS:
                raise

        def placeholder(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{op_name}: a test-only placeholder "
                                      "(the CUDA kernel wheel has no CPU ops)")

        return placeholder

    namespace.__getattr__ = op_or_placeholder
    torch._rollout_cpu_patch = True


class _TorchHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # let the regular finders locate torch
        import importlib.util
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:
    _patch(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _TorchHook())
