"""A strict GGUF reader: header, metadata and tensor table, checked before any data is touched.

Everything is bounds-checked, so a truncated or corrupt file raises ``ModelLoadError`` naming the
file instead of crashing deeper down (``mx.load`` on a short GGUF can segfault). Tensor data is
exposed as read-only numpy views of a memory map; nothing is copied until it is converted.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.loading.loaded_model import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types (gguf.md): fixed-size scalars, then 8 = string and 9 = array.
_SCALAR = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY_SCALAR = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]  # GGUF order: ne[0] is the innermost (contiguous) dimension
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / MLX order (outermost first)."""
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class GGUFFile:
    """A parsed GGUF file. ``metadata`` maps keys to Python values (arrays become lists)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise ModelLoadError(f"{self.path}: cannot open GGUF file: {e}") from e
        self.file_size = self.path.stat().st_size
        if self.file_size == 0:
            self._file.close()
            raise ModelLoadError(f"{self.path}: empty file, not a GGUF model")
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except ModelLoadError:
            self.close()
            raise
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError, IndexError) as e:
            self.close()
            raise ModelLoadError(f"{self.path}: corrupt GGUF header: {e}") from e

    # --- low-level reads -------------------------------------------------------------------

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self._pos + n > self.file_size:
            raise ModelLoadError(
                f"{self.path}: truncated GGUF header (needed {n} bytes for {what} at offset "
                f"{self._pos}, file has {self.file_size})"
            )

    def _scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALAR[vtype]
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self._mmap, self._pos)
        self._pos += size
        return value

    def _string(self, what: str) -> str:
        n = self._scalar(10, what)
        self._need(n, what)
        s = self._mmap[self._pos : self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR:
            return self._scalar(vtype, key)
        if vtype == _STRING:
            return self._string(key)
        if vtype == _ARRAY:
            etype = self._scalar(4, key)
            count = self._scalar(10, key)
            if etype in _SCALAR:
                size = _SCALAR[etype][1]
                self._need(count * size, key)
                arr = np.frombuffer(
                    self._mmap, dtype=_NUMPY_SCALAR[etype], count=count, offset=self._pos
                )
                self._pos += count * size
                return arr.tolist()
            if etype == _STRING:
                return self._string_array(count, key)
            if etype == _ARRAY:
                return [self._value(_ARRAY, key) for _ in range(count)]
            raise ModelLoadError(f"{self.path}: metadata {key!r} has unknown array type {etype}")
        raise ModelLoadError(f"{self.path}: metadata {key!r} has unknown value type {vtype}")

    def _string_array(self, count: int, key: str) -> list[str]:
        buf, pos, end = self._mmap, self._pos, self.file_size
        out = []
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self._pos = pos
                self._need(8, key)
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + n > end:
                self._pos = pos
                self._need(n, key)
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self._pos = pos
        return out

    # --- structure -------------------------------------------------------------------------

    def _parse(self) -> None:
        self._need(4, "magic")
        magic = self._mmap[0:4]
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (bad magic {bytes(magic)!r})")
        self._pos = 4
        self.version = self._scalar(4, "version")
        if self.version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors = self._scalar(10, "tensor count")
        n_kv = self._scalar(10, "metadata count")
        # Each entry takes at least 8 bytes; a count beyond the file size is corruption.
        if n_tensors * 8 > self.file_size or n_kv * 8 > self.file_size:
            raise ModelLoadError(
                f"{self.path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)"
            )
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string("metadata key")
            vtype = self._scalar(4, key)
            self.metadata[key] = self._value(vtype, key)

        infos = []
        for _ in range(n_tensors):
            name = self._string("tensor name")
            n_dims = self._scalar(4, name)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            ne = tuple(self._scalar(10, name) for _ in range(n_dims))
            raw_type = self._scalar(4, name)
            rel_offset = self._scalar(10, name)
            infos.append((name, ne, raw_type, rel_offset))

        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: bad general.alignment {alignment}")
        self.data_start = (self._pos + alignment - 1) // alignment * alignment

        self.tensors: dict[str, GGUFTensor] = {}
        for name, ne, raw_type, rel_offset in infos:
            try:
                gtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[gtype]
            if any(d <= 0 for d in ne) or ne[0] % block:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} has bad shape {list(ne)} for {gtype.name}"
                )
            nbytes = prod(ne) // block * type_size
            start = self.data_start + rel_offset
            if start + nbytes > self.file_size:
                raise ModelLoadError(
                    f"{self.path}: truncated GGUF: tensor {name!r} needs bytes {start}..{start + nbytes} "
                    f"but the file has {self.file_size}"
                )
            if name in self.tensors:
                raise ModelLoadError(f"{self.path}: duplicate tensor {name!r}")
            self.tensors[name] = GGUFTensor(name, gtype, ne, start, nbytes)

    # --- access ----------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF has no general.architecture")
        return arch

    def header_sha256(self) -> str:
        """Hash of everything before the tensor data: metadata (tokenizer included) and table."""
        import hashlib

        return hashlib.sha256(self._mmap[: self.data_start]).hexdigest()

    def raw(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of shape (rows, bytes_per_row)."""
        rows = prod(t.ne[1:])
        return np.frombuffer(self._mmap, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(
            rows, t.nbytes // rows
        )

    def close(self) -> None:
        # Views into the map may still be alive (numpy holds a buffer export); then the map is
        # closed when the last view goes away.
        try:
            self._mmap.close()
        except (BufferError, AttributeError):
            pass
        try:
            self._file.close()
        except AttributeError:
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
