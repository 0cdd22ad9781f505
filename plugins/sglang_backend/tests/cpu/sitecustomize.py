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

3. Pinned host memory as plain host memory. SGLang's LoRA layers and memory pool pin
their host buffers (`pin_memory=True`, `.pin_memory()`), which needs CUDA; pinning only
speeds up copies to a GPU, so without one an unpinned tensor holds the same values.
`rollout-sglang` itself refuses enable_lora where pinning fails (a CPU-only torch).
Likewise SGLang's own cudaHostRegister of host buffers (its routed-experts capturer's):
a no-op without CUDA.
"""
import importlib.abc
import sys
import types

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
    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch._rollout_cpu_patch = True


# The factories SGLang's LoRA code (0.5.23) calls with pin_memory=True.
PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "arange")
LORA_PACKAGE = "sglang.srt.lora"


class _UnpinnedTorch(types.ModuleType):
    """torch as SGLang's LoRA modules see it: the factories take pin_memory=True and make
    plain tensors. Only there: wrapping torch.tensor everywhere changed what transformers
    computes in the same process."""

    def __init__(self, torch):
        super().__init__("torch")
        self._torch = torch
        for name in PINNING_FACTORIES:
            setattr(self, name, self._unpinned(getattr(torch, name)))

    @staticmethod
    def _unpinned(factory):
        def unpinned(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)

        return unpinned

    def __getattr__(self, name):
        return getattr(self._torch, name)


class _LoRAHook(importlib.abc.MetaPathFinder):
    """Gives each module of SGLang's LoRA package the unpinned torch, once it is loaded,
    where CUDA is unavailable."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(LORA_PACKAGE + ".") and name != LORA_PACKAGE:
            return None
        import importlib.machinery

        return _after_exec(importlib.machinery.PathFinder.find_spec(name, path), _unpin)


def _unpin(module):
    torch = sys.modules.get("torch")
    if getattr(module, "torch", None) is torch and not torch.cuda.is_available():
        module.torch = _UnpinnedTorch(torch)


def _after_exec(spec, patch):
    """`spec`, its module patched by `patch` once the module has run."""
    if spec is None or spec.loader is None:
        return spec
    orig_exec = spec.loader.exec_module

    def exec_module(module):
        orig_exec(module)
        patch(module)

    spec.loader.exec_module = exec_module
    return spec


# Where SGLang registers host buffers with CUDA itself (cudaHostRegister: pinning), as its
# routed-experts capturer does.
HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"


class _HostPoolHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != HOST_POOL_MODULE:
            return None
        import importlib.machinery

        return _after_exec(importlib.machinery.PathFinder.find_spec(name, path),
                           _no_host_register)


def _no_host_register(module):
    if not sys.modules["torch"].cuda.is_available():
        module._cuda_host_register = lambda buffer, *args, **kwargs: None


class _TorchHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # let the regular finders locate torch
        import importlib.util
        return _after_exec(importlib.util.find_spec("torch"), _patch)


if "torch" in sys.modules:
    _patch(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _TorchHook())
sys.meta_path.insert(0, _LoRAHook())
sys.meta_path.insert(0, _HostPoolHook())
