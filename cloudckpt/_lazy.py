"""Names a package exports without importing their modules until first used (PEP 562),
so that torch-free tools (``cloudckpt list``) do not pay for ``import torch``.

    __getattr__, __dir__ = lazy_exports(__name__, {"Checkpointer": ".checkpointer"})
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: each name of
    ``names`` comes from its module (relative to ``package`` when it starts with a dot),
    imported on first use and then kept in the package."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
