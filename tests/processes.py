"""Finding the replica processes that a pool started (tests only)."""

from pathlib import Path


def replicas_of(pid: int) -> list[int]:
    """The processes started with `--watch-parent pid`, in pid order."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--watch-parent" in argv and argv[argv.index(b"--watch-parent") + 1] == str(pid).encode():
            found.append(int(cmdline.parent.name))
    return sorted(found)
