"""Names of a package loaded on first use (PEP 562's module `__getattr__`), so importing a spectail
package loads nothing else (not torch) until a name is used: spectail's command line can then
configure the process first (rollout/cpu.py)."""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """The package's `__getattr__`: name -> the attribute of the module `exports[name]` (relative
    to the package), imported once and then kept on the package."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
