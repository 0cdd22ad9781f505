"""Results written chunk by chunk beside the output (`OUTPUT.parts/`), so that a run that is
killed loses no finished chunk and the next run with the same settings skips them.

Every file is written to a temporary name and renamed, so a part is either whole or absent.
A stamp of the run's settings refuses to mix the parts of two different runs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class Parts:
    def __init__(self, output: Path, settings: dict, what: str, folder: Path | None = None):
        self.folder = folder or output.with_name(output.name + ".parts")
        self.settings = settings
        self.what = what

    def open(self) -> set[int]:
        """The first rows of the chunks already written by an earlier run of the same
        settings."""
        from rollout.contract.errors import InvalidRequestError

        stamp = self.folder / "_settings.json"  # "_": not data to parquet readers
        if stamp.exists():
            if json.loads(stamp.read_text()) != self.settings:
                raise InvalidRequestError(
                    "output", f"{self.folder} holds parts of a different {self.what}",
                    f"the same settings as before, or delete {self.folder}")
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(stamp, json.dumps(self.settings).encode())
        return {int(p.stem.split("-")[1]) for p in self.folder.glob("part-*.parquet")}

    def write(self, start: int, table) -> None:
        atomic_write_table(self.folder / f"part-{start:09d}.parquet", table)

    def read(self, schema):
        """Every part, in row order, as one table."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = sorted(self.folder.glob("part-*.parquet"))
        return pa.concat_tables([pq.read_table(p) for p in parts]) if parts else (
            schema.empty_table())

    def remove(self) -> None:
        shutil.rmtree(self.folder)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_table(path: Path, table) -> None:
    import pyarrow.parquet as pq

    tmp = _temporary(path)
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _temporary(path: Path) -> Path:
    """Hidden from parquet readers of the folder, and one per process: two writers of one
    part (a retried chunk) never write into the same file."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")
