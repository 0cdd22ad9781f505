import subprocess
import sys


def test_import_is_light():
    code = ("import sys, rollout; heavy = [m for m in ('torch', 'transformers', 'vllm', "
            "'sglang', 'pyarrow', 'rollout_hf') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
