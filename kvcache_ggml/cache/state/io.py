"""Where a cache state goes and comes from: llama.cpp's ``llama_io_write_i``/``llama_io_read_i``.

Writers (:class:`CountingWriter` for sizes, :class:`BytesWriter`, :class:`BufferWriter` into a preallocated
buffer, :class:`StreamWriter`/:class:`FileWriter` to files) and readers (:class:`BytesReader` over memory,
:class:`StreamReader` over files and pipes).  Tensor bytes go from the backend straight into the writer's memory
(``ggml_backend_tensor_get``), or to a file straight from host tensor memory.
"""
from __future__ import annotations

import os
from typing import Any, BinaryIO

import numpy as np

from ... import ggml as G

__all__ = ["StateWriter", "CountingWriter", "BytesWriter", "BufferWriter", "StreamWriter", "FileWriter",
           "StateReader", "BytesReader", "StreamReader"]


def _raw(data: Any) -> memoryview:
    """A flat byte view of a bytes-like object (numpy arrays included, which ``bytearray +=`` would broadcast)."""
    mv = memoryview(data)
    return mv if mv.ndim == 1 and mv.format in ("B", "b", "c") else mv.cast("B")


# ====================================================================================================== writers

class StateWriter:
    """Where a state goes (llama.cpp's ``llama_io_write_i``).

    Subclasses implement :meth:`write` (bytes), :meth:`reserve` (a writable region of the output that the caller
    fills, or None when the writer keeps no data) and :meth:`n_bytes`.  :meth:`write_tensor` copies tensor bytes
    with ``ggml_backend_tensor_get`` straight into the reserved region.
    """

    def write(self, data: Any) -> None:
        raise NotImplementedError

    def reserve(self, n: int) -> np.ndarray | None:
        raise NotImplementedError

    def n_bytes(self) -> int:
        raise NotImplementedError

    def write_tensor(self, t: Any, offset: int, size: int) -> None:
        """Bytes ``[offset, offset + size)`` of tensor ``t``."""
        region = self.reserve(size)
        if region is not None and size:
            G.ggml_backend_tensor_get(t, region.ctypes.data, offset, size)

    def flush(self) -> None:
        """Push what is pending to the destination (a no-op for in-memory writers)."""


class CountingWriter(StateWriter):
    """Counts the bytes only (llama.cpp's ``llama_io_write_dummy``): ``state_size``."""

    def __init__(self) -> None:
        self._n = 0

    def write(self, data: Any) -> None:
        self._n += memoryview(data).nbytes

    def reserve(self, n: int) -> None:
        self._n += n
        return None

    def write_tensor(self, t: Any, offset: int, size: int) -> None:
        self._n += size

    def n_bytes(self) -> int:
        return self._n


class BytesWriter(StateWriter):
    """Appends to a ``bytearray`` (``self.buf``; a new one unless given)."""

    def __init__(self, buf: bytearray | None = None) -> None:
        self.buf = bytearray() if buf is None else buf
        self._start = len(self.buf)

    def write(self, data: Any) -> None:
        self.buf += _raw(data)

    def reserve(self, n: int) -> np.ndarray:
        start = len(self.buf)
        try:
            self.buf.extend(bytes(n))
        except BufferError:
            raise RuntimeError("BytesWriter: a region returned by reserve() is still referenced; drop it before "
                               "writing more") from None
        return np.frombuffer(self.buf, np.uint8, count=n, offset=start)

    def n_bytes(self) -> int:
        return len(self.buf) - self._start

    def getvalue(self) -> bytes:
        return bytes(self.buf[self._start:])


class BufferWriter(StateWriter):
    """Fills a preallocated writable buffer (llama.cpp's ``llama_io_write_buffer``); ValueError when it is full."""

    def __init__(self, buf: Any) -> None:
        self._a = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
        if not self._a.flags.writeable:
            raise ValueError("BufferWriter needs a writable buffer (bytearray, memoryview, numpy array)")
        self._p = 0

    def _take(self, n: int) -> np.ndarray:
        if n > self._a.size - self._p:
            raise ValueError(f"state buffer too small: writing {n} bytes at offset {self._p}, "
                             f"{self._a.size - self._p} left of {self._a.size}")
        region = self._a[self._p:self._p + n]
        self._p += n
        return region

    def write(self, data: Any) -> None:
        src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        self._take(src.size)[...] = src

    def reserve(self, n: int) -> np.ndarray:
        return self._take(n)

    def n_bytes(self) -> int:
        return self._p


class StreamWriter(StateWriter):
    """Writes to a binary file object (llama.cpp's ``llama_io_write_file``).

    Tensor bytes of host buffers go to the file straight from the tensor memory; other data pass through one
    reusable scratch buffer, written out on the next call or on :meth:`flush`.
    """

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self._n = 0
        self._scratch = np.empty(0, np.uint8)
        self._pending = 0

    def _push(self) -> None:
        if self._pending:
            self.f.write(memoryview(self._scratch)[:self._pending])
            self._pending = 0

    def write(self, data: Any) -> None:
        self._push()
        mv = _raw(data)
        self.f.write(mv)
        self._n += mv.nbytes

    def reserve(self, n: int) -> np.ndarray:
        self._push()
        if self._scratch.size < n:
            self._scratch = np.empty(max(n, 2 * self._scratch.size), np.uint8)
        self._pending = n
        self._n += n
        return self._scratch[:n]

    def write_tensor(self, t: Any, offset: int, size: int) -> None:
        if size and G.is_host(t):
            self._push()
            self.f.write(G.host_bytes(t, offset, size))
            self._n += size
            return
        super().write_tensor(t, offset, size)

    def flush(self) -> None:
        self._push()

    def n_bytes(self) -> int:
        return self._n


class FileWriter(StreamWriter):
    """A :class:`StreamWriter` on a path (opened ``wb``, closed by :meth:`close` / ``with``) or a file object."""

    def __init__(self, path_or_file: str | os.PathLike | BinaryIO) -> None:
        self._own = isinstance(path_or_file, (str, bytes, os.PathLike))
        super().__init__(open(path_or_file, "wb") if self._own else path_or_file)  # noqa: SIM115

    def close(self) -> None:
        self.flush()
        if self._own:
            self.f.close()

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ====================================================================================================== readers

class StateReader:
    """Where a state comes from (llama.cpp's ``llama_io_read_i``).

    Positions are relative to where the reader started.  :meth:`read` returns a uint8 array of exactly ``n`` bytes
    (a view of the source when it is in memory) or raises ``ValueError`` naming what was being read.
    """

    def read(self, n: int, what: str) -> np.ndarray:
        raise NotImplementedError

    def peek(self, n: int) -> np.ndarray:
        """Up to ``n`` bytes from the current position, without consuming them."""
        raise NotImplementedError

    def skip(self, n: int, what: str) -> None:
        raise NotImplementedError

    def tell(self) -> int:
        raise NotImplementedError

    def seek(self, pos: int) -> None:
        raise NotImplementedError

    def remaining(self) -> int:
        raise NotImplementedError

    def n_bytes(self) -> int:
        """Bytes read so far (the current position)."""
        return self.tell()

    def read_to(self, dst: Any, n: int, what: str) -> None:
        """Copy the next ``n`` bytes into the writable buffer ``dst``."""
        np.frombuffer(dst, np.uint8, count=n)[...] = self.read(n, what)

    def u32(self, what: str) -> int:
        return int(self.read(4, what).view("<u4")[0])

    def i32(self, what: str) -> int:
        return int(self.read(4, what).view("<i4")[0])

    def u64(self, what: str) -> int:
        return int(self.read(8, what).view("<u8")[0])

    def _truncated(self, what: str, n: int) -> ValueError:
        return ValueError(f"truncated state: {what} needs {n} bytes at offset {self.tell()}, "
                          f"found {self.remaining()}")


class BytesReader(StateReader):
    """Reads a bytes-like object (bytes, bytearray, memoryview, mmap, numpy array) in place, from ``offset``."""

    def __init__(self, data: Any, offset: int = 0) -> None:
        a = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        self._a = a.reshape(-1).view(np.uint8)
        if not 0 <= offset <= self._a.size:
            raise ValueError(f"offset {offset} out of range [0, {self._a.size}]")
        self._start = offset
        self._p = offset

    def read(self, n: int, what: str) -> np.ndarray:
        if n > self._a.size - self._p:
            raise self._truncated(what, n)
        view = self._a[self._p:self._p + n]
        self._p += n
        return view

    def peek(self, n: int) -> np.ndarray:
        return self._a[self._p:self._p + n]

    def skip(self, n: int, what: str) -> None:
        if n > self._a.size - self._p:
            raise self._truncated(what, n)
        self._p += n

    def tell(self) -> int:
        return self._p - self._start

    def seek(self, pos: int) -> None:
        if not 0 <= pos <= self._a.size - self._start:
            raise ValueError(f"seek to {pos} outside [0, {self._a.size - self._start}]")
        self._p = self._start + pos

    def remaining(self) -> int:
        return self._a.size - self._p


def _seekable(f: Any) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, OSError, ValueError):
        return False


class StreamReader(StateReader):
    """Reads a binary file object (llama.cpp's ``llama_io_read_file``) from its current position.

    A seekable file is read in place (checks seek ahead over the data, then come back).  A non-seekable stream
    (a pipe, a socket) is read to its end first.
    """

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self._mem: BytesReader | None = None
        if _seekable(f):
            self._base = f.tell()
            self._size = f.seek(0, os.SEEK_END) - self._base
            f.seek(self._base)
            self._p = 0
        else:
            self._mem = BytesReader(f.read())

    def read(self, n: int, what: str) -> np.ndarray:
        if self._mem is not None:
            return self._mem.read(n, what)
        if n > self._size - self._p:
            raise self._truncated(what, n)
        out = np.empty(n, np.uint8)
        got = self._fill(out)
        self._p += got
        if got < n:
            raise ValueError(f"truncated state: {what} needs {n} bytes at offset {self._p - got}, the file gave "
                             f"{got}")
        return out

    def _fill(self, out: np.ndarray) -> int:
        mv = memoryview(out)
        got = 0
        readinto = getattr(self.f, "readinto", None)
        while got < out.size:
            if readinto is not None:
                k = readinto(mv[got:])
            else:
                chunk = self.f.read(out.size - got)
                k = len(chunk)
                mv[got:got + k] = chunk
            if not k:
                break
            got += k
        return got

    def peek(self, n: int) -> np.ndarray:
        if self._mem is not None:
            return self._mem.peek(n)
        n = min(n, self._size - self._p)
        out = np.empty(n, np.uint8)
        got = self._fill(out)
        self.f.seek(self._base + self._p)
        return out[:got]

    def skip(self, n: int, what: str) -> None:
        if self._mem is not None:
            return self._mem.skip(n, what)
        if n > self._size - self._p:
            raise self._truncated(what, n)
        self._p += n
        self.f.seek(self._base + self._p)

    def tell(self) -> int:
        return self._mem.tell() if self._mem is not None else self._p

    def seek(self, pos: int) -> None:
        if self._mem is not None:
            return self._mem.seek(pos)
        if not 0 <= pos <= self._size:
            raise ValueError(f"seek to {pos} outside [0, {self._size}]")
        self._p = pos
        self.f.seek(self._base + pos)

    def remaining(self) -> int:
        return self._mem.remaining() if self._mem is not None else self._size - self._p
