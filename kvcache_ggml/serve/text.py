"""Generated tokens as text that may be sent now, cut at the first stop string.

:class:`TextStream` turns token ids into text with the runtime's ``StreamDecoder`` (``skip_leading_space=False``:
a completion continues the prompt, so its first space is its own), which holds back the bytes of a character not
finished yet.  On top of that, with stop strings:

* text that could still be the start of a stop string (a suffix of the text that is a proper prefix of one of
  them) is held back until it cannot be, so no part of a stop string ever leaves in a chunk;
* when a stop string appears, the one that starts earliest wins (at the same start, the longest); the text before
  it is released, it and everything after are dropped, ``stopped`` becomes True and ``stop`` names it; later
  pushes return ``""``;
* :meth:`TextStream.finish` releases what is held back (an unfinished character as U+FFFD, a prefix of a stop
  string that never completed) unless the stream has stopped.

``text`` is all the text released so far.  Held-back text is kept small: it is never longer than the longest
stop string (plus the piece just pushed while it is searched).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..runtime.tokenizer import StreamDecoder

__all__ = ["TextStream"]


class TextStream:
    """The text of a stream of generated tokens, released chunk by chunk, ending at the first stop string."""

    def __init__(self, vocab: Any, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must not be empty, got {list(stop)!r}")
        self.stops = list(stop)        # the stop strings
        self.text = ""                 # all the text released so far
        self.stopped = False           # a stop string has appeared: nothing more is released
        self.stop: str | None = None   # the stop string that appeared, or None
        self._dec = StreamDecoder(vocab, skip_leading_space=False)  # bytes -> text, whole characters only
        self._held = ""                # decoded text not released yet (could start a stop string)

    def push(self, token: int) -> str:
        """The text that may be sent after ``token``: "" while everything new is held back or after a stop."""
        if self.stopped:
            return ""
        new = self._dec.push(token)
        if not self.stops:  # (nothing is ever held back: no search)
            self.text += new
            return new
        return self._release(new, final=False)

    def finish(self) -> str:
        """The rest of the text at the end of generation (nothing after a stop)."""
        if self.stopped:
            return ""
        return self._release(self._dec.flush(), final=True)

    def _release(self, new: str, final: bool) -> str:
        buf = self._held + new
        hit = self._find_stop(buf)
        if hit is not None:
            at, s = hit
            out, self._held, self.stopped, self.stop = buf[:at], "", True, s
        else:
            keep = 0 if final else self._partial(buf)
            out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            at = buf.find(s)
            if at >= 0 and (best is None or (at, -len(s)) < best[:2]):
                best = (at, -len(s), s)
        return None if best is None else (best[0], best[2])

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        return keep
