"""Package exports resolved on first use (PEP 562), so `specprefetch --help` and light subcommands skip torch."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """Return a module ``__getattr__`` that imports ``exports[name]`` (a module path) on first access,
    and ``__all__``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name]), name)

    return __getattr__, sorted(exports)
