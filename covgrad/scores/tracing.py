"""Which module's per-sample rule gives each selected parameter its gradient, and the first call's trace that
checks it.

:func:`bind_rules` binds every module that owns selected parameters to its rule
(:func:`covgrad.scores.binding.rule_for`) and names, in one message, every parameter without one. The first call of
:class:`covgrad.scores.engine.PerSampleGrads` then traces one forward of (at most) two samples
(:func:`trace_forward`): a :class:`torch.overrides.TorchFunctionMode` records the module calls in which each
selected parameter is used, so that a parameter used outside the forward of the module that owns it (a weight its
parent hands to a functional conv) moves to the smallest module whose forward holds all its uses
(:func:`rebind`), and autograd on the traced forward checks that every module that runs on a flattened (B·L, …)
batch or whose forward a rule replays keeps the samples apart (:func:`check_apart`). For a generic-rule module
whose batch is another dimension of its arguments (Gemma 3n's decoder layer on (altup inputs, B, L, H) stacks) it
finds that dimension of each argument instead (:class:`covgrad.scores.opgrads.Crossed`), for the op-level path.

A refused parameter is named once, with its first reason, in one line with a ``model.params`` selection without
the refused ones (:func:`refusal`, :class:`RefusalError`); the engine collects the refusals of its trace, its hooks
and its rules over a whole pass (:class:`Refusals`), so the selection proposed is one whose pass ran.

Shape notation: B samples in the batch, L sequence positions.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from covgrad.layout import ParamLayout, TensorEntry
from covgrad.scores.binding import rule_for
from covgrad.scores.experts import _routed_experts_rule, experts_shape
from covgrad.scores.hooks import graph_root
from covgrad.scores.opgrads import Crossed
from covgrad.scores.optaps import METADATA_READS, float_args
from covgrad.scores.rules import Rule, float_outputs, generic_rule
from covgrad.scores.selfcheck import Mixing

# Positions of the first call's trace (trace_forward): the last ones of each row (real tokens under left padding).
_TRACE_POSITIONS = 16

# Tensor methods and attribute getters (``.dtype``, ``.shape``: ``__get__``) that read metadata, not values.
_METADATA = METADATA_READS | {"__get__"}

Binding = tuple[nn.Module, Rule, dict[str, TensorEntry]]

# One module call of the traced forward: the module, its floating first input, its floating outputs and every floating
# argument by its path (covgrad.scores.optaps.float_args).
Record = tuple[nn.Module, list[Tensor], list[Tensor], dict[str, Tensor]]


def bind_rules(model: nn.Module, layout: ParamLayout) -> list[Binding]:
    """Every module owning selected parameters, with its per-sample rule and its selected parameters
    (local name → layout entry), in ``named_modules`` order. A module whose fast rule covers only some of
    its parameters gets a second binding, :func:`covgrad.scores.rules.generic_rule` over the others.

    A tensor registered by a module and again by a module inside it (an LM head's bias that is also its
    decoder Linear's) is bound once, to the inner module, whose forward holds the use: two rules would each
    count it (the first call's trace moves it back out if the outer module's forward uses it directly). A tensor
    registered by two modules apart from each other (a tied embedding and LM head) keeps both bindings, one
    per use. The tensors of a ModuleList of experts are bound to the block that routes rows to them
    (:func:`covgrad.scores.experts.experts_shape`), under their names there (``experts.3.w1.weight``), not to the
    experts' own modules, whose calls on gathered rows no per-module rule could split by sample.

    Raises:
        ValueError: when a selected parameter is not in the model.
        RefusalError: one message naming every selected parameter without a per-sample rule (owned by the
            model's top-level module or by a module whose rule refuses it), with a ``model.params`` selection
            without them.
    """
    params = dict(model.named_parameters())
    missing = [name for name in layout.names if name not in params]
    if missing:
        raise ValueError(f"layout parameters {missing[:3]} are not in the model; build the layout from it")
    by_id = {id(params[e.name]): e for e in layout.entries}
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module_name)

    def inner_owner(module_name: str, p: Tensor) -> bool:
        """Whether a module inside ``module_name`` registers ``p`` too."""
        return any(o != module_name and (not module_name or o.startswith(module_name + ".")) for o in owners[id(p)])

    # a ModuleList of experts is bound to the block that routes rows to it (experts_shape), not expert by expert
    claimed: dict[int, tuple[str, str]] = {}  # parameter id → (the block's module name, its local name there)
    for module_name, module in model.named_modules():
        if module_name and (ex := experts_shape(module)) is not None and ex.listed is not None:
            for pn, p in module.get_submodule(ex.listed).named_parameters():
                claimed[id(p)] = (module_name, f"{ex.listed}.{pn}")

    bindings: list[Binding] = []
    refused: list[tuple[str, str]] = []
    for module_name, module in model.named_modules():
        local = {
            pn: by_id[id(p)]
            for pn, p in module.named_parameters(recurse=False)
            if id(p) in by_id and not inner_owner(module_name, p) and id(p) not in claimed
        }
        local |= {
            pn: by_id[id(p)]
            for (owner, pn), p in ((claimed[id(p)], p) for p in module.parameters() if id(p) in claimed)
            if owner == module_name and id(p) in by_id
        }
        if not local:
            continue
        if not module_name:
            refused += [
                (
                    e.name,
                    f"{e.name!r} is owned by the model's top-level {type(module).__name__}, whose forward is "
                    "the whole model",
                )
                for e in local.values()
            ]
            continue
        found = rule_for(module)
        if isinstance(found, str):
            refused += [
                (e.name, f"{e.name!r} (as {module_name}.{pn}, in a {type(module).__name__}): {found}")
                for pn, e in local.items()
            ]
            continue
        rule, covered = found
        mine = {pn: e for pn, e in local.items() if pn in covered}
        rest = {pn: e for pn, e in local.items() if pn not in covered}
        if mine:
            bindings.append((module, rule, mine))
        if rest:
            bindings.append((module, generic_rule, rest))
    if refused:
        raise RefusalError(layout, refused)
    return bindings


def refusal(layout: ParamLayout, refused: list[tuple[str, str]]) -> str:
    """One line naming every refused parameter once (``(layout name, reason)`` pairs, the first reason of a
    name kept) and a ``model.params`` selection of the layout's other parameters (globs over layer indices
    where they stay exact)."""
    first: dict[str, str] = {}
    for name, reason in refused:
        first.setdefault(name, reason)
    keep = [name for name in layout.names if name not in first]
    head = (
        f"no per-sample rule for parameter {next(iter(first.values()))}"
        if len(first) == 1
        else f"no per-sample rule for {len(first)} selected parameters: " + "; ".join(_grouped(first))
    )
    if not keep:
        return f"{head}; nothing else is selected"
    return f"{head}; a selection without them that runs: model.params = {suggest_params(keep, layout.names)}"


def _grouped(reasons: dict[str, str]) -> list[str]:
    """The reasons of refused parameters, those of the form ``'name': why`` with the same ``why`` joined into one
    (``'a', 'b': why``), in the order first found."""
    groups: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        prefix = f"{name!r}: "
        if reason.startswith(prefix):
            groups.setdefault(reason[len(prefix) :], []).append(repr(name))
        else:
            groups.setdefault(reason, [])
    return [f"{', '.join(names)}: {why}" if names else why for why, names in groups.items()]


class RefusalError(ValueError):
    """Selected parameters without an exact per-sample gradient: one line (:func:`refusal`) naming each once.

    Attributes:
        reasons: layout name → why it is refused (the first reason found), in the order found.
    """

    def __init__(self, layout: ParamLayout, refused: list[tuple[str, str]]) -> None:
        self.reasons: dict[str, str] = {}
        for name, reason in refused:
            self.reasons.setdefault(name, reason)
        super().__init__(refusal(layout, refused))


class Refusals:
    """The parameters a :class:`covgrad.scores.engine.PerSampleGrads` refused so far (by its first call's trace,
    its forward hooks or its rules), collected so that one refusal names all of them, with a selection without
    them whose pass was seen to run; once any is refused, every call raises.

    Args:
        layout: the engine's selection.
    """

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout
        self.reasons: dict[str, str] = {}

    def add(self, refused: list[tuple[str, str]]) -> None:
        """Refuse each ``(layout name, reason)`` (a name already refused keeps its first reason)."""
        for name, reason in refused:
            self.reasons.setdefault(name, reason)

    def any_of(self, local: dict[str, TensorEntry]) -> bool:
        """Whether any parameter of a binding's ``local`` entries is refused."""
        return bool(self.reasons) and any(e.name in self.reasons for e in local.values())

    def refuse(self, local: dict[str, TensorEntry], why: str) -> None:
        """Refuse every parameter of a binding's ``local`` entries for the same reason ``why``."""
        self.add([(e.name, f"{e.name!r}: {why}") for e in local.values()])

    def drop(self, bindings: list[Binding]) -> list[Binding]:
        """``bindings`` without the refused parameters (a binding left with none is dropped)."""
        kept = []
        for module, rule, local in bindings:
            local = {pn: e for pn, e in local.items() if e.name not in self.reasons}
            if local:
                kept.append((module, rule, local))
        return kept

    def raise_any(self) -> None:
        """Raise one :class:`RefusalError` naming every refused parameter, if any."""
        if self.reasons:
            raise RefusalError(self.layout, list(self.reasons.items()))


def suggest_params(keep: list[str], names: tuple[str, ...] | list[str]) -> list[str]:
    """Glob patterns matching exactly ``keep`` among ``names``: each name with its layer indices replaced by
    ``*`` where that pattern matches no other name, the name itself otherwise; deduplicated, in order."""
    keep_set, out = set(keep), []
    for name in keep:
        pat = re.sub(r"\.\d+\.", ".*.", name)
        if pat != name and not all(n in keep_set for n in names if fnmatch.fnmatchcase(n, pat)):
            pat = name
        if pat not in out:
            out.append(pat)
    return out


@dataclass
class TracedForward:
    """What the first call's traced forward saw (:func:`trace_forward`).

    Attributes:
        n: samples traced (the batch's first, at most 2).
        length: positions traced (each row's last, at most ``_TRACE_POSITIONS``).
        uses: each used selected parameter (layout name) → the module call stacks it was used in, outermost first.
        records: with two samples, the calls of the bound modules and of every module using a selected
            parameter, in the order they finished.
        emb: with two samples, the graph leaf standing for the input embeddings' output (empty when the model
            has none; the model sees a copy, which it may update in place: :func:`covgrad.scores.hooks.graph_root`).
    """

    n: int
    length: int
    uses: dict[str, set[tuple[str, ...]]]
    records: list[Record]
    emb: list[Tensor]


def trace_forward(
    model: nn.Module,
    layout: ParamLayout,
    params: list[Tensor],
    bindings: list[Binding],
    names: dict[int, str],
    inputs: dict[str, Tensor | None],
) -> TracedForward:
    """One forward of the batch's first (at most) two samples, cut to their last ``_TRACE_POSITIONS``
    positions (the trace keeps a graph, and a real vocabulary's logits), recording where the selected
    parameters (``params``, the model's tensors of the layout's entries) are used and, with two samples, the
    calls of the ``bindings``' modules and of the parameters' users on a graph that starts at the input
    embeddings. ``names``: id of each module → its qualified name."""
    n = min(inputs["input_ids"].shape[0], 2)
    sub = {k: v[:n, -_TRACE_POSITIONS:] if v is not None else None for k, v in inputs.items()}
    wanted = {id(p): e.name for e, p in zip(layout.entries, params, strict=True)}
    bound = {id(m) for m, _, _ in bindings}
    stack: list[str] = []
    uses: dict[str, set[tuple[str, ...]]] = {}
    users: set[str] = set()
    records: list[Record] = []
    emb: list[Tensor] = []
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None

    def pre(module: nn.Module, args: tuple) -> None:
        stack.append(names[id(module)])

    def post(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        name = stack.pop()
        if n == 2 and (id(module) in bound or name in users):
            first = args[0] if args else next(iter(kwargs.values()), None)
            ins = [first] if isinstance(first, Tensor) and first.is_floating_point() else []
            records.append((module, ins, list(float_outputs(output)), float_args(args, kwargs)))

    def leaf(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return graph_root(output, emb)

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    if n == 2 and isinstance(embedding, nn.Module):
        handles.append(embedding.register_forward_hook(leaf))
    try:
        with torch.enable_grad(), _ParamUses(wanted, stack, uses, users):
            model(**sub, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return TracedForward(n, sub["input_ids"].shape[1], uses, records, emb)


def rebind(
    model: nn.Module,
    layout: ParamLayout,
    bindings: list[Binding],
    names: dict[int, str],
    uses: dict[str, set[tuple[str, ...]]],
) -> tuple[list[Binding], list[tuple[str, str]]]:
    """The bindings with every selected parameter that has a use outside its bound modules' forwards moved to
    the smallest module whose forward holds all its uses, with :func:`covgrad.scores.rules.generic_rule` (merged
    into that module's generic binding when it has one), and the refused parameters ``(layout name, reason)``:
    every one that only the model's top-level forward uses, left out of the bindings returned."""
    modules = dict(model.named_modules())
    bound_in: dict[str, set[str]] = {}
    routes: dict[str, set[str]] = {}  # bound to an experts block, whose rule runs its forward: used anywhere in it
    for module, rule, local in bindings:
        for e in local.values():
            bound_in.setdefault(e.name, set()).add(names[id(module)])
            if rule is _routed_experts_rule:
                routes.setdefault(e.name, set()).add(names[id(module)])
    moves: dict[str, str] = {}
    refused: list[tuple[str, str]] = []
    for name, stacks in uses.items():
        inside = routes.get(name, set())
        if all(st and (st[-1] in bound_in.get(name, ()) or inside & set(st)) for st in stacks):
            continue
        common = _common_prefix(stacks)
        target = common[-1] if common else ""
        if not target or not name.startswith(target + "."):
            refused.append(
                (
                    name,
                    f"{name!r} is used by the forward of {target or 'the top-level model'} outside any "
                    "submodule that owns it, so no module's per-sample rule sees it (it would be served as zeros)",
                )
            )
            continue
        moves[name] = target
    if not moves and not refused:
        return bindings, refused
    gone = set(moves) | {name for name, _ in refused}
    kept = []
    for module, rule, local in bindings:
        local = {pn: e for pn, e in local.items() if e.name not in gone}
        if local:
            kept.append((module, rule, local))
    added: dict[str, dict[str, TensorEntry]] = {}
    for name, target in moves.items():
        added.setdefault(target, {})[name[len(target) + 1 :]] = layout.entry(name)
    # a module's generic binding takes the moved parameters too: one replay of its forward for all of them
    merged = []
    for module, rule, local in kept:
        extra = added.pop(names[id(module)], {}) if rule is generic_rule else {}
        merged.append((module, rule, {**local, **extra}))
    return merged + [(modules[t], generic_rule, local) for t, local in added.items()], refused


def check_apart(
    bindings: list[Binding],
    names: dict[int, str],
    emb: Tensor,
    records: list[Record],
    L: int,
    op_taps: bool,
) -> tuple[set[int], set[int], dict[int, Crossed], list[tuple[str, str]]]:
    """Verify that the recorded module calls keep the two traced samples apart: Σ of random projections of
    sample b's rows of the checked modules' inputs and outputs must have a zero gradient on the other sample's
    embeddings ``emb`` (one backward per sample; L: the traced positions).

    Returns:
        The ids of the bound modules that ran flattened, verified: sample-major rows (row n·k + j is sample
        n's), or, for a rule that reads the whole call, outer-major ones (an (m·B·L, …) batch whose row
        (i·B + n)·L + t is sample n's position t, as experts that see every token once per expert); and of
        those, the outer-major ones; the crossed modules (:func:`_crossed`: generic-rule modules whose batch is
        another dimension of their arguments, for the op-level path, ``op_taps``; without it they are refused);
        and the refused parameters ``(layout name, reason)``: every parameter of a module that mixes samples or
        whose flattened rows are not sample by sample (a module called several times names its parameters once).
        A module reading its whole call whose outputs reach the other sample only as far as another of its inputs
        already does (routing weights a mixing router made) is downstream of the mixing and kept: the checked
        pass's separation probe refuses the tensors upstream of it (:func:`locate_mixing`).
    """
    rules = {id(m): rule for m, rule, _ in bindings}
    generic = {id(m) for m, _, _ in bindings} - {id(m) for m, rule, _ in bindings if rule is not generic_rule}
    checked = []
    for module, ins, outs, named in records:
        if id(module) not in rules:
            continue
        needs = getattr(rules[id(module)], "needs_call", False)
        flat = any(t.shape[0] > 2 for t in (*ins, *outs) if t.dim() and t.shape[0] % 2 == 0)
        if needs or flat:
            rest = [t for t in named.values() if not (ins and t is ins[0])] if needs else []
            checked.append((module, ins, outs, flat, rest, named))
    leaks, sample_dim = _leak_test(emb, L)
    every = [t for _, ins, outs, _, _, _ in checked for t in (*ins, *outs)]
    mixing = any(leaks(every, b) for b in (0, 1))
    crossed = _crossed(checked, generic, names, leaks, sample_dim, mixing)
    outer: set[int] = set()
    refused: list[tuple[str, str]] = []
    if not op_taps:
        why = "the op-level path is off (op_taps=False)"
        refused += [
            (e.name, f"{e.name!r}: {crossed[id(m)].refusal(why)}")
            for m, _, local in bindings
            if id(m) in crossed
            for e in local.values()
        ]
    seen = set(crossed)  # modules refused or crossed already (a module called several times is named once)
    if mixing:
        for module, ins, outs, flat, rest, _ in checked:
            if id(module) in seen:
                continue
            where = f"{names[id(module)]} (a {type(module).__name__})"
            if (
                flat
                and getattr(rules[id(module)], "needs_call", False)
                and any(leaks(ins, b) for b in (0, 1))
                and not any(leaks(ins + outs, b, outer=True) for b in (0, 1))
            ):
                outer.add(id(module))
                continue
            if any(leaks(ins, b) for b in (0, 1)):
                what = (
                    "runs on inputs whose leading dimension is not sample by sample (the batch is another "
                    "dimension, or its caller orders or mixes the rows otherwise)"
                    if flat
                    else "receives an input that mixes samples"
                )
            elif any(leaks(outs, b) for b in (0, 1)) and not any(leaks(rest, b) for b in (0, 1)):
                what = "mixes samples (its output for one sample depends on another sample's input)"
            else:
                continue
            seen.add(id(module))
            refused += [
                (e.name, f"{e.name!r}: {where} {what}, so no per-sample gradient exists")
                for m, _, local in bindings
                if m is module
                for e in local.values()
            ]
    flat_ok = {id(module) for module, _, _, flat, _, _ in checked if flat and id(module) not in crossed}
    return flat_ok, outer, crossed if op_taps else {}, refused


def _crossed(
    checked: list[tuple[nn.Module, list[Tensor], list[Tensor], bool, list[Tensor], dict[str, Tensor]]],
    generic: set[int],
    names: dict[int, str],
    leaks: Callable[..., bool],
    sample_dim: Callable[[Tensor], int | None],
    mixing: bool,
) -> dict[int, Crossed]:
    """The modules of ``generic`` (every binding of theirs takes the generic rule) whose first input is not
    batch-leading in any traced call (its leading dimension is odd, so it is not the two samples, or its halves
    reach each other's sample, ``mixing``) but has a dimension along which its slices are the samples
    (``sample_dim``), as has every floating output: their op-level taps probe every use's rows
    (:class:`covgrad.scores.opgrads.Crossed`). A module with a call that is batch-leading, or whose calls disagree,
    is not crossed; one whose first input or an output has no such dimension is left to the other checks."""
    found: dict[int, Crossed] = {}
    failed: set[int] = set()
    for module, ins, outs, _, _, named in checked:
        i = id(module)
        if i not in generic or i in failed:
            continue
        odd = bool(ins) and ins[0].dim() > 0 and ins[0].shape[0] % 2 == 1
        if not (odd or (mixing and any(leaks(ins, b) for b in (0, 1)))):
            failed.add(i)  # batch-leading (or no floating first input): the replay and the call's own checks
            continue
        dims = {k: d for k, t in named.items() if (d := sample_dim(t)) is not None}
        first = next(k for k, t in named.items() if t is ins[0])
        if (
            first not in dims
            or any(sample_dim(o) is None for o in outs if o.requires_grad)
            or (i in found and found[i].dims != dims)
        ):
            failed.add(i)
            continue
        where = f"{names[i]} (a {type(module).__name__})"
        found[i] = Crossed(dims, f"{where} runs on inputs whose batch is dimension {dims[first]} of its first input")
    return {i: c for i, c in found.items() if i not in failed}


def _leak_test(emb: Tensor, L: int) -> tuple[Callable[..., bool], Callable[[Tensor], int | None]]:
    """``leaks(ts, b, outer=False)``: whether a random projection of sample b's rows of the tensors ``ts``
    (sample-major halves of their leading dimension, or with ``outer`` the (m, 2, L) outer-major rows) has a
    nonzero gradient on the other sample's embeddings ``emb`` (2, L, H); and ``sample_dim(t)``: the first dimension
    of ``t`` of size 2 along which slice b's random projection has a nonzero gradient on sample b's embeddings and
    none on the other's, for both b (None when none has). The projections come from one generator seeded 0, drawn
    in the order of the calls."""
    gen = torch.Generator().manual_seed(0)

    def part(t: Tensor, b: int, outer: bool) -> Tensor:
        if outer and t.shape[0] % (2 * L) == 0:
            return t.reshape(t.shape[0] // (2 * L), 2, L, *t.shape[1:])[:, b]
        k = t.shape[0] // 2
        return t[b * k : (b + 1) * k]

    def reach(parts: list[Tensor]) -> Tensor | None:
        """The gradient on ``emb`` of Σ random projections of ``parts`` (NaN and inf, from 0·∞ through a zero-norm
        padding embedding, carry no evidence either way: zeros)."""
        total = sum((p.float() * torch.randn(p.shape, generator=gen).to(p.device)).sum() for p in parts)
        (grad,) = torch.autograd.grad(total, emb, retain_graph=True, allow_unused=True)
        return None if grad is None else grad.nan_to_num(0.0, 0.0, 0.0)

    def leaks(ts: list[Tensor], b: int, outer: bool = False) -> bool:
        ts = [t for t in ts if t.requires_grad and t.dim() and t.shape[0] % 2 == 0]
        if not ts:
            return False
        grad = reach([part(t, b, outer) for t in ts])
        return grad is not None and bool((grad[1 - b] != 0).any())

    def sample_dim(t: Tensor) -> int | None:
        if not t.requires_grad:
            return None
        for d, size in enumerate(t.shape):
            if size != 2:
                continue
            grads = [reach([t.select(d, b)]) for b in (0, 1)]
            if all(g is not None and bool((g[b] != 0).any() & (g[1 - b] == 0).all()) for b, g in enumerate(grads)):
                return d
        return None

    return leaks, sample_dim


class _ParamUses(TorchFunctionMode):
    """Records, for every torch function called with a selected parameter, the stack of module calls it ran in.

    Args:
        wanted: id of each selected parameter → its name.
        stack: the qualified names of the module calls in progress (kept by the caller's hooks).
        uses: filled with name → set of call stacks (tuples of module names, outermost first).
        users: filled with the innermost module name of every use.
    """

    def __init__(
        self, wanted: dict[int, str], stack: list[str], uses: dict[str, set[tuple[str, ...]]], users: set[str]
    ) -> None:
        super().__init__()
        self.wanted, self.stack, self.uses, self.users = wanted, stack, uses, users

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _METADATA:  # reads no values: not a use
            return func(*args, **kwargs)
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and id(t) in self.wanted:
                self.uses.setdefault(self.wanted[id(t)], set()).add(tuple(self.stack))
                if self.stack:
                    self.users.add(self.stack[-1])
        return func(*args, **kwargs)


def _common_prefix(stacks: set[tuple[str, ...]]) -> list[str]:
    """The longest common prefix of module call stacks (outermost first)."""
    common = list(min(stacks, key=len))
    for st in stacks:
        k = next((i for i, (a, b) in enumerate(zip(common, st, strict=False)) if a != b), len(common))
        common = common[:k]
    return common


@dataclass
class _Made:
    """The probe forward of :func:`locate_mixing`: the floating tensors made by module calls and by the ops that use a
    selected parameter on data, in the order they were made.

    Attributes:
        tensors: each made tensor and the id of the module that returned it (None for an op's output).
        calls: every module call: its qualified name, module, first index into ``tensors`` made inside it, end
            index, the indices of its own outputs and of its floating inputs made before it.
        uses: each selected parameter (layout name) → the indices of the outputs of the ops that use it on data.
    """

    tensors: list[tuple[Tensor, int | None]]
    calls: list[tuple[str, nn.Module, int, int, list[int], list[int]]]
    uses: dict[str, list[int]]


class _UseOutputs(TorchFunctionMode):
    """Records the floating outputs of every torch function called with a selected parameter and a floating tensor
    that is no parameter (data), in ``made`` (``wanted``: id of each selected parameter → its name; ``params``: the
    ids of all the model's parameters)."""

    def __init__(self, wanted: dict[int, str], params: set[int], made: _Made) -> None:
        super().__init__()
        self.wanted, self.params, self.made = wanted, params, made

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") in _METADATA:
            return out
        ts = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        names = {self.wanted[id(t)] for t in ts if id(t) in self.wanted}
        if names and any(t.is_floating_point() and id(t) not in self.params for t in ts):
            for t in float_outputs(out):
                for name in names:
                    self.made.uses.setdefault(name, []).append(len(self.made.tensors))
                self.made.tensors.append((t, None))
        return out


def _probe_forward(
    model: nn.Module, layout: ParamLayout, params: list[Tensor], names: dict[int, str], inputs: dict[str, Tensor | None]
) -> tuple[Tensor, _Made]:
    """One forward of the batch with every floating parameter requiring grad (restored after), recording what
    :class:`_Made` holds; returns the logits (B, L, V) and the record."""
    made = _Made([], [], {})
    starts: list[tuple[int, list[int]]] = []

    at: dict[int, int] = {}  # id of each made tensor → its last index, for the first done[0] ones
    done = [0]

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        at.update((id(t), k) for k, (t, _) in enumerate(made.tensors[done[0] :], done[0]))
        done[0] = len(made.tensors)
        ins = [at[id(t)] for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and id(t) in at]
        starts.append((len(made.tensors), ins))

    def post(module: nn.Module, args: tuple, output: object) -> None:
        own = []
        for t in float_outputs(output):
            own.append(len(made.tensors))
            made.tensors.append((t, id(module)))
        start, ins = starts.pop()
        made.calls.append((names[id(module)], module, start, len(made.tensors), own, ins))

    flags = [(p, p.requires_grad) for p in model.parameters()]
    handles = [
        h
        for m in model.modules()
        for h in (m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post))
    ]
    wanted = {id(p): e.name for e, p in zip(layout.entries, params, strict=True)}
    try:
        for p, _ in flags:
            p.requires_grad_(p.is_floating_point())
        with torch.enable_grad(), _UseOutputs(wanted, {id(p) for p, _ in flags} | set(wanted), made):
            logits = model(**inputs, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
    return logits, made


def locate_mixing(
    model: nn.Module,
    layout: ParamLayout,
    params: list[Tensor],
    bindings: list[Binding],
    names: dict[int, str],
    flat: tuple[set[int], set[int]],
    inputs: dict[str, Tensor | None],
    mixing: Mixing,
) -> list[tuple[str, str]]:
    """The selected parameters whose gradient flows through a place where the samples mix, ``(layout name,
    reason)``: :func:`covgrad.scores.selfcheck.separation` found that sample ``mixing.j``'s tokens move the logits
    of ``mixing.targets``. One forward of the batch records every module call's outputs and every output of an op
    that uses a selected parameter on data (:func:`_probe_forward`); one backward of a random projection of the
    targets' logits finds those whose sample-j rows reach them (they are upstream of the mixing). Refused: every
    parameter with such an op output, every parameter of a bound module with such an output or inside whose call
    the mixing happens (every one when no tensor reaches them: the logits depend on sample j through no path a
    gradient follows, e.g. a routing choice). The place named is the innermost call around the last such tensor
    made whose own outputs reach no other sample, or the first call inside it, after that tensor, that takes such
    a tensor (a final norm that averages over the batch).

    Args:
        flat: the ids of the bound modules the trace verified on a flattened batch, and of those the outer-major
            ones (:func:`check_apart`): their rows are split that way; other tensors only when their leading
            dimension is B or B·L.
    """
    B, L = inputs["input_ids"].shape
    logits, made = _probe_forward(model, layout, params, names, inputs)
    gen = torch.Generator().manual_seed(0)
    mask = inputs["attention_mask"]
    total = sum(
        (logits[i].float() * torch.randn(logits[i].shape, generator=gen).to(logits.device) * mask[i, :, None]).sum()
        for i in mixing.targets
    )
    idx = [k for k, (t, _) in enumerate(made.tensors) if t.requires_grad]
    grads = torch.autograd.grad(total, [made.tensors[k][0] for k in idx], allow_unused=True)
    leaking = set()
    for k, g in zip(idx, grads, strict=True):
        rows = None if g is None else _rows_of(g, mixing.j, B, L, made.tensors[k][1], flat)
        if rows is not None and bool((rows.nan_to_num(0.0, 0.0, 0.0) != 0).any()):
            leaking.add(k)
    where = f"sample {mixing.j}'s tokens move sample {mixing.targets[0]}'s logits by {mixing.rel:.2g} of their scale"
    if not leaking:
        why = f"{where} through no path a gradient follows (a routing or other choice that depends on the batch)"
        return [(name, f"{name!r}: {why}, so no per-sample score exists") for name in layout.names]
    last = max(leaking)
    around = [c for c in made.calls if c[2] <= last < c[3] and not leaking & set(c[4])]
    outer = max(around, key=lambda c: (c[2], -c[3])) if around else None
    takers = [c for c in made.calls if outer and last < c[2] < outer[3] and leaking & set(c[5])]
    mixer = min(takers, key=lambda c: (c[2], -c[3]))[0] if takers else outer[0] if outer else ""
    place = f"{mixer} (a {type(model.get_submodule(mixer)).__name__})" if mixer else "the model's top-level forward"
    why = (
        f"its gradient flows through {place}, which mixes the samples ({where}), so its per-sample rows would "
        "take other samples' objectives"
    )
    hit = {name for name, ks in made.uses.items() if leaking & set(ks)}
    for module, _, local in bindings:
        name = names[id(module)]
        inside = bool(name) and (mixer == name or mixer.startswith(name + "."))
        outs = {k for c in made.calls if c[1] is module for k in c[4]}
        if inside or leaking & outs:
            hit |= {e.name for e in local.values()}
    return [(name, f"{name!r}: {why}") for name in layout.names if name in hit]


def _rows_of(g: Tensor, j: int, B: int, L: int, module: int | None, flat: tuple[set[int], set[int]]) -> Tensor | None:
    """Sample j's rows of a made tensor's gradient ``g``: leading dimension B, or B·L rows (sample-major), or the
    flattened rows of a module the trace verified (outer-major (m·B·L, …) ones for the outer-major modules); None
    when its rows cannot be split by sample."""
    n = g.shape[0] if g.dim() else 0
    if n == B:
        return g[j]
    if module in flat[1] and n % (B * L) == 0:
        return g.reshape(n // (B * L), B, L, *g.shape[1:])[:, j]
    if n == B * L or (module in flat[0] and n % B == 0):
        k = n // B
        return g[j * k : (j + 1) * k]
    return None
