"""What the package calls: the table of C functions (:mod:`._lib`) with the graph builders' functions replaced by
compiled cffi wrappers (:mod:`._fastcalls`) where ``build.py`` built them.

Apart from both: ``_fastcalls`` generates and builds its wrappers from the table (``_fastcalls.build`` reads
``_lib``), and the table does not depend on the wrappers.
"""
from __future__ import annotations

from ._fastcalls import load
from ._lib import FUNCTIONS

# the compiled wrappers of the graph builders' calls, where build.py could build them; WHY_NO_FAST: why there are
# none ("" when there are)
FAST, WHY_NO_FAST = load(FUNCTIONS)
CALLS: dict[str, object] = {**FUNCTIONS, **FAST}  # what the package calls: name -> compiled or ctypes function

__all__ = ["CALLS", "FAST", "WHY_NO_FAST"]
