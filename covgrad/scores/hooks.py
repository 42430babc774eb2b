"""The forward hooks of :class:`covgrad.scores.engine.PerSampleGrads` on the modules bound to per-sample rules.

A hook saves its module's input, checks that the call's leading dimension splits by sample (B, or a flattened
(B·L, …) batch the first call's trace verified), makes the output a graph root when the graph does not reach it
yet, and hooks the output's gradient: during the backward the module's rule turns the saved input and the output
gradient into every sample's parameter gradient, written into the engine's blocks
(:class:`covgrad.scores.blocks.Blocks`).

Shape notation: B samples in the batch, L sequence positions, m the outer-major repeats of a flattened batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from covgrad.layout import TensorEntry
from covgrad.scores.blocks import Blocks, FoldingSlot
from covgrad.scores.rules import Call, Rule, RuleError, Slot, float_outputs


class Refusals(Protocol):
    """What the hooks do with :class:`covgrad.scores.tracing.Refusals` (typed here: tracing imports the hooks)."""

    def any_of(self, local: dict[str, TensorEntry]) -> bool: ...

    def refuse(self, local: dict[str, TensorEntry], why: str) -> None: ...


class Owner(Protocol):
    """What the hooks read and set of their :class:`covgrad.scores.engine.PerSampleGrads` (typed here, not
    imported: the engine imports this module)."""

    _blocks: Blocks  # the per-sample blocks the rules write
    _L: int  # the call's sequence length
    _names: dict[int, str]  # id of each module → its qualified name
    _flat_ok: set[int]  # modules verified to run on a flattened batch sample by sample
    _outer: set[int]  # of those, the ones with outer-major rows
    _replaying: bool  # a rule re-runs a module's forward: every hook stands aside
    _probing: bool  # the op taps check rows by autograd mid-forward: the backward hooks stand aside
    _roots: list[Tensor]  # the graph roots of the pass
    _refused: Refusals  # the parameters refused so far (named together once the pass is over)


def graph_root(t: Tensor, roots: list[Tensor]) -> Tensor:
    """A graph root standing for ``t``, a tensor the graph does not reach: a leaf that requires grad, appended to
    ``roots`` (the backward is taken with respect to it), and returned as a copy for the model to go on with.

    The copy is not a leaf, so the model may update it in place (``inputs_embeds *= √d``, ``embeddings +=
    positions``), which autograd refuses on a leaf that requires grad; a hook registered on the copy before such
    an update receives the gradient with respect to its value before it, the module's own output.
    """
    leaf = t.detach().requires_grad_()
    roots.append(leaf)
    with torch.enable_grad():  # also under no_grad (the copy must take the hook; nothing downstream records it)
        return leaf.clone()


def forward_hook(owner: Owner, B: int, rule: Rule, local: dict[str, TensorEntry]) -> Callable:
    """The forward hook (``with_kwargs``) of one module bound to ``rule`` for its parameters ``local``, in a call
    of B samples of ``owner``: save the input, make the output a graph root if needed, hook its gradient."""
    blocks = owner._blocks
    parts = getattr(rule, "row_parts", False)

    def view(name: str) -> tuple[Tensor, bool] | None:
        entry = local.get(name)
        if entry is None:
            return None
        first = entry.name not in blocks.written
        blocks.written.add(entry.name)
        if entry.is_part and not parts:
            return blocks.whole_view(entry), first
        return blocks.block(entry).view(B, *entry.shape), first

    slot = FoldingSlot(blocks, view, local)
    needs_call = getattr(rule, "needs_call", False)
    adder = getattr(rule, "row_adder", None)
    rows = B * owner._L  # a flattened (B·L, …) batch

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Tensor | tuple) -> Tensor | tuple | None:
        if owner._replaying or owner._refused.any_of(local):
            return None
        with torch._C.DisableTorchFunction():  # inside a tapped module: the taps' mode need not see this bookkeeping
            return bookkeeping(module, args, kwargs, output)

    def bookkeeping(module: nn.Module, args: tuple, kwargs: dict, output: Tensor | tuple) -> Tensor | tuple | None:
        first_in = args[0] if args else next(iter(kwargs.values()), None)
        outs = float_outputs(output)
        why = _batch_rows(owner, module, needs_call, first_in, outs, B) if _returns_tensors(output, outs) else None
        if not isinstance(why, tuple):
            owner._refused.refuse(local, why or _returns_error(owner, module, output))
            return None  # the pass goes on without this module's parameters, to find every refusal at once
        flat, n_flat = why
        outer = needs_call and flat and id(module) in owner._outer and n_flat % rows == 0
        unflat = _unflattener(owner, flat, n_flat, outer, B)
        x = unflat(first_in.detach()) if isinstance(first_in, Tensor) else first_in
        call = None
        if needs_call:  # rules that read more than the first input (generic rule, fused experts)
            detached = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, (args, kwargs))
            where = owner._names.get(id(module), type(module).__name__)
            m = n_flat // rows if outer else 0
            state = getattr(output, "covgrad_state", None)  # kept by a forward run as an autograd function
            call = Call(detached[0], detached[1], flat, n_flat // B, tuple(local), where, m, state)
        saved = Versions((x, (call.args, call.kwargs)) if call is not None else x)

        def run(g: Tensor | tuple[Tensor, ...]) -> None:
            if owner._probing or owner._refused.any_of(local):
                return
            if saved.refused(owner, module, local):
                return
            g = unflat(g) if isinstance(g, Tensor) else tuple(unflat(t) for t in g)
            if needs_call:
                blocks.run_rule(lambda: _replay(owner, rule, module, x, g, slot, call, local), local)
            else:
                adds = None if adder is None else (lambda: adder(module, x, g))
                blocks.run_rule(lambda: rule(module, x, g, slot), local, adds)

        for entry in local.values():  # contributions the backward will bring (tied or repeated modules)
            blocks.count(entry.name)
        return _hooked_output(owner, module, output, outs, run)

    return hook


def _batch_rows(
    owner: Owner,
    module: nn.Module,
    needs_call: bool,
    first_in: object,
    outs: tuple[Tensor, ...],
    B: int,
) -> tuple[bool, int | None] | str:
    """Whether the call ran on a flattened batch, and its rows (k·B for a flattened batch); or why its rows cannot
    be split by sample (they do not, or the call ran flattened in a module the first call's trace did not verify).

    A rule that reads the whole call (``needs_call``) looks at every floating output: leading dimension B, or
    k·B for a flattened batch (k = L, L·heads, …); another rule at its first input and output.

    Raises:
        ValueError: when a tensor broadcast over the batch reaches the module (default position ids).
    """
    n_in = first_in.shape[0] if isinstance(first_in, Tensor) and first_in.dim() else None
    n_out = outs[0].shape[0] if outs and outs[0].dim() else None
    if needs_call:  # per tensor: leading dimension B, or k·B for a flattened batch (k = L, L·heads, …)
        leads = [o.shape[0] if o.dim() else None for o in outs]
        multiples = [n for n in (*leads, n_in) if n is not None and n != B and n % B == 0]
        flat = bool(multiples)
        n_flat = multiples[0] if flat else B * owner._L
        ok = bool(leads) and all(n in (B, n_flat) for n in leads)
    else:
        flat = n_in is not None and n_in == n_out != B and n_in % B == 0
        ok = flat or (n_in, n_out) == (B, B)
        n_flat = n_in
    if ok and not (flat and B > 1 and id(module) not in owner._flat_ok):
        return flat, n_flat
    # refused or raised from here: the message names the module
    where = f"{owner._names.get(id(module), '?')} (a {type(module).__name__})"
    if not ok:
        if B > 1 and 1 in (n_in, n_out):
            raise ValueError(
                f"a hooked {where} ran with batch dims {(n_in, n_out)} (input, output), not {B}: a tensor "
                "broadcast over the batch (e.g. default position ids) has no per-sample gradient; pass "
                "position_ids of shape (B, L)"
            )
        return (
            f"{where} ran with leading dims {(n_in, n_out)} (input, output), neither B = {B} nor "
            f"B·L = {B * owner._L}, so its rows cannot be split by sample"
        )
    return (
        f"{where} ran on a flattened batch of {n_flat} = {B}·{n_flat // B} rows (its caller reshaped "
        "(B, L, …) to (B·L, …)) whose rows the first call's trace did not verify to be sample by sample"
    )


def _unflattener(owner: Owner, flat: bool, n_flat: int | None, outer: bool, B: int) -> Callable[[object], object]:
    """The map of a call's tensors with the flattened rows ``n_flat`` to (B, n_flat / B, …), sample n's rows in
    their order (from outer-major (m·B·L, …) rows with ``outer``); any other object unchanged."""

    def unflat(t: object) -> object:
        if flat and isinstance(t, Tensor) and t.dim() and t.shape[0] == n_flat:
            if outer:  # (m·B·L, …) outer-major → (B, m·L, …): sample n's rows, in their order
                rows = B * owner._L
                return (
                    t.reshape(n_flat // rows, B, owner._L, *t.shape[1:])
                    .transpose(0, 1)
                    .reshape(B, n_flat // B, *t.shape[1:])
                )
            return t.reshape(B, n_flat // B, *t.shape[1:])
        return t

    return unflat


def _hooked_output(
    owner: Owner, module: nn.Module, output: object, outs: tuple[Tensor, ...], run: Callable
) -> Tensor | tuple | list:
    """The module's output with ``run`` hooked on its gradient (one tensor) or on all its floating outputs' at
    once (:class:`_Tap`), made graph roots of the pass when the graph does not reach them."""
    if isinstance(output, Tensor):
        if output.grad_fn is None:  # also a leaf that requires grad (enable_input_require_grads): not in the graph
            output = graph_root(output, owner._roots)
        output.register_hook(run)
        return output
    if not any(o.grad_fn is not None for o in outs):
        outs = tuple(o.detach().requires_grad_() for o in outs)
        owner._roots.extend(outs)
    tapped = iter(_Tap.apply(run, *outs))
    return type(output)(next(tapped) if isinstance(t, Tensor) and t.is_floating_point() else t for t in output)


def _replay(
    owner: Owner,
    rule: Rule,
    module: nn.Module,
    x: Tensor,
    g: object,
    slot: Slot,
    call: Call,
    local: dict[str, TensorEntry],
) -> None:
    """Run a rule that may re-run the module's forward, with every hook standing aside meanwhile; a forward that
    cannot be differentiated per sample refuses the binding's parameters (``local``)."""
    owner._replaying = True
    try:
        rule(module, x, g, slot, call=call)
    except RuleError as exc:
        owner._refused.refuse(local, str(exc))
    finally:
        owner._replaying = False


def _returns_tensors(output: object, outs: tuple[Tensor, ...]) -> bool:
    """Whether a module's output is a tensor or a tuple or list holding floating tensors (what rules take)."""
    return isinstance(output, Tensor) or (isinstance(output, tuple | list) and bool(outs))


def _returns_error(owner: Owner, module: nn.Module, output: object) -> str:
    """Why a module whose output no rule takes is refused."""
    return (
        f"{owner._names.get(id(module), '?')} (a {type(module).__name__}) returned {type(output).__name__}, and "
        "per-sample rules need a tensor or a tuple of tensors"
    )


class Versions:
    """The version counters of the tensors a hook saved (its module's input, the call's arguments), to tell in
    the backward whether the model updated one of them in place after the call: the saved tensors share their
    storage with the model's, and a rule reading an updated one would compute another gradient."""

    def __init__(self, saved: object) -> None:
        if isinstance(saved, Tensor):  # a fast rule's one saved input: no pytree to walk
            self.tensors = [saved]
        else:
            self.tensors = [t for t in tree_flatten(saved)[0] if isinstance(t, Tensor)]
        self.versions = [t._version for t in self.tensors]

    def refused(self, owner: Owner, module: nn.Module, local: dict[str, TensorEntry]) -> bool:
        """Whether a saved tensor was updated since, which refuses the parameters ``local`` of ``module``'s rule."""
        for t, v in zip(self.tensors, self.versions, strict=True):
            if t._version != v:
                where = f"{owner._names.get(id(module), '?')} (a {type(module).__name__})"
                what = f"a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor"
                owner._refused.refuse(
                    local,
                    f"an input of {where} ({what}) was updated in place after its call, so the values its rule "
                    "reads are not the ones its forward saw",
                )
                return True
        return False


class _Tap(torch.autograd.Function):
    """Identity on a module's floating outputs whose backward hands all their gradients to one callback
    at once (missing ones as zeros), for modules that return tuples (MoE routers)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, fn: Callable, *outs: Tensor) -> tuple[Tensor, ...]:
        ctx.fn = fn
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        ctx.fn(grads)
        return (None, *grads)
