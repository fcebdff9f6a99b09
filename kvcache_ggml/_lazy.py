"""Lazy public names of a package (PEP 562): a name is imported from its module on first access, so importing the
package stays light (no ggml until a name that needs it is used)."""
from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_exports(package: str, table: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose names ``table`` maps to the (relative) modules defining
    them; a loaded name is stored in ``namespace`` (the package's globals) so it is looked up once."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
