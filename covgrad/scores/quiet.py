"""Calls inside a tapped module that run outside the taps' mode: those that provably reach no tapped parameter.

:class:`covgrad.scores.optaps.OpTaps` follows every torch call of a tapped module's forward in a
:class:`torch.overrides.TorchFunctionMode`, a few microseconds per op. Most of those ops touch data alone: a forward
that hands its data to a method of its own for a long loop of small ops (RecurrentGemma's RG-LRU runs its linear
recurrence as a Python scan over positions in ``_rnn_scan``), or calls child modules with rules of their own (Gemma
3n's decoder layer, tapped for one AltUp scale, runs its attention, MLP and norms inside it). Two kinds of call
skip the mode:

- a *quiet method* of the tapped module (:func:`quiet_methods`): its code never loads ``self`` (no attribute, no
  call of another method, ``self`` passed nowhere), has no closure and no nested code that captures ``self``, and
  is not ``forward``;
- a *quiet child* (:func:`quiet_children`): a direct child module none of whose parameters (its submodules'
  included) is one of the tapped module's, whose modules hold no tensor or module outside their registered ones
  (a tuple keeping another module's parameters out of the registry), and inside which no module is tapped itself
  (checked by the taps at the call: its uses must be seen).

Either runs, on each call whose arguments hold no parameter, no derived tensor and no module
(:meth:`covgrad.scores.optaps.OpTaps.run_outside`), with torch functions' overrides off; the tensors it returns are
data for the rest of the forward when an argument was, as the mode would have marked them. A call handed a
parameter or a derived tensor runs in the mode as before. Neither can reach a tapped parameter then, except through
a global name that holds the model (no transformers forward does that).
"""

from __future__ import annotations

import dis
import functools
import inspect
import weakref
from collections.abc import Callable
from types import CodeType
from typing import Any, Protocol

from torch import Tensor, nn

# Instructions that read a local variable by name (``self`` among them).
_LOADS_LOCAL = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_CLOSURE"})


class Taps(Protocol):
    """What the quiet wrappers ask of the taps (:class:`covgrad.scores.optaps.OpTaps`)."""

    def run_outside(self, fn: Callable, args: tuple, kwargs: dict, child: nn.Module | None) -> Any: ...


@functools.cache
def _reads_no_self(code: CodeType) -> bool:
    """Whether a method's code (its first argument ``self``) never loads ``self`` and captures nothing."""
    if not code.co_argcount or code.co_freevars or code.co_cellvars:
        return False
    me = code.co_varnames[0]
    for ins in dis.get_instructions(code):
        if ins.opname in _LOADS_LOCAL and me in (ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)):
            return False
    return all(not isinstance(c, CodeType) or not c.co_freevars for c in code.co_consts)


def quiet_methods(module: nn.Module) -> tuple[str, ...]:
    """The names of the module's quiet methods: plain functions of its class (not nn.Module's, not static or class
    methods, not ``forward``, not shadowed on the instance) whose code reads no ``self``."""
    names = []
    for name, fn in inspect.getmembers(type(module), inspect.isfunction):
        if name == "forward" or name.startswith("__") or hasattr(nn.Module, name) or name in vars(module):
            continue
        if isinstance(inspect.getattr_static(type(module), name), staticmethod | classmethod):
            continue
        if _reads_no_self(fn.__code__):
            names.append(name)
    return tuple(names)


def _holds_hidden(module: nn.Module) -> bool:
    """Whether one of the module's (sub)modules keeps a tensor or a module in a plain attribute or a container (a
    tuple, list or dict one level deep) instead of its registered parameters, buffers and children."""
    for m in module.modules():
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            vals = v.values() if isinstance(v, dict) else v if isinstance(v, tuple | list) else (v,)
            if any(isinstance(x, Tensor | nn.Module) for x in vals):
                return True
    return False


def quiet_children(module: nn.Module, params: frozenset[int]) -> tuple[str, ...]:
    """The names of the module's direct children none of whose parameters is in ``params`` (ids of the tapped
    module's parameters) and that hold no hidden tensor or module (:func:`_holds_hidden`)."""
    return tuple(
        name
        for name, child in module.named_children()
        if not any(id(p) in params for p in child.parameters()) and not _holds_hidden(child)
    )


class _Restore:
    """Takes the wrappers off (the class's methods and the children's own forwards are back)."""

    def __init__(self, owners: list[tuple[nn.Module, str]]) -> None:
        self.owners = owners

    def remove(self) -> None:
        for owner, name in reversed(self.owners):
            owner.__dict__.pop(name, None)


# Per module: the tapped parameters' ids its quiet calls were found for, its quiet methods and children (a pass
# wraps them again; the module's code and children do not change between passes).
_FOUND: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[int], tuple[str, ...], tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def stand_aside(module: nn.Module, params: frozenset[int], taps: Taps) -> _Restore:
    """Wrap the module's quiet methods and its quiet children's forwards (on the instances) so that their calls run
    through ``taps.run_outside``; ``params``: ids of the module's tapped parameters. Returns the handle that takes
    the wrappers off. A child whose forward is already replaced on the instance keeps it (not wrapped)."""
    found = _FOUND.get(module)
    if found is None or found[0] != params:
        found = _FOUND[module] = (params, quiet_methods(module), quiet_children(module, params))
    owners: list[tuple[nn.Module, str]] = []
    for name in found[1]:
        module.__dict__[name] = _wrapped(getattr(module, name), taps, None)
        owners.append((module, name))
    for name in found[2]:
        child = module.get_submodule(name)
        if "forward" not in vars(child):
            child.__dict__["forward"] = _wrapped(child.forward, taps, child)
            owners.append((child, "forward"))
    return _Restore(owners)


def _wrapped(fn: Callable, taps: Taps, child: nn.Module | None) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return taps.run_outside(fn, args, kwargs, child)

    return wrapper
