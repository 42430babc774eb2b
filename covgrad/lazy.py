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


class LazyModule:
    """A module imported on its first attribute access (``dask_array = LazyModule("dask.array")``): engines that
    take numpy or dask arrays import dask only when given a dask array (the GPU image has no dask)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> object:
        return getattr(importlib.import_module(self._name), attr)


def is_dask(*arrays: object) -> bool:
    """Whether any of ``arrays`` is a dask array, without importing dask (none can be before dask is imported)."""
    da = sys.modules.get("dask.array")
    return da is not None and any(isinstance(a, da.Array) for a in arrays)
