"""Test-only: let vLLM's Qwen2-VL module import on the CPU build, which has no torchvision.

vLLM's `qwen2_vl` imports `smart_resize` from transformers' `image_processing_qwen2_vl`,
whose first line imports `torchvision.transforms.v2.functional` (for its torchvision image
processor, which nothing here uses: without torchvision transformers picks the PIL one).
PyPI's torchvision is a CUDA build that fails on the CPU torch, and no CPU build is on PyPI.
So while that one module runs its body, and only then, a stub `torchvision` stands in
`sys.modules`; it is removed afterwards, and transformers' `is_torchvision_available()`
(checked before, in the modules it imports first) stays False.

Qwen2VLProcessor also loads a video processor, which needs torchvision; without it,
`AutoVideoProcessor.from_pretrained` here answers a stand-in that only lists its keyword
arguments (vLLM reads them) and fails if used: the tests send images only.

Activated by putting this folder on PYTHONPATH (child processes: vLLM's engine core, its
server) and by loading this file (conftest.py); it does nothing until that module is imported.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
# What the target imports after torchvision: imported first, without the stub in place.
BEFORE = ("transformers.image_processing_backends", "transformers.image_processing_utils",
          "transformers.image_transforms", "transformers.image_utils",
          "transformers.processing_utils")
STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
         "torchvision.transforms.v2.functional")


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"torchvision.{name} used: torchvision is a test stub here")


def _stubs() -> dict:
    modules = {}
    for name in STUBS:
        module = _Stub(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        modules[name] = module
    for parent, child in zip(STUBS, STUBS[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    return modules


VIDEO = "transformers.models.auto.video_processing_auto"


class _NoVideo(dict):
    """Stands in for a video processor, which needs torchvision (an empty dict: the
    processor's repr writes its parts as JSON)."""

    @property
    def valid_kwargs(self):
        from transformers.processing_utils import VideosKwargs

        return VideosKwargs

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"video_processor.{name} used: no video processor without "
                           "torchvision (test stub)")


def _no_video(module) -> None:
    auto = module.AutoVideoProcessor
    load = auto.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        try:
            return load(cls, *args, **kwargs)
        except ImportError as exc:
            if "Torchvision" not in str(exc):
                raise
            return _NoVideo()

    auto.from_pretrained = classmethod(from_pretrained)

    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def check_argument_for_proper_class(self, argument_name, argument):
        if isinstance(argument, _NoVideo):
            return None
        return check(self, argument_name, argument)

    ProcessorMixin.check_argument_for_proper_class = check_argument_for_proper_class


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module):
            if name == VIDEO:
                exec_module(module)
                _no_video(module)
                return
            for before in BEFORE:
                importlib.import_module(before)
            stubs = {n: m for n, m in _stubs().items() if n not in sys.modules}
            sys.modules.update(stubs)
            try:
                exec_module(module)
            finally:
                for n in stubs:
                    sys.modules.pop(n, None)

        spec.loader.exec_module = run
        return spec


if importlib.util.find_spec("torchvision") is None:
    if VIDEO in sys.modules:  # imported already: patched now
        _no_video(sys.modules[VIDEO])
    names = {n for n in (TARGET, VIDEO) if n not in sys.modules}
    if names:
        sys.meta_path.insert(0, _Finder(names))
