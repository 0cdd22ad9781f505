"""Test-only: make torch.get_device_module() (no argument) return torch.cpu when CUDA is
unavailable. A CUDA build of torch otherwise returns torch.cuda (its compile-time accelerator),
and SGLang's release/resume_memory_occupation then crashes the scheduler on a CPU-only machine
("Found no NVIDIA driver"). Activated by putting this folder on PYTHONPATH; the patch is applied
lazily, right after `torch` is first imported, so processes that never import torch pay nothing.
"""
import importlib.abc
import sys


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
