import subprocess
import sys


def test_import_is_light():
    code = ("import sys, rollout; heavy = [m for m in ('torch', 'transformers', 'vllm', "
            "'sglang', 'pyarrow', 'rollout_hf') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_moved_modules_import_by_their_old_names_with_a_warning():
    """Modules that moved in 0.2 give the new module itself under the old name, and say
    where it went."""
    import importlib
    import warnings

    from rollout._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
                   for w in caught), (old, [str(w.message) for w in caught])


def test_both_samplers_import_from_the_package_face():
    code = ("import sys, rollout; from rollout import Sampler, ServedRollout; "
            "print(ServedRollout.__module__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["rollout.service.served", "False"]
