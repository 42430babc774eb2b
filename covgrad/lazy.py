"""Lazy re-exports for the subpackages' ``__init__`` (PEP 562): importing a package loads none of its modules, so
a caller that needs one engine (the GPU image has no pydantic, zarr or dask) pulls in only that module's imports."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def exports(package: str, names: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package`` that imports each re-exported name from its module
    (``names``: name -> module) on first use and keeps it in the package's namespace."""

    def getattr_(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return getattr_
