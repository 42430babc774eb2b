"""Op-level per-sample gradients of a module's small parameters, without replaying the module.

:func:`covgrad.scores.rules.generic_rule` gets a parameter's per-sample gradient by re-running its whole module per
sample. For a Gated DeltaNet's ``dt_bias``, ``A_log`` and short-conv weight that means re-running the mixer's
forward and backing through its chunked delta rule, although each parameter meets the samples' data in one
small op (``a + dt_bias``, ``-exp(A_log) * softplus(...)``, ``F.conv1d(x, w, groups=C)``).

Here, during the real (batched) forward, a :class:`torch.overrides.TorchFunctionMode` active in the module's
forward follows every torch function call of it:

- a call whose tensor inputs are only the module's selected parameters, tensors derived from them alone and
  constants (buffers, fresh tensors, Python numbers) is *derived*: it is computed on autograd leaves that stand
  for the parameters (``shadows``), so its result keeps a small graph back to them (e.g. ``-exp(A_log)``);
- a call that combines a derived tensor (or a parameter) with *data* (the module's call arguments and anything
  computed from them, or any tensor in the autograd graph: parameters are frozen during the pass) is a *use*:
  its inputs are kept, and a tensor hook on its output receives ∂objective/∂output in the backward. Then the
  per-sample vector-Jacobian product of that op alone with respect to its derived inputs (torch.func.vmap over
  the samples' rows: a data input with leading dimension B is split by sample, one with the module's verified
  flattened B·k rows as each sample's k rows, a leading dimension 1 is shared) gives each sample's cotangent of
  the derived tensors, which one batched backward through the derived graph turns into each sample's parameter
  gradient (the derived graph has no data, so its Jacobian is the same for every sample). A derived tensor
  broadcast to the batch (leading dimension B of stride 0: a parameter expanded, as GPT-OSS's attention sinks)
  is taken whole first; when the op is not separable that way, it is split by sample like a data input, and
  sample n's cotangent is its row n with zeros elsewhere;
- any other call is followed only to mark its outputs as data when an input is data; calls that provably reach no
  tapped parameter (a method of the module that reads no ``self``, a child module holding none of its tapped
  parameters: :mod:`covgrad.scores.quiet`) run outside the mode, their outputs marked the same way.

A use whose data inputs or output do not split that way along their leading dimension (RecurrentGemma's RG-LRU gates:
``torch.baddbmm(bias[:, None, :], x, weight)`` over heads, x a (heads, B·L, d) view whose second dimension holds each
sample's L rows as a contiguous block) is split along the dimension of each data input in the graph, and of the
output, whose B contiguous blocks the rows probe below finds to be the samples' (:meth:`OpTaps._located`); a (B, …)
data input that is a view of the call's arguments is probed before its leading dimension is taken, since its B rows
may be heads, as many as the samples by coincidence.

Exactness rests on checks, not on a list of classes: every use is verified to be sample-separable by running it
per sample (vmap) and comparing with the batched output (once per op position, function and input shapes);
every selected parameter of the module must reach a use in the call, the module's output must not be derived,
and every data input of a use must split by sample as above. A call that fails any of these falls back to the
module replay (:func:`covgrad.scores.rules.generic_rule`) for that call and every later one of the module. The module
itself is verified to keep samples apart as before (:func:`covgrad.scores.tracing.check_apart`).

A module whose call is not batch-leading (*crossed*: Gemma 3n's decoder layer runs on (altup inputs, B, L, H)
stacks, and its AltUp's ``correct_output_scale`` is applied by a method call inside that forward) cannot be
replayed, since the replay splits the leading dimension. The first call's trace finds the dimension of each of its
arguments that indexes the samples (:class:`Crossed`); its calls are then tapped with the rows checked per op
instead of per call: every use's output, (B, …) or (B·k, …), must have row block n depend on sample n's slices of
those arguments alone, and on them, for every n (:meth:`OpTaps._rows_apart`: 2⌈log₂ B⌉ backward passes on the
forward's graph), so a leading dimension that equals B by coincidence (k streams of one sample, rows of two samples
swapped) fails. A crossed call that fails any check refuses its module's parameters instead of falling back to the
replay.

Shape notation: B samples, k rows per sample of a flattened batch, P the parameter's elements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import SUPPORTED_NODES, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from covgrad.layout import TensorEntry
from covgrad.scores.hooks import Versions, graph_root
from covgrad.scores.opgrads import (
    _DERIVED,
    _FLAT,
    _SHARED,
    _SPLIT,
    Owner,
    _apply,
    _blocks,
    _Derived,
    _derived_values,
    _fill,
    _flatten,
    _Layout,
    _per_sample,
    _Record,
    _run,
    _split_derived,
    _unflatten,
    _Use,
)
from covgrad.scores.quiet import stand_aside
from covgrad.scores.rules import float_outputs, generic_rule

# Tensor methods that read metadata, not values (an attribute getter, ``__get__``, is handled by its result;
# covgrad.scores.tracing's use recorder adds it).
METADATA_READS = frozenset(
    {
        "size",
        "dim",
        "numel",
        "nelement",
        "stride",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "data_ptr",
        "__len__",
        "get_device",
    }
)

# Tensor methods that read only their second argument's dtype: ``x.type_as(weight)`` (Gemma 3n's AltUp) is an op
# on ``x`` alone, not a use of ``weight``.
_DTYPE_OF_SECOND = frozenset({"type_as"})

# Separability tolerance: |per-sample forward − batched forward| ≤ rtol · max|batched| + atol (kernels for one
# sample and for the batch may round differently; an op that mixes samples differs by O(1)).
_SEP_RTOL, _SEP_ATOL = 1e-5, 1e-12


def float_args(args: tuple, kwargs: dict) -> dict[str, Tensor]:
    """The floating tensors among a call's arguments, at any depth, by their path in ``(args, kwargs)``
    (``"[0][0]"``: the first positional argument; ``"[1]['mask']"``: the keyword ``mask``), in order: the names the
    first call's trace and a later call of the same forward agree on, whichever optional arguments are None."""
    leaves = tree_flatten_with_path((args, kwargs))[0]
    return {keystr(path): t for path, t in leaves if isinstance(t, Tensor) and t.is_floating_point()}


class OpTaps:
    """The op-level path of :class:`covgrad.scores.engine.PerSampleGrads` for its generic-rule bindings.

    Args:
        owner: the PerSampleGrads whose per-call state (B, the flattened-batch checks, the graph roots, the
            per-sample blocks and their folding) the taps use.
    """

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.replay: dict[int, str] = {}  # id(module) → why it falls back to the module replay
        self.untapped: set[int] = set()  # id(module) of modules with a call that could not be tapped (replayed)
        self.verified: dict[tuple, _Layout] = {}  # signature of a use shown sample-separable → how it splits
        self._mode = _Flow(self)
        self._stack: list[_Record] = []
        self._owners: dict[int, _Record] = {}  # id(parameter) → the first record of the stack that holds it
        self._data: set[int] = set()
        self._derived: dict[int, _Derived] = {}
        self._entered = False
        self._tapped: set[int] = set()  # id(module) of every module these taps hook
        self._reach: dict[int, tuple[bool, frozenset[int]]] = {}  # id(child) → (tapped inside, its parameters)

    def path(self, module: nn.Module) -> str:
        """ "op" while every call of the module took the op-level path, else "replay" (a call's rows that are not
        one sample each, e.g. experts run on rows grouped outer-major, take the replay call by call)."""
        return "replay" if id(module) in self.replay or id(module) in self.untapped else "op"

    def hooks(self, module: nn.Module, local: dict[str, TensorEntry]) -> list:
        """Register the pre- and post-forward hooks that tap one module's calls, and its quiet calls' wrappers
        (:func:`covgrad.scores.quiet.stand_aside`); returns their handles."""
        replay_hook = self.owner._forward_hook(self.owner._blocks.B, generic_rule, local)
        self._tapped.add(id(module))
        records: list[_Record | None] = []

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.owner._replaying or id(mod) in self.replay:
                records.append(None)
                return
            with torch._C.DisableTorchFunction():  # inside a tapped parent: its mode need not see this
                record = self._begin(mod, local, args, kwargs)
                records.append(record)
                if record is None:
                    self.untapped.add(id(mod))
                else:
                    self._push(record, args, kwargs)

        def post(mod: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
            with torch._C.DisableTorchFunction():
                return finish(mod, args, kwargs, output)

        def finish(mod: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
            record = records.pop() if records else None
            if self.owner._replaying:
                return None
            if record is not None:
                self._pop(record)
                if not record.reason:
                    if any(id(o) in self._derived for o in float_outputs(output)):
                        record.reason = "its output is computed from its parameters alone"
                    missing = set(local) - {n for u in record.uses for n in u.names}
                    if missing:
                        record.reason = record.reason or f"{sorted(missing)} reach no op the taps see"
                if not record.reason:
                    self._activate(record)
                    return None
                self.replay[id(mod)] = record.reason
            crossed = self.owner._crossed.get(id(mod))
            if crossed is not None:  # the replay would split its leading dimension, which is not the batch
                why = self.replay.get(id(mod), "its arguments are not the ones the first call's trace verified")
                self.owner._refused.refuse(local, crossed.refusal(f"the op-level path does not hold ({why})"))
                return None
            return replay_hook(mod, args, kwargs, output)

        return [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True),
            stand_aside(module, frozenset(id(module.get_parameter(pn)) for pn in local), self),
        ]

    def run_outside(self, fn: Callable, args: tuple, kwargs: dict, child: nn.Module | None) -> object:
        """Run a quiet call (:mod:`covgrad.scores.quiet`: a method that reads no ``self``, or the forward of a
        ``child`` module holding none of its tapped parent's parameters) with torch functions' overrides off, while
        the mode is on and no argument is a parameter, a derived tensor or a module, and (a child) no module inside
        it is tapped and none of its parameters belongs to a call of the stack; else as it is. Its output tensors
        are data when an argument was (as :meth:`on_call` marks an op's)."""
        if not self._stack:
            return fn(*args, **kwargs)
        data = False
        for t in _flatten(args, kwargs)[0]:
            if isinstance(t, nn.Module):
                return fn(*args, **kwargs)
            if isinstance(t, Tensor):
                i = id(t)
                if i in self._derived or i in self._owners:
                    return fn(*args, **kwargs)
                data = data or t.requires_grad or i in self._data
        if child is not None:
            reach = self._reach.get(id(child))
            if reach is None:  # every module's hooks are in place before a forward: the answer holds for this taps
                inside = any(id(m) in self._tapped for m in child.modules())
                reach = self._reach[id(child)] = (inside, frozenset(id(p) for p in child.parameters()))
            if reach[0] or any(i in self._owners for i in reach[1]):
                return fn(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            out = fn(*args, **kwargs)
        if data:
            _mark_data(self._data, out, deep=True)
        return out

    def reset(self) -> None:
        """Leave the mode and drop every per-forward record (end of a pass, or after an error)."""
        if self._entered:
            self._mode.__exit__(None, None, None)
            self._entered = False
        self._stack, self._owners, self._data, self._derived = [], {}, set(), {}

    def _begin(self, module: nn.Module, local: dict[str, TensorEntry], args: tuple, kwargs: dict) -> _Record | None:
        """A record for this call, or None when the call cannot be tapped (it then takes the replay, or for a crossed
        module its refusal)."""
        owner, B = self.owner, self.owner._blocks.B
        params = {id(module.get_parameter(pn)): pn for pn in local}
        crossed = owner._crossed.get(id(module))
        if crossed is not None:  # the batch is another dimension of its arguments: every use's rows are probed
            named = float_args(args, kwargs)
            refs = [(t, crossed.dims[k]) for k, t in named.items() if k in crossed.dims and t.requires_grad]
            if not refs or any(t.dim() <= d or t.shape[d] != B for t, d in refs):
                return None
            others = [t for k, t in named.items() if k not in crossed.dims and t.requires_grad]
            return _Record(module, local, B, 0, params, refs, others, crossed=True)
        first = args[0] if args else next(iter(kwargs.values()), None)
        lead = first.shape[0] if isinstance(first, Tensor) and first.dim() else None
        flat = 0
        if lead != B:
            if lead is None or lead % B or id(module) not in owner._flat_ok or id(module) in owner._outer:
                return None
            flat = lead
        refs = [(t, 0) for t in _tensors(args, kwargs) if t.dim() and t.shape[0] == B and t.requires_grad]
        return _Record(module, local, B, flat, params, refs)

    def _push(self, record: _Record, args: tuple, kwargs: dict) -> None:
        for t in _tensors(args, kwargs):  # the call's arguments are data
            self._data.add(id(t))
        if not self._entered:
            self._mode.__enter__()
            self._entered = True
        self._stack.append(record)
        self._index_owners()

    def _pop(self, record: _Record) -> None:
        self._stack.remove(record)
        if not self._stack:
            self.reset()
        else:
            self._index_owners()

    def _index_owners(self) -> None:
        """id(parameter) → the first record of the stack that holds it (what ``on_call`` looks up per op)."""
        self._owners = {}
        for rec in self._stack:
            for i in rec.params:
                self._owners.setdefault(i, rec)

    def _activate(self, record: _Record) -> None:
        """Count the call's uses as contributions of its tensors and let their backward hooks run."""
        owner = self.owner
        for use in record.uses:
            use.active = True
            for n in use.names:
                owner._blocks.count(record.local[n].name)

    # ---- the mode's three kinds of calls ----

    def on_call(self, func: Callable, args: tuple, kwargs: dict) -> object:
        """Run one torch function call of a tapped forward (see the module docstring). An attribute read that gives
        no tensor (.shape, .dtype) is answered at once; a call on no derived tensor or parameter (the common case)
        only marks its tensor outputs as data when an input is data."""
        name = getattr(func, "__name__", "")
        if name in METADATA_READS:
            return func(*args, **kwargs)
        attribute = name == "__get__"
        if attribute:  # metadata (.shape, .dtype: no tensor, in no container) unless it returns a tensor (.T, .mT)
            out = func(*args, **kwargs)
            if not isinstance(out, Tensor):
                return out
        record_of: dict[int, _Record] | None = None  # the parameters among the inputs, by id (rare: built then)
        derived = data = False
        known, owners, data_ids = self._derived, self._owners, self._data
        for t in _tensors(args[:1], {}) if name in _DTYPE_OF_SECOND else _tensors(args, kwargs):
            i = id(t)
            if i in known:
                derived = True
            elif (rec := owners.get(i)) is not None:
                if record_of is None:
                    record_of = {}
                record_of[i] = rec
                derived = True
            elif not data and (t.requires_grad or i in data_ids):
                data = True
        if not derived:
            if not attribute:
                out = func(*args, **kwargs)
            if data:
                _mark_data(data_ids, out)
            return out
        if not data:
            return self._derive(func, args, kwargs, record_of or {})
        return self._use(func, args, kwargs, record_of or {})

    def _shadow(self, rec: _Record, t: Tensor) -> _Derived:
        pn = rec.params[id(t)]
        if pn not in rec.shadows:
            rec.shadows[pn] = t.detach().requires_grad_()
        return _Derived(t, rec.shadows[pn], frozenset({pn}), rec)

    def _derived_of(self, leaves: list, record_of: dict[int, _Record]) -> list[_Derived | None]:
        """Per leaf of a call, its derived tensor (a parameter's on its shadow, made the first time), or None."""
        known, of = self._derived, []
        for t in leaves:
            d = None
            if isinstance(t, Tensor):
                i = id(t)
                d = known.get(i)
                if d is None and i in record_of:
                    d = self._shadow(record_of[i], t)
            of.append(d)
        return of

    def _keep(self, shadow: Tensor, names: frozenset[str], record: _Record) -> Tensor:
        """The value (detached) of a tensor computed on the shadows, recorded as derived."""
        real = shadow.detach()
        self._derived[id(real)] = _Derived(real, shadow, names, record)
        return real

    def _derive(self, func: Callable, args: tuple, kwargs: dict, record_of: dict[int, _Record]) -> object:
        """A call on parameters, derived tensors and constants: computed on the shadows, its value detached."""
        leaves, spec = _flatten(args, kwargs)
        of = self._derived_of(leaves, record_of)
        found = [d for d in of if d is not None]
        record = found[0].record
        if any(d.record is not record for d in found):  # parameters of two nested tapped calls: both take the replay
            for rec in {id(d.record): d.record for d in found}.values():
                rec.reason = rec.reason or f"{_name(func)} combines parameters of two tapped modules"
            return func(*args, **kwargs)
        names = frozenset(n for d in found for n in d.names)
        a, k = _unflatten([t if d is None else d.shadow for t, d in zip(leaves, of, strict=True)], spec)
        with torch.enable_grad():
            shadow_out = func(*a, **k)
        if isinstance(shadow_out, Tensor) and type(shadow_out) not in SUPPORTED_NODES:  # one tensor: no pytree
            return self._keep(shadow_out, names, record)
        outs, out_spec = tree_flatten(shadow_out)
        return tree_unflatten([self._keep(o, names, record) if isinstance(o, Tensor) else o for o in outs], out_spec)

    def _use(self, func: Callable, args: tuple, kwargs: dict, record_of: dict[int, _Record]) -> object:
        """A call that combines derived tensors with data: run it, keep its inputs, hook its output.

        The use's signature (module, position in the call, function, its leaves' modes, shapes and dtypes) is
        verified once (:meth:`_layout`); a later call of a verified signature takes its layout as it is.
        """
        leaves, spec = _flatten(args, kwargs)
        of = self._derived_of(leaves, record_of)
        derived = [d for d in of if d is not None]
        record = derived[0].record
        data_ids = self._data
        modes, kept, data = [], [], []  # data: per leaf, the data input itself (None: derived, constant)
        for t, d in zip(leaves, of, strict=True):
            if d is not None:
                modes.append(_DERIVED)
                kept.append(t)
                data.append(None)
            elif isinstance(t, Tensor) and (t.requires_grad or id(t) in data_ids):
                modes.append(self._split_mode(record, t))
                kept.append(t.detach())
                data.append(t)
            else:
                modes.append(_SHARED)
                kept.append(t)
                data.append(None)
        sig = (id(record.module), len(record.uses), _name(func), tuple(modes), _shapes(leaves))
        layout = self.verified.get(sig)
        # not verified yet: the data inputs computed inside the forward, probed then (read before the op runs)
        inner = _inner(record, data, modes) if layout is None else []
        out = func(*args, **kwargs)
        _mark_data(data_ids, out)
        if any(d.record is not record for d in derived):
            for rec in {id(d.record): d.record for d in derived}.values():
                rec.reason = rec.reason or f"{_name(func)} combines parameters of two tapped modules"
            return out
        if record.reason or not isinstance(out, Tensor) or not out.is_floating_point():
            return out  # a failed record takes the replay; a non-float output carries no gradient
        if not torch.is_grad_enabled():  # inside an autograd.Function's forward or no_grad: no hook would fire
            record.reason = f"{_name(func)} runs where autograd does not record it"
            return out
        names = frozenset(n for d in derived for n in d.names)
        saved = [t for t, m in zip(kept, modes, strict=True) if m != _DERIVED and isinstance(t, Tensor)]
        versions = Versions(saved[0] if len(saved) == 1 else saved)  # one tensor: no pytree to walk
        if layout is None:
            layout, why = self._layout(
                record, _Use(func, spec, kept, modes, derived, names, saved=versions), out, inner, data
            )
            if layout is None:
                record.reason = f"{_name(func)} {why}"
                return out
            self.verified[sig] = layout
        modes = list(layout.modes)
        use = _Use(func, spec, kept, modes, derived, names, layout.dims, layout.out_dim, saved=versions, layout=layout)
        record.uses.append(use)
        if out.grad_fn is None:  # no data input is in the graph (or a leaf made to require grad): it starts it
            out = graph_root(out, self.owner._roots)
            data_ids.add(id(out))
        out.register_hook(self._backward(record, use))
        return out

    def _layout(
        self, record: _Record, use: _Use, out: Tensor, inner: list[tuple[Tensor, str]], data: list[Tensor | None]
    ) -> tuple[_Layout | None, str]:
        """How a use seen for the first time splits by sample, or None and why it does not.

        First along the leading dimension of its data inputs (``use.modes``) and output: every data input computed
        inside the forward (``inner``, with what its rows are) probed back to the samples (:meth:`_rows_apart`), a
        crossed call's output probed too, and the op run per sample (:meth:`_separable`), whole derived tensors
        broadcast to the batch then split (:func:`_split_derived`). Failing that, along the dimension of each data
        input in the graph (``data``: per leaf, the data input, None for the others) and of the output whose
        contiguous blocks the probe finds to be the samples' (:meth:`_sample_dim`: the (heads, B·L, d) operand of a
        batched matmul over heads), the op run per sample on those blocks.
        """
        B = record.B
        why = ""
        if any(m is None for m in use.modes):
            why = "has a data input that does not split by sample"
        elif self._split_mode(record, out) not in (_SPLIT, _FLAT):
            why = "gives an output that does not split by sample"
        why = why or next((w for t, what in inner if (w := self._rows_apart(record, t, what))), "")
        if record.crossed and not why:
            why = self._rows_apart(record, out, "gives rows")
        if not why:
            if not (why := self._separable(use, out, B)):
                return _Layout(use.modes), ""
            split = _split_derived(record, use.leaves, use.modes)
            if split != use.modes and not self._separable(replace(use, modes=split), out, B):
                return _Layout(split), ""
        located = self._located(record, use, out, data)
        return (located, "") if located is not None else (None, why)

    def _located(self, record: _Record, use: _Use, out: Tensor, data: list[Tensor | None]) -> _Layout | None:
        """The use's layout with each data input in the graph, and the output, split along the dimension the rows
        probe finds to be the samples' (data inputs outside the graph keep their leading layout); None when one
        has no such dimension or the op run per sample on those blocks does not give the output's."""
        modes, dims = list(use.modes), [0] * len(use.modes)
        for i, t in enumerate(data):
            if t is not None and t.requires_grad:
                d = self._sample_dim(record, t)
                if d is None:
                    return None
                modes[i], dims[i] = _SPLIT if t.shape[d] == record.B else _FLAT, d
        if any(m is None for m in modes):
            return None
        out_dim = self._sample_dim(record, out)
        if out_dim is None:
            return None
        layout = _Layout(modes, tuple(dims), out_dim)
        if self._separable(replace(use, modes=modes, dims=layout.dims, out_dim=out_dim), out, record.B):
            return None
        return layout

    def _sample_dim(self, record: _Record, t: Tensor) -> int | None:
        """The first dimension of ``t`` whose B contiguous blocks are the samples' rows by the rows probe
        (:meth:`_rows_apart`), or None."""
        for d in range(t.dim()):
            if t.shape[d] and t.shape[d] % record.B == 0 and not self._rows_apart(record, t, "has rows", d):
                return d
        return None

    def _split_mode(self, record: _Record, t: Tensor) -> int | None:
        lead = t.shape[0] if t.dim() else None
        if lead == record.B:
            return _SPLIT
        if lead is None or lead == 1:
            return _SHARED
        if lead % record.B == 0:  # (B·k, …): the module's verified flattened rows, or checked (_rows_apart)
            return _FLAT
        return None

    def _rows_apart(self, record: _Record, t: Tensor, what: str, dim: int = 0) -> str:
        """ "" when row block n of ``t`` along ``dim``, (…, B, …) or flattened (…, B·k, …) sample-major, depends on
        sample n's slices of the call's references (``record.refs``) alone, and on them, for every n; else why not,
        ``what`` (the rows, e.g. "has flattened (B·k, …) rows") its subject. A crossed call's other arguments in the
        graph (``record.others``) must not reach it at all.

        By autograd on the forward's graph, 2⌈log₂ B⌉ backward passes for all the samples: per bit of the sample
        index, a random projection of the rows of the samples with that bit set, and one of those without it, must
        give a zero gradient on the references' slices of the samples outside the probed set (a row that depends on
        another sample's slice differs from it in some bit, and is probed without it there); every sample's slice
        must get a nonzero gradient from the probes that hold its rows.
        """
        B = record.B
        if B == 1:
            return ""
        untraced = f"{what} that cannot be traced to the samples"
        if not t.requires_grad or not record.refs:
            return untraced
        rows = _blocks(t, dim, B).reshape(B, -1)
        weights = torch.randn(rows.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        projected = rows.double() * weights.to(t.device)
        leaves = [r for r, _ in record.refs] + record.others
        bits = (torch.arange(B)[:, None] >> torch.arange((B - 1).bit_length())) & 1 == 1  # (B, bits)
        own = torch.zeros(B, dtype=torch.bool)
        for probed in (p for bit in bits.T for p in (bit, ~bit)):
            self.owner._probing = True  # the hooks on the way stand aside
            try:
                grads = torch.autograd.grad(
                    projected[probed.to(t.device)].sum(), leaves, retain_graph=True, allow_unused=True
                )
            finally:
                self.owner._probing = False
            for k, gr in enumerate(grads):
                if gr is None:
                    continue
                hit = gr.nan_to_num(0.0, 0.0, 0.0) != 0
                if k >= len(record.refs):
                    if bool(hit.any()):
                        return untraced
                    continue
                reached = hit.movedim(record.refs[k][1], 0).reshape(B, -1).any(1).cpu()  # (B,) samples reached
                if bool((reached & ~probed).any()):
                    return f"{what} that are not sample by sample"
                own |= reached
        return "" if bool(own.all()) else untraced

    def _separable(self, use: _Use, out: Tensor, B: int) -> str:
        """ "" when the op run per sample (vmap) gives the batched output's rows, else why not."""
        shared, rows = _derived_values(use)
        try:
            per = torch.func.vmap(lambda mine, own: _run(use, _fill(use, shared, own), mine, B))(
                _per_sample(use, B), rows
            )
        except Exception as exc:
            return f"cannot be run per sample ({type(exc).__name__})"
        if per.numel() != out.numel():
            return "gives per-sample outputs of another size than the batch's"
        ref = out.detach()
        diff = (per.movedim(0, use.out_dim).reshape(ref.shape).to(torch.float64) - ref.to(torch.float64)).abs().max()
        scale = ref.abs().max().to(torch.float64) if ref.numel() else torch.tensor(0.0)
        if bool(diff > _SEP_RTOL * scale + _SEP_ATOL):
            return "mixes samples (its per-sample outputs differ from the batched one)"
        return ""

    def _backward(self, record: _Record, use: _Use) -> Callable[[Tensor], None]:
        owner = self.owner
        local = {n: record.local[n] for n in use.names}

        def hook(g: Tensor) -> None:
            # not for a probe of _rows_apart (mid-forward, no blocks yet)
            if not use.active or owner._probing or owner._refused.any_of(local):
                return
            if not use.saved.refused(owner, record.module, local):
                owner._blocks.run_rule(lambda: _apply(owner, record, use, g), local)

        return hook


class _Flow(TorchFunctionMode):
    """The mode of :class:`OpTaps` (entered while a tapped module's forward runs)."""

    def __init__(self, taps: OpTaps) -> None:
        super().__init__()
        self.taps = taps

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        return self.taps.on_call(func, args, kwargs or {})


_SEQUENCES = (list, tuple)  # (a tuple of types: isinstance is faster with it than with the union list | tuple)


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among a call's arguments, one level into lists, tuples and dicts, in order."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, _SEQUENCES):  # (loops, not comprehensions: no frame per container)
            for b in a:
                if isinstance(b, Tensor):
                    found.append(b)
        elif isinstance(a, dict):
            for b in a.values():
                if isinstance(b, Tensor):
                    found.append(b)
    return found


def _mark_data(data: set[int], out: object, deep: bool = False) -> None:
    """Add the ids of a call's output tensors to ``data``: the output itself, or the tensors it holds one level deep
    (an op's tuple), at any depth with ``deep`` (a quiet call's: a module's nested outputs); None (an in-place
    setter's) holds none."""
    if isinstance(out, Tensor):
        data.add(id(out))
    elif out is not None:
        data.update(id(t) for t in (tree_flatten(out)[0] if deep else _tensors((out,), {})) if isinstance(t, Tensor))


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _shapes(leaves: list) -> tuple:
    """Each leaf's shape and dtype, or its type's name (for a use's signature)."""
    return tuple((t.shape, t.dtype) if isinstance(t, Tensor) else type(t).__name__ for t in leaves)


def _inner(record: _Record, data: list[Tensor | None], modes: list[int | None]) -> list[tuple[Tensor, str]]:
    """The data inputs of a use (``data``: per leaf, the data input, None for the others) whose rows are probed
    back to the samples before they are taken for them (:meth:`OpTaps._layout`), with what their rows are: a
    (B·k, …) one flattened inside the forward, a (B, …) one that is a view of the call's arguments
    (:func:`_probed_split`)."""
    args_of_call = {id(r) for r, _ in record.refs}
    bases = {id(_base(r)) for r, _ in record.refs}
    inner = []
    for t, m in zip(data, modes, strict=True):
        if t is None:
            continue
        if m == _FLAT and t.shape[0] != record.flat:
            inner.append((t, "has flattened (B·k, …) rows"))
        elif m == _SPLIT and _probed_split(record, t, args_of_call, bases):
            inner.append((t, "has (B, …) rows"))  # B rows may be heads
    return inner


def _base(t: Tensor) -> Tensor:
    """The tensor whose storage ``t`` views (``t`` itself when it is not a view)."""
    return t if t._base is None else t._base


def _probed_split(record: _Record, t: Tensor, args_of_call: set[int], bases: set[int]) -> bool:
    """Whether a (B, …) data input ``t`` of a use is probed back to the samples (:meth:`OpTaps._rows_apart`) before
    its leading dimension is taken for them: a view, made inside a batch-leading forward, of the call's arguments
    (``bases``: the ids of the tensors they view), whose B rows may be heads, as many as the samples by coincidence
    (a permuted (heads, B·L, d) view with heads = B). The probe's backward passes run through views alone; a
    (B, …) tensor computed by the forward's ops is taken as the samples' rows unprobed, since probing it would back
    through the module's matmuls for every new shape."""
    return (
        not record.crossed
        and not record.flat
        and t.requires_grad
        and id(t) not in args_of_call
        and id(_base(t)) in bases
    )
