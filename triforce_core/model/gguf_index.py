"""Where each tensor of a GGUF file lies, read once by the gguf package and kept in the cache.

The package's GGUFReader parses every metadata field as numpy views, the tokenizer's ~49K strings
one by one: 3-7 s of each start of the default model with its blocks, for tensor positions that
never change. The first read writes them (name, type, shape, byte offset and size) to a small JSON
file keyed by the file's name, size and modification time; later starts map the tensors' bytes
straight from the file."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from triforce.errors import UserError
from triforce.paths import cache_root, read_small, write_atomically

VERSION = 1


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it (innermost first)
    offset: int             # bytes from the file's start
    n_bytes: int
    path: Path

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, mapped from the file (uint8)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.n_bytes,))


def gguf_tensors(path: Path) -> dict[str, GgufTensor]:
    """The file's tensors by name (from the cached index when the file is unchanged; a load asks
    several times, so a process reads each version of a file once)."""
    path = Path(path).resolve()
    stat = path.stat()
    return dict(_tensors(path, stat.st_size, stat.st_mtime_ns, cache_root()))


@lru_cache(maxsize=8)
def _tensors(path: Path, size: int, mtime_ns: int, root: Path) -> dict[str, GgufTensor]:
    index = root / "gguf-index" / f"{path.stem}-{size}-{mtime_ns}.json"
    try:
        saved = json.loads(read_small(index, "a tensor index"))
        if saved.get("version") == VERSION:
            return {t["name"]: _tensor(t, path) for t in saved["tensors"]}
    except (UserError, ValueError, KeyError, TypeError):
        pass  # no index yet, or a torn one: read the file again
    from gguf import GGUFReader

    rows = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(n) for n in t.shape],
             "offset": int(t.data_offset), "n_bytes": int(t.n_bytes)} for t in GGUFReader(str(path)).tensors]
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        # whole or absent, for a concurrent start; the temporary file's name is its own (a dot file)
        write_atomically(index, json.dumps({"version": VERSION, "tensors": rows}))
    except OSError:
        pass  # a read-only cache only costs the next start the parse
    return {t["name"]: _tensor(t, path) for t in rows}


def is_index(path: Path) -> bool:
    """`path` reads as an index this module wrote (what `triforce cache prune` may remove)."""
    try:
        saved = json.loads(read_small(path, "a tensor index"))
    except (UserError, ValueError):
        return False
    return isinstance(saved, dict) and set(saved) == {"version", "tensors"} and isinstance(saved["tensors"], list)


def _tensor(row: dict, path: Path) -> GgufTensor:
    return GgufTensor(row["name"], GGMLQuantizationType(row["type"]), tuple(row["shape"]), row["offset"],
                      row["n_bytes"], path)
