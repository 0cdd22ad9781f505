"""Which product files a weight push runs, counted from the code: a pool of two replicas of
`--backend` on the tiny model, one warm-up push, then one push traced in every process
(the trainer, each replica server and their children), and an idle window of the same
length traced the same way. A file seen only in the push's window is the push's own; one
seen in both also runs in the background (health checks, an idle engine loop) and is
listed apart. docs/weights.md's table is this script's output.

    python scripts/trace_weight_path.py --backend hf [--option mode=engine] [--adapter]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = (str(ROOT / "core" / "rollout"), str(ROOT / "plugins"))

# Loaded by every Python process started below (PYTHONPATH): a profile hook that records
# the product files whose functions are called between SIGUSR1 and SIGUSR2, then writes
# them to $TRACE_OUT.<pid>.<window>.
TRACER = textwrap.dedent("""
    import os, signal, sys, threading
    roots = tuple(os.environ["TRACE_ROOTS"].split(os.pathsep))
    seen, on, window = set(), [False], [0]
    def hook(frame, event, arg):
        if on[0] and event == "call" and frame.f_code.co_filename.startswith(roots):
            seen.add(frame.f_code.co_filename)
    def start(*_):
        seen.clear(); on[0] = True
    def stop(*_):
        on[0] = False; window[0] += 1
        with open(f"{os.environ['TRACE_OUT']}.{os.getpid()}.{window[0]}", "w") as out:
            out.write("\\n".join(sorted(seen)))
    sys.setprofile(hook); threading.setprofile(hook)
    signal.signal(signal.SIGUSR1, start); signal.signal(signal.SIGUSR2, stop)
""")


def signal_all(processes, signum) -> None:
    for process in processes:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass


def traced(processes, action) -> float:
    """Run `action` inside one traced window in every process; its seconds."""
    signal_all(processes, signal.SIGUSR1)
    time.sleep(0.2)
    began = time.monotonic()
    action()
    seconds = time.monotonic() - began
    time.sleep(0.2)
    signal_all(processes, signal.SIGUSR2)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE, a backend option")
    parser.add_argument("--adapter", action="store_true", help="a LoRA adapter's push instead")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trace-weights-"))
    (work / "sitecustomize.py").write_text(TRACER)
    os.environ.update(TRACE_ROOTS=os.pathsep.join(ROOTS), TRACE_OUT=str(work / "seen"),
                      PYTHONPATH=os.pathsep.join(
                          [str(work)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    exec(TRACER, {})  # this process traces too

    import psutil
    from transformers import AutoModelForCausalLM

    from rollout import ServedRollout
    from rollout.testing.model_folders import tiny_model_dir

    model_dir = tiny_model_dir(work / "model")
    options = dict(option.split("=", 1) for option in args.option)
    if args.adapter:
        options["max_loras"] = 1
    sampler = ServedRollout.start(args.backend, str(model_dir), replicas=2, options=options)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        if args.adapter:
            from peft import LoraConfig, get_peft_model
            config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
            lora = get_peft_model(model, config)
            tensors = {n: t for n, t in lora.named_parameters() if "lora_" in n}

            def push(version):
                sampler.load_adapter("trace", tensors.items(), config.to_dict(), version)
        else:
            def push(version):
                sampler.update_weights(model.named_parameters(), version=version)
        push(1)  # warm: every import done, every connection open
        processes = [psutil.Process()] + psutil.Process().children(recursive=True)
        seconds = traced(processes, lambda: push(2))
        traced(processes, lambda: time.sleep(seconds))
        time.sleep(1)
    finally:
        sampler.close()
    report(work)


def report(work: Path) -> None:
    def files(window: int) -> set[str]:
        found = set()
        for path in work.glob(f"seen.*.{window}"):
            found.update(line for line in path.read_text().splitlines() if line)
        return {str(Path(f).relative_to(ROOT)) for f in found}

    push, idle = files(1), files(2)
    own, shared = sorted(push - idle), sorted(push & idle)
    print(f"the push's own files ({len(own)}):")
    print("\n".join(f"  {f}" for f in own))
    print(f"also running while idle ({len(shared)}):")
    print("\n".join(f"  {f}" for f in shared))
    print(f"in all: {len(push)}")


if __name__ == "__main__":
    main()
