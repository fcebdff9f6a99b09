"""A fast GGUF reader: header, key/values, tensor infos, data by memory map (``HParams.from_gguf`` maps the keys).

GGUF (version 2 and 3), little-endian:

* header: magic ``b"GGUF"``, ``u32`` version, ``u64`` tensor count, ``u64`` key/value count;
* each key/value: key (``u64`` length + UTF-8 bytes), ``u32`` value type, the value: 0 ``u8``, 1 ``i8``, 2 ``u16``,
  3 ``i16``, 4 ``u32``, 5 ``i32``, 6 ``f32``, 7 ``bool`` (one byte), 8 string (``u64`` length + bytes), 9 array
  (``u32`` item type, ``u64`` count, the items), 10 ``u64``, 11 ``i64``, 12 ``f64``;
* each tensor info: name (string), ``u32`` n_dims, ``u64`` ne[n_dims] (ggml order), ``u32`` ggml type, ``u64``
  offset from the data section;
* the data section starts at the next multiple of ``general.alignment`` (default 32).

Every field is checked on read; a bad one is a ValueError naming the offset and the value.  Numeric arrays are read
with one ``np.frombuffer``; string arrays (a vocabulary) with one loop over the bytes, so a 128k-token vocabulary
takes a fraction of a second (the ``gguf`` package's reader takes tens of seconds on the same file).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """One tensor of a GGUF file."""

    name: str                 # GGUF tensor name
    ne: tuple[int, ...]       # shape in ggml ne order
    type: int                 # ggml type id
    offset: int               # byte offset of the data in the file


class GGUFFile:
    """The metadata of a GGUF file (``kv``: key -> value, ``kv_types``: key -> its GGUF types, ``tensors``: name ->
    TensorInfo) and its data mapped."""

    def __init__(self, path: str | PathLike) -> None:
        self.path = str(path)
        self._mm = np.memmap(self.path, np.uint8, mode="r")
        buf = memoryview(self._mm)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self.version = version
        self._buf, self._pos = buf, 24
        self.kv: dict[str, Any] = {}
        self.kv_types: dict[str, tuple[int, int | None]] = {}  # key -> (GGUF value type, an array's item type)
        for _ in range(n_kv):
            key = self._str()
            vtype = self._u32()
            itype = struct.unpack_from("<I", buf, self._pos)[0] if vtype == _ARRAY else None
            self.kv_types[key] = (vtype, itype)
            self.kv[key] = self._value(vtype)
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = self._str()
            n_dims = self._u32()
            if n_dims > 4:
                raise ValueError(f"{self.path}: tensor {name} has {n_dims} dimensions (at most 4)")
            ne = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in ne), int(ttype), int(offset))
        align = int(self.kv.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment {align} is not a power of two")
        self.data_offset = (self._pos + align - 1) // align * align
        del self._buf

    def _u32(self) -> int:
        v = struct.unpack_from("<I", self._buf, self._pos)[0]
        self._pos += 4
        return v

    def _str(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        if self._pos + 8 + n > len(self._buf):
            raise ValueError(f"{self.path}: string of {n} bytes at offset {self._pos} runs past the end")
        s = bytes(self._buf[self._pos + 8:self._pos + 8 + n]).decode("utf-8", errors="replace")
        self._pos += 8 + n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            v = struct.unpack_from(_SCALAR[vtype], self._buf, self._pos)[0]
            self._pos += struct.calcsize(_SCALAR[vtype])
            return v
        if vtype == _STRING:
            return self._str()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at offset {self._pos - 4}")
        itype, n = struct.unpack_from("<IQ", self._buf, self._pos)
        self._pos += 12
        if itype in _NP:
            a = np.frombuffer(self._buf, _NP[itype], count=n, offset=self._pos)
            self._pos += a.nbytes
            return a.tolist()
        if itype == _STRING:
            return self._strings(n)
        return [self._value(itype) for _ in range(n)]

    def _strings(self, n: int) -> list[str]:
        out = []
        buf, pos, unpack = self._buf, self._pos, struct.unpack_from
        for _ in range(n):
            (k,) = unpack("<Q", buf, pos)
            out.append(bytes(buf[pos + 8:pos + 8 + k]).decode("utf-8", errors="replace"))
            pos += 8 + k
        self._pos = pos
        return out

    def data(self, name: str, nbytes: int) -> np.ndarray:
        """uint8 [nbytes]: the data of tensor name (a view of the memory map)."""
        start = self.data_offset + self.tensors[name].offset
        if start + nbytes > self._mm.size:
            raise ValueError(f"{self.path}: tensor {name} needs {nbytes} bytes at {start}, the file has "
                             f"{self._mm.size}")
        return self._mm[start:start + nbytes]


def read_kv(path: str | PathLike) -> dict[str, Any]:
    """Every key/value pair of the GGUF header, values as Python scalars, strings or lists."""
    return GGUFFile(path).kv
