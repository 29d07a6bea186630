"""A GGUF file's metadata and tensor table, as ``gguf.GGUFReader`` parses them, kept so a
start-up parses a file once.

``GGUFReader`` reads every field element by element: on SmolLM2's file (49,152 tokens and
their merges) that is about 2.5 s on these machines, paid by every process that loads the
model (the server, each rank, each benchmark). `open_gguf` parses once per file version and
keeps the result twice: in this process, and as JSON under ``$HAL_CACHE/gguf`` keyed by the
file's path, size, modification time and the gguf package's version. Tensor data is always
read from the file itself (memory-mapped), in the shapes ``GGUFReader`` gives it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np

from hal.models.cache_dir import cache_dir

FORMAT = 1   # of the cached JSON
ITEM_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
              "I32": np.int32, "I64": np.int64}   # GGUFReader's element types; other types are blocks of bytes


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: str                 # the GGML type's name: F32, Q4_1, Q8_0, ...
    dims: tuple[int, ...]     # as stored (innermost first), as ``ReaderTensor.shape``
    offset: int               # of its data in the file, in bytes
    nbytes: int

    @property
    def shape(self) -> list[int]:
        """The logical shape, outermost first (``[N, K]`` for a linear weight)."""
        return [int(d) for d in reversed(self.dims)]


@dataclass(eq=False)
class GGUFFile:
    path: str
    fields: dict              # key -> ``ReaderField.contents()``
    tensors: list[TensorInfo]

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    def data(self, t: TensorInfo) -> np.ndarray:
        """``t``'s data as ``ReaderTensor.data``: elements for float and int types, rows of
        block bytes for quantized ones."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape
        raw = self._map()[t.offset:t.offset + t.nbytes]
        shape = tuple(reversed(t.dims))
        if t.kind in ITEM_TYPES:
            return raw.view(ITEM_TYPES[t.kind]).reshape(shape)
        return raw.reshape(quant_shape_to_byte_shape(shape, GGMLQuantizationType[t.kind]))

    @functools.cache
    def _map(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="r")


def open_gguf(path: str | Path) -> GGUFFile:
    """``path``'s metadata and tensor table (parsed once per file version; see the module docstring)."""
    st = os.stat(path)
    return _open(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    key = json.dumps([FORMAT, path, mtime_ns, size, version("gguf")])
    saved = cache_dir() / "gguf" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        d = json.loads(saved.read_text())
        if d.get("key") == key:
            return GGUFFile(path, d["fields"], [TensorInfo(n, k, tuple(dims), o, b) for n, k, dims, o, b in d["tensors"]])
    except (OSError, ValueError, KeyError, TypeError):
        pass   # none yet, or damaged: parse the file
    f = _parse(path)
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = saved.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "fields": f.fields,
                                   "tensors": [[t.name, t.kind, list(t.dims), t.offset, t.nbytes] for t in f.tensors]}))
        tmp.replace(saved)
    except (OSError, TypeError, ValueError):
        pass   # a read-only cache, or a field JSON cannot hold: parse again next time
    return f


def _parse(path: str) -> GGUFFile:
    """`HalError` naming the file unless it is a whole GGUF file: its magic, its metadata and
    tensor table, and every tensor's data inside the file."""
    from gguf import GGUFReader
    from hal.errors import HalError
    size = os.path.getsize(path)
    if size == 0:
        raise HalError(f"{path}: expected a GGUF file, got an empty file", arg="model")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise HalError(f"{path}: expected a GGUF file (magic b'GGUF'), got {magic!r}", arg="model")
    try:
        r = GGUFReader(path)
        fields = {k: _plain(v.contents()) for k, v in r.fields.items() if not k.startswith("GGUF.")}
        tensors = [TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset),
                              int(t.n_bytes)) for t in r.tensors]
    except (ValueError, IndexError, KeyError, TypeError, OSError, OverflowError) as e:
        raise HalError(f"{path}: expected a whole GGUF file, got one whose metadata does not parse "
                       f"({type(e).__name__}: {e}); truncated or corrupt?", arg="model") from None
    for t in tensors:
        if t.offset + t.nbytes > size:
            raise HalError(f"{path}: expected tensor {t.name}'s data at bytes {t.offset}..{t.offset + t.nbytes}, got "
                           f"a file of {size} bytes (truncated)", arg="model")
    return GGUFFile(path, fields, tensors)


def _plain(v):
    """A field's contents as JSON holds them (numpy scalars to Python numbers)."""
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v.item() if isinstance(v, np.generic) else v
