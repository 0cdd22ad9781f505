"""A soak: `rollout serve --replicas 2` under a steady mixed load for a set time, to show that
nothing grows (memory, threads, open files, shared-memory files) and nothing is lost.

The load: completions, chats, streams dropped after their first chunks, forced tool calls
and bad requests, from `--clients` clients at once; a weight update every
`--update-every` s (shared memory, the tiny model's own weights); one replica killed with
SIGKILL once, early. Every `--sample-every` s it sums RSS, threads, open file descriptors
and /dev/shm files (open or mapped) over the server's process tree; at the end no weight
file may be left in /dev/shm.

It prints each resource's growth per 10k requests after the warm-up and the killed
replica's return (whichever is later; a least-squares slope) and from the start of that window to its end (medians of its first and last
quarters), the requests by kind and outcome, and writes a PNG of the samples over time.
The front's own RSS and the GPU memory of the tree (replicas on CUDA, by nvidia-smi) are
printed too, not checked.
With `--check` it exits 1 on growth past the limits, any 5xx, any request lost, or fewer
requests a second than `--floor` (a change that halves the served path's throughput is
caught where the soak runs; bench/bench_replica_path.py says where the time goes).

    python bench/soak.py --duration 1800 --png soak.png         # the 30-minute soak
    python bench/soak.py --duration 120 --check                 # what CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from common import add_model_argument, model_folder, prompts

KEY = "soak-key"
MODEL = "tiny"
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
TOOLS = [{"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                                  "required": ["a", "b"], "additionalProperties": False}}}]
KINDS = {"completion": 30, "chat": 25, "stream_dropped": 15, "tool_call": 15, "bad": 15}
# Growth from the start of the measured window to its end that fails --check.
LIMITS = {"rss_mb": (64.0, 0.05), "threads": (4, 0.0), "fds": (16, 0.0), "shm_files": (0, 0.0)}
# Printed, not checked: the front's share of the RSS, and GPU memory where replicas use one.
SHOWN = ["front_rss_mb", "gpu_mb"]


# --- the process tree's resources ---------------------------------------------------------


def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def shm_files_of(pid: int) -> set[str]:
    """The /dev/shm files a process has open or mapped."""
    found = {line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text()
             .splitlines() if " /dev/shm/" in line}
    for fd in os.scandir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(fd.path)
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            found.add(target)
    return found


def gpu_mb(pids: list[int]) -> float:
    """GPU memory the processes hold, by nvidia-smi (0 where there is no NVIDIA GPU)."""
    if not shutil.which("nvidia-smi"):
        return 0.0
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30).stdout
    used = (line.split(",") for line in out.splitlines() if "," in line)
    return float(sum(int(mb) for pid, mb in used if int(pid) in pids))


def resources(root: int, seen: set[int]) -> dict[str, float]:
    rss = threads = fds = front_rss = 0
    shm: set[str] = set()
    pids = tree(root)
    for pid in pids:
        seen.add(pid)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds += len(os.listdir(f"/proc/{pid}/fd"))
            shm |= shm_files_of(pid)
        except OSError:  # it ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                kb = int(line.split()[1])
                rss += kb
                front_rss += kb if pid == root else 0
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return {"rss_mb": rss / 1024, "threads": threads, "fds": fds,
            "shm_files": len(shm), "front_rss_mb": front_rss / 1024, "gpu_mb": gpu_mb(pids)}


# --- the load -----------------------------------------------------------------------------


class Load:
    def __init__(self, url: str, texts: list[str], seed: int):
        self.url = url
        self.texts = texts
        self.rng = random.Random(seed)
        self.outcomes: Counter = Counter()  # (kind, outcome)
        self.unexpected: list[str] = []  # the first few odd answers, to print
        self.done = 0

    def body(self, kind: str) -> tuple[str, dict, int]:
        """(route, body, expected status)."""
        text = self.rng.choice(self.texts)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": text}],
                "max_tokens": 8}
        if kind == "completion":
            return "completions", {"model": MODEL, "prompt": text, "max_tokens": 8}, 200
        if kind == "chat":
            return "chat/completions", chat, 200
        if kind == "stream_dropped":
            return "chat/completions", {**chat, "max_tokens": 64, "stream": True}, 200
        if kind == "tool_call":
            return "chat/completions", {**chat, "max_tokens": 80, "tools": TOOLS,
                                        "tool_choice": "required"}, 200
        return "completions", {"model": MODEL, "prompt": text, "temperature": -1}, 400

    async def one(self, session, kind: str) -> str:
        import aiohttp

        route, body, expected = self.body(kind)
        try:
            async with session.post(f"{self.url}/v1/{route}", json=body,
                                    timeout=aiohttp.ClientTimeout(total=120)) as response:
                if response.status != expected:
                    self.note(kind, response.status, await response.text())
                    return f"http_{response.status}"
                if kind == "bad":  # refused, as it should be
                    return "ok"
                if kind == "stream_dropped":  # two events, then the client goes away
                    for _ in range(2):
                        line = await response.content.readline()
                        if b'"error"' in line:
                            return "stream_error"
                    return "ok"
                data = await response.json()
                if not data.get("choices"):
                    self.note(kind, response.status, json.dumps(data))
                    return "no_choices"
                return "ok"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"lost_{type(exc).__name__}"

    def note(self, kind: str, status: int, body: str) -> None:
        if len(self.unexpected) < 5:
            self.unexpected.append(f"{kind}: {status} {body[:300]}")

    async def client(self, stop: asyncio.Event) -> None:
        import aiohttp

        kinds, weights = list(KINDS), list(KINDS.values())
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            while not stop.is_set():
                kind = self.rng.choices(kinds, weights)[0]
                outcome = await self.one(s, kind)
                self.outcomes[kind, outcome] += 1
                self.done += 1


# --- the run ------------------------------------------------------------------------------


def start_server(model: str, replicas: int):
    from rollout.kit.process import HOST, ServerProcess, free_port

    port = free_port()
    server = ServerProcess("soak-serve", [
        sys.executable, "-m", "rollout", "serve", "--backend", "hf", "--model", model,
        "--served-model-name", MODEL, "--replicas", str(replicas), "--port", str(port),
        "--log-level", "warning"], env={"ROLLOUT_API_KEY": KEY})
    url = f"http://{HOST}:{port}"
    server.wait_healthy(f"{url}/health", 600, {"Authorization": f"Bearer {KEY}"})
    return server, url


def replica_pids(front: int) -> list[int]:
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # it ended meanwhile
            return b""

    return [pid for pid in tree(front)[1:] if b"--watch-parent" in cmdline(pid)]


def run(args) -> int:
    from rollout.service.served import ServedRollout
    from rollout.weights.transports.shm import SHM_DIR
    from rollout.testing.model_folders import load_weights

    tmp = tempfile.mkdtemp(prefix="soak-")
    model = model_folder(args.model, tmp)
    weights = load_weights(model)
    server, url = start_server(model, args.replicas)
    trainer = ServedRollout.connect(url, KEY)
    load = Load(url, prompts(64), args.seed)
    samples: list[dict] = []
    ours = {os.getpid()}  # every process of this soak, the server tree as sampled
    events: list[tuple[float, str]] = []
    started = time.monotonic()
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.is_set():
            samples.append({"t": time.monotonic() - started, "requests": load.done,
                            **resources(server.proc.pid, ours)})
            stop_sampling.wait(args.sample_every)

    def replica_back(gone: int) -> bool:
        """The killed replica's successor runs and the pool serves from all replicas again
        (a new process alone may still be loading, or be out of rotation)."""
        pids = replica_pids(server.proc.pid)
        if len(pids) < args.replicas or gone in pids:
            return False
        # The front's own /health (the trainer's health is its client's view of one URL).
        request = urllib.request.Request(f"{url}/health",
                                         headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read()).get("healthy") == args.replicas
        except (OSError, ValueError):  # a slow answer under load, or a 503: asked again soon
            return False

    def chores():
        """Weight updates every few seconds, the first one early (it is warm-up: the
        front server then loads torch and keeps a copy of the weights); one replica killed
        once, early."""
        version, killed, gone = 0, False, None
        next_update = min(args.update_every, args.warmup * args.duration / 2)
        while not stop_sampling.wait(0.5):
            elapsed = time.monotonic() - started
            if not killed and elapsed > args.kill_at * args.duration:
                pids = replica_pids(server.proc.pid)
                if pids:
                    os.killpg(pids[0], signal.SIGKILL)
                    events.append((elapsed, "replica killed"))
                    gone = pids[0]
                killed = True
            if gone is not None and replica_back(gone):
                events.append((time.monotonic() - started, "replica back"))
                gone = None
            if elapsed > next_update:
                version += 1
                try:
                    trainer.update_weights(weights.items(), version=version)
                    events.append((time.monotonic() - started, f"update {version}"))
                except Exception as exc:  # noqa: BLE001 - counted, the soak goes on
                    load.outcomes["weight_update", f"failed: {exc}"[:80]] += 1
                else:
                    load.outcomes["weight_update", "ok"] += 1
                next_update = time.monotonic() - started + args.update_every

    async def drive():
        stop = asyncio.Event()
        clients = [asyncio.ensure_future(load.client(stop)) for _ in range(args.clients)]
        await asyncio.sleep(args.duration)
        stop.set()
        await asyncio.gather(*clients)

    threads = [threading.Thread(target=sample, daemon=True),
               threading.Thread(target=chores, daemon=True)]
    try:
        for thread in threads:
            thread.start()
        asyncio.run(drive())
    finally:
        stop_sampling.set()
        for thread in threads:
            thread.join(120)
        trainer.close()
        server.stop()
    # Only our processes' files: other work on the machine may be pushing weights too.
    left = sorted(p.name for pid in ours for p in SHM_DIR.glob(f"rollout-weights-{pid}-*"))
    return report(args, samples, events, load, left)


def growth(window: list[dict], name: str) -> tuple[float, float]:
    """(per 10k requests by least squares, from the window's first quarter to its last)."""
    xs, ys = [s["requests"] for s in window], [s[name] for s in window]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0
    quarter = max(1, len(window) // 4)
    return slope * 10_000, statistics.median(ys[-quarter:]) - statistics.median(ys[:quarter])


def report(args, samples: list[dict], events, load: Load, left: list[str]) -> int:
    # Measured from the warm-up's end, and not before the killed replica is back: a new
    # replica's memory, threads and files are not growth.
    begin = max([args.warmup * args.duration,
                 *(t for t, what in events if what == "replica back")])
    window = [s for s in samples if s["t"] >= begin]
    failures = []
    rate = load.done / args.duration
    if rate < args.floor:
        failures.append(f"{rate:.1f} requests/s, below the floor of {args.floor:g}")
    print(f"{load.done} requests in {args.duration:.0f} s ({rate:.1f}/s), "
          f"{len(samples)} samples, measured after {begin:.0f} s")
    if len(window) < 4:
        failures.append(f"{len(window)} samples after {begin:.0f} s: too few to measure")
    print(f"{'resource':<12} {'start':>10} {'end':>10} {'growth':>10} {'per 10k req':>12}")
    for name in [*LIMITS, *SHOWN] if len(window) >= 4 else []:
        per_10k, grew = growth(window, name)
        start = statistics.median(s[name] for s in window[:max(1, len(window) // 4)])
        print(f"{name:<12} {start:>10.1f} {window[-1][name]:>10.1f} {grew:>10.1f} "
              f"{per_10k:>12.2f}")
        absolute, relative = LIMITS.get(name, (float("inf"), 0.0))
        if grew > max(absolute, relative * start):
            failures.append(f"{name} grew by {grew:.1f} (limit {max(absolute, relative * start):.1f})")
    print("requests:", json.dumps({f"{k}/{o}": n for (k, o), n in sorted(load.outcomes.items())}))
    print("events:", ", ".join(f"{what} at {t:.0f} s" for t, what in events))
    bad = {f"{k}/{o}": n for (k, o), n in load.outcomes.items()
           if o != "ok" and not (k == "stream_dropped" and o == "stream_error")}
    if bad:
        failures.append(f"requests failed or lost: {bad}; the first odd answers: "
                        f"{load.unexpected}")
    if left:
        failures.append(f"weight files left in /dev/shm: {left}")
    if not any(what == "replica killed" for _, what in events):
        failures.append("no replica was killed")
    if args.png:
        plot(samples, events, args.png)
        print(f"plot in {args.png}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures and args.check else 0


def plot(samples: list[dict], events, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    t = [s["t"] for s in samples]
    for ax, name in zip(axes, LIMITS):
        ax.plot(t, [s[name] for s in samples])
        ax.set_ylabel(name)
        for when, what in events:
            ax.axvline(when, color={"replica killed": "red", "replica back": "green"}
                       .get(what, "0.8"), lw=0.8)
    axes[-1].set_xlabel("seconds (grey: weight updates, red: a replica killed, green: back)")
    fig.suptitle("rollout serve --replicas 2 under a steady mixed load")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--duration", type=float, default=1800.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--update-every", type=float, default=20.0)
    parser.add_argument("--kill-at", type=float, default=0.1, help="fraction of the duration")
    parser.add_argument("--warmup", type=float, default=0.25, help="fraction of the duration")
    parser.add_argument("--sample-every", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", help="where to write the plot")
    parser.add_argument("--floor", type=float, default=0.0,
                        help="requests/s below which --check fails")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 on growth, failures or a rate below --floor")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
