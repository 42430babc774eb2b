"""The per-sample side of the op-level taps (:mod:`covgrad.scores.optaps`): how a verified use's leaves split by
sample (their modes), the use run for one sample at a time, and the per-sample gradients of its parameters from
its output gradient, into their blocks.

Leaf modes: ``_SPLIT`` (B, …) rows, ``_FLAT`` flattened (B·k, …) rows, sample-major, ``_SHARED`` a constant or a
data input outside the graph, ``_DERIVED`` a tensor derived from the module's parameters alone, taken whole,
``_DSPLIT`` a derived tensor broadcast to the batch, split by sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import SUPPORTED_NODES, TreeSpec, tree_flatten, tree_unflatten

from covgrad.layout import TensorEntry
from covgrad.scores.blocks import Blocks
from covgrad.scores.hooks import Versions
from covgrad.scores.rules import conv1d_weight_grads

_SPLIT, _FLAT, _SHARED, _DERIVED, _DSPLIT = 1, 2, 0, 3, 4
_DERIVED_MODES = (_DERIVED, _DSPLIT)

# Elements of the per-sample cotangents of one split derived tensor, (samples, B, …), built at a time.
_DSPLIT_CHUNK = 1 << 24


class Owner(Protocol):
    """What the taps read of their :class:`covgrad.scores.engine.PerSampleGrads` (typed here, not imported: the
    engine imports this module)."""

    _blocks: Blocks
    _crossed: dict[int, Crossed]
    _flat_ok: Any
    _outer: Any
    _probing: bool
    _replaying: bool
    _roots: Any
    _names: dict[int, str]
    _refused: Any

    def _forward_hook(self, B: int, rule: Callable[..., None], local: Any) -> Callable[..., Any]: ...


@dataclass(frozen=True)
class Crossed:
    """A module whose calls are not batch-leading, as the first call's trace verified it
    (:func:`covgrad.scores.tracing.check_apart`).

    Attributes:
        dims: the path (:func:`float_args`) of each floating argument of its call whose slices along one dimension
            are the samples (each depends on its own sample's input embeddings and on no other's) → that dimension;
            its first input's is among them.
        why: where it is and how its call is laid out, for its refusal (:meth:`refusal`).
    """

    dims: dict[str, int]
    why: str

    def refusal(self, reason: str) -> str:
        """Why its parameters are refused when the op-level path does not take them (``reason``)."""
        return (
            f"{self.why}: the module replay cannot split its call by sample and {reason}, so no per-sample gradient "
            "exists"
        )


@dataclass
class _Derived:
    """A tensor computed from the call's parameters alone: its value (what the model sees) and the same
    value on the parameters' shadows (with a graph), and which parameters (local names) it depends on."""

    real: Tensor
    shadow: Tensor
    names: frozenset[str]
    record: _Record


@dataclass
class _Layout:
    """How a verified use splits by sample: its leaves' modes, their sample dimensions (``()``: every leaf's leading
    one) and its output's; and the closed form that took the last call of its signature (None: none yet), which
    :func:`_closed_cots` tries first."""

    modes: list[int]
    dims: tuple[int, ...] = ()
    out_dim: int = 0
    form: Callable[[_Use, Tensor, int], Cots | None] | None = None


@dataclass
class _Use:
    """One op that combines derived tensors with data, with what its per-sample vjp needs in the backward."""

    func: Callable
    spec: Any
    leaves: list
    modes: list[int]  # per leaf: _SPLIT, _FLAT, _SHARED, _DERIVED or _DSPLIT (derived, split by sample)
    derived: list[_Derived]  # in the order of the _DERIVED and _DSPLIT leaves
    names: frozenset[str]
    # per leaf, the dimension whose contiguous blocks are the samples' rows ((): the leading one for every leaf)
    dims: tuple[int, ...] = ()
    out_dim: int = 0  # the output's such dimension
    active: bool = False
    # the kept data inputs' versions: one updated in place after the op refuses the use's parameters
    saved: Versions = field(default_factory=lambda: Versions(()))
    layout: _Layout | None = None  # its verified signature's (None: a use on trial, not verified yet)


@dataclass
class _Record:
    """One call of a tapped module: its parameters, shadows, derived tensors and uses."""

    module: nn.Module
    local: dict[str, TensorEntry]
    B: int
    flat: int  # the call's flattened rows B·k (0: leading dimension B)
    params: dict[int, str]  # id(parameter) → local name
    # the call's tensor arguments in the graph whose slices along a dimension are the samples, with that dimension
    # (its (B, …) ones; a crossed call's verified ones): the references of the rows probes (_rows_apart)
    refs: list[tuple[Tensor, int]] = field(default_factory=list)
    others: list[Tensor] = field(default_factory=list)  # a crossed call's other arguments in the graph
    crossed: bool = False  # not batch-leading (Crossed): every use's output rows are probed
    shadows: dict[str, Tensor] = field(default_factory=dict)
    uses: list[_Use] = field(default_factory=list)
    reason: str = ""  # why the op-level capture does not hold for this call ("" while it does)


def _blocks(t: Tensor, dim: int, B: int) -> Tensor:
    """``t`` with its dimension ``dim`` of B·k rows, sample-major, split into B blocks of k, the samples first:
    (B, …, k, …)."""
    return t.unflatten(dim, (B, -1)).movedim(dim, 0)


# The specs :func:`_flatten` built, by the structure of the calls they are for: the number of positional arguments,
# the keywords, and per argument None (a leaf) or the type and length of a list or tuple of leaves.
_SPECS: dict[tuple, TreeSpec] = {}
# id(spec) → that structure (the specs live in _SPECS, so their ids stay theirs), for :func:`_unflatten`.
_STRUCTURES: dict[int, tuple[int, tuple, tuple | None]] = {}


def _flatten(args: tuple, kwargs: dict) -> tuple[list, TreeSpec]:
    """``tree_flatten((args, kwargs))`` of a torch function call: its leaves and spec. A call whose arguments are
    leaves, or lists and tuples of leaves (the common case), is flattened one level by hand and gets the one spec
    of its structure, built by ``tree_flatten`` the first time (:func:`_unflatten` rebuilds such calls without
    walking it); any other call is flattened by ``tree_flatten``."""
    leaves: list = []
    shape: list[tuple[type, int] | None] = []
    for v in (*args, *kwargs.values()) if kwargs else args:
        kind = type(v)
        if kind is list or kind is tuple:
            if not all(type(x) not in SUPPORTED_NODES and not isinstance(x, tuple) for x in v):
                return tree_flatten((args, kwargs))
            leaves += v
            shape.append((kind, len(v)))
        elif kind in SUPPORTED_NODES or isinstance(v, tuple):  # a dict, a namedtuple, torch.Size, …
            return tree_flatten((args, kwargs))
        else:
            leaves.append(v)
            shape.append(None)
    structure = (len(args), tuple(kwargs), tuple(shape))
    spec = _SPECS.get(structure)
    if spec is None:
        spec = _SPECS[structure] = tree_flatten((args, kwargs))[1]
        flat = all(s is None for s in shape)
        _STRUCTURES[id(spec)] = (len(args), tuple(kwargs), None if flat else tuple(shape))
    return leaves, spec


def _unflatten(leaves: list, spec: TreeSpec) -> tuple[tuple, dict]:
    """``tree_unflatten(leaves, spec)`` of a call's ``(args, kwargs)``, by hand for a spec of :func:`_flatten`'s."""
    structure = _STRUCTURES.get(id(spec))
    if structure is None:
        return tree_unflatten(leaves, spec)
    n, keys, shape = structure
    if shape is None:  # every argument a leaf
        return tuple(leaves[:n]), dict(zip(keys, leaves[n:], strict=True))
    values, at = [], 0
    for s in shape:
        if s is None:
            values.append(leaves[at])
            at += 1
        else:
            values.append(s[0](leaves[at : at + s[1]]))
            at += s[1]
    return tuple(values[:n]), dict(zip(keys, values[n:], strict=True))


def _per_sample(use: _Use, B: int) -> list[Tensor]:
    """The use's split data inputs as (B, …) tensors of each sample's rows (its block along the leaf's sample
    dimension, of the leaf's rank)."""
    dims = use.dims or (0,) * len(use.leaves)
    pairs = zip(use.leaves, use.modes, dims, strict=True)
    return [_blocks(t, d, B) for t, m, d in pairs if m in (_SPLIT, _FLAT)]


def _split_derived(record: _Record, kept: list, modes: list[int]) -> list[int]:
    """``modes`` with every derived leaf that is broadcast to the batch (leading dimension B of stride 0, as
    ``expand`` gives) split by sample. A derived tensor whose leading dimension is B by coincidence (RecurrentGemma's
    per-head gate weights with as many heads as samples) keeps its rows distinct, so it is not split."""
    if record.B < 2 or record.flat:
        return modes
    return [
        _DSPLIT if m == _DERIVED and t.dim() and t.shape[0] == record.B and t.stride(0) == 0 else m
        for t, m in zip(kept, modes, strict=True)
    ]


def _derived_modes(use: _Use) -> list[int]:
    """The modes of the use's derived leaves, in the order of ``use.derived``."""
    return [m for m in use.modes if m in _DERIVED_MODES]


def _derived_values(use: _Use) -> tuple[list[Tensor], list[Tensor]]:
    """The derived values taken whole, and those split by sample ((B, …) each, vmapped over)."""
    pairs = list(zip(use.derived, _derived_modes(use), strict=True))
    return [d.real for d, m in pairs if m == _DERIVED], [d.real for d, m in pairs if m == _DSPLIT]


def _fill(use: _Use, shared: list[Tensor], own: list[Tensor]) -> list[Tensor]:
    """One sample's derived values in ``use.derived``'s order: the whole ones, and the sample's row (1, …) of each
    split one."""
    whole, rows = iter(shared), iter(own)
    return [next(rows).unsqueeze(0) if m == _DSPLIT else next(whole) for m in _derived_modes(use)]


def _run(use: _Use, dvals: list[Tensor], mine: list[Tensor], B: int) -> Tensor:
    """The use's op on one sample: its rows of the split inputs, the derived values ``dvals`` (:func:`_fill`), the
    shared rest."""
    own, dv = iter(mine), iter(dvals)
    filled = []
    for t, m in zip(use.leaves, use.modes, strict=True):
        if m in (_SPLIT, _FLAT):
            filled.append(next(own))
        elif m in _DERIVED_MODES:
            filled.append(next(dv))
        else:
            filled.append(t)
    a, k = _unflatten(filled, use.spec)
    return use.func(*a, **k)


def _apply(owner: Owner, record: _Record, use: _Use, g: Tensor) -> None:
    """Per-sample gradients of the use's parameters from its output gradient ``g``, into their blocks."""
    B = record.B
    cots = _closed_cots(use, g, B)
    if cots is None:
        cots = _vmapped_cots(use, g, B)
    grads: dict[str, Tensor] = {}
    for d, mode, cot in zip(use.derived, _derived_modes(use), cots, strict=True):
        names = sorted(d.names)
        leaves = [record.shadows[n] for n in names]
        if mode == _DSPLIT:  # sample n's cotangent (1, …) is row n of the derived tensor's
            parts = _row_grads(d.shadow, leaves, cot)
        elif len(leaves) == 1 and d.shadow is leaves[0]:
            parts = [cot]
        elif len(leaves) == 1 and _reshaped(d.shadow, leaves[0]):  # its gradient is the cotangent reshaped
            parts = [cot.reshape(len(cot), *leaves[0].shape).to(leaves[0].dtype)]
        else:
            parts = _batched_grad(d.shadow, leaves, cot)
        for n, part in zip(names, parts, strict=True):
            if part is not None:
                grads[n] = grads[n] + part if n in grads else part
    for n, grad in grads.items():
        s = owner._blocks.tap_view(record.local[n])
        if s[1]:
            s[0].copy_(grad.reshape(s[0].shape))
        else:
            s[0].add_(grad.reshape(s[0].shape).to(s[0].dtype))


def _vmapped_cots(use: _Use, g: Tensor, B: int) -> list[Tensor]:
    """The per-sample cotangents of the use's derived tensors by ``torch.func.vmap`` over the samples of the op's
    own vjp, run on each sample's rows (any op the closed forms do not take)."""
    shared, rows = _derived_values(use)

    def one(own: list[Tensor], mine: list[Tensor], cot: Tensor) -> list[Tensor]:
        out, vjp = torch.func.vjp(lambda d: _run(use, d, mine, B), _fill(use, shared, own))
        return vjp(cot.reshape(out.shape))[0]

    with torch.enable_grad():
        return torch.func.vmap(one)(rows, _per_sample(use, B), _blocks(g, use.out_dim, B))


# Elementwise ops whose vjp with respect to one operand has a closed form: g (add) or g ⊙ other (mul).
_ADD = frozenset({"add", "__add__", "__radd__"})
_MUL = frozenset({"mul", "__mul__", "__rmul__"})

# Cotangents by the derived tensor (id of its value) they belong to: what each closed form below returns.
Cots = dict[int, Tensor]


def _closed_cots(use: _Use, g: Tensor, B: int) -> list[Tensor] | None:
    """The per-sample cotangents of the use's derived tensors in ``use.derived``'s order from the closed form that
    takes the use (:data:`_CLOSED_FORMS`: at most one does), each (B, *d.shape) ((B, 1, …) for one split by
    sample); None when none does (the vmapped vjp). The form that took the last call of the use's signature is
    tried first."""
    ids = [id(d.real) for d in use.derived]
    if len(set(ids)) != len(ids):  # one tensor twice: its cotangents would have to be summed
        return None
    layout = use.layout
    last = None if layout is None else layout.form
    cots = None if last is None else last(use, g, B)
    if cots is None:
        for form in _CLOSED_FORMS:
            if form is not last and (cots := form(use, g, B)) is not None:
                if layout is not None:
                    layout.form = form
                break
        else:
            return None
    return [cots[i] for i in ids] if set(cots) == set(ids) else None


def _elementwise_cots(use: _Use, g: Tensor, B: int) -> Cots | None:
    """The per-sample cotangent (B, *d.shape) of the derived operand of ``data + d`` or ``data * d`` (either
    order, broadcasting), summed over the dimensions it was broadcast along; the samples along any dimension of
    the data and the output (``use.dims``, ``use.out_dim``: RecurrentGemma's (heads, B·L, d) view)."""
    name = getattr(use.func, "__name__", "")
    if (name not in _ADD and name not in _MUL) or len(use.leaves) != 2 or use.spec.child(1).num_leaves:
        return None
    found = [i for i, m in enumerate(use.modes) if m == _DERIVED]
    if len(found) != 1 or use.modes[1 - found[0]] not in (_SPLIT, _FLAT):
        return None
    i_d = found[0]
    d, data = use.derived[0].real, use.leaves[1 - i_d]
    dims = use.dims or (0, 0)
    prod = _blocks(g, use.out_dim, B)  # (B, *one sample's output shape)
    if name in _MUL:
        own = _blocks(data, dims[1 - i_d], B)
        if own.dim() != prod.dim():
            return None
        prod = prod * own
    return _reduced(prod, d)


def _reduced(prod: Tensor, d: Tensor) -> Cots | None:
    """``prod`` (B, …) summed to (B, *d.shape) over the dimensions ``d`` was broadcast along (right-aligned)."""
    if d.dim() > prod.dim() - 1:
        return None
    lead = prod.dim() - 1 - d.dim()
    if lead:
        prod = prod.sum(tuple(range(1, lead + 1)))
    dims = tuple(1 + i for i, n in enumerate(d.shape) if n == 1 and prod.shape[1 + i] != 1)
    if dims:
        prod = prod.sum(dims, keepdim=True)
    if prod.shape[1:] != d.shape:
        return None
    return {id(d): prod.to(d.dtype)}


def _baddbmm_cots(use: _Use, g: Tensor, B: int) -> Cots | None:
    """The per-sample cotangents of ``torch.baddbmm(bias, x, W)`` with a derived bias and W (h, i, o) and x
    (h, B·k, i) whose second dimension holds the samples' row blocks (RecurrentGemma's gates over heads):
    Σ over each sample's rows of x_rᵀ g_r per head, and of g_r (summed to the bias's shape)."""
    if getattr(use.func, "__name__", "") != "baddbmm" or use.spec.child(1).num_leaves or len(use.leaves) != 3:
        return None
    if use.modes != [_DERIVED, _FLAT, _DERIVED] or use.dims[1:2] != (1,) or use.out_dim != 1:
        return None
    bias, x, w = use.leaves
    if len(use.derived) != 2 or w.dim() != 3 or x.dim() != 3 or g.dim() != 3:
        return None
    xs, gs = _blocks(x, 1, B), _blocks(g, 1, B)  # (B, h, k, i), (B, h, k, o)
    cots = _reduced(gs, bias)
    if cots is None:
        return None
    cots[id(w)] = torch.einsum("bhki,bhko->bhio", xs.to(g.dtype), gs).to(w.dtype)
    return cots


def _linear_cots(use: _Use, g: Tensor, B: int) -> Cots | None:
    """The per-sample cotangents of the weight (B, O, I) and bias (B, O) of ``F.linear(x, W, b)`` with x split
    by sample (a router's logits): Σ_t g_t x_tᵀ and Σ_t g_t over each sample's rows, by one batched matmul."""
    call = _closed_call(use, "linear")
    if call is None:
        return None
    x, w, b = call["input"], call["weight"], call.get("bias")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or g.shape[-1] != w.shape[0]:
        return None
    cots = {id(w): _row_products(g, x.to(g.dtype), B).to(w.dtype)}
    if b is not None:
        cots[id(b)] = g.reshape(B, -1, w.shape[0]).sum(1).to(b.dtype)
    return cots


def _row_products(left: Tensor, right: Tensor, B: int) -> Tensor:
    """Σ over each sample's rows of left_tᵀ right_t, by one batched matmul: left (…, p) and right (…, q), both with
    the samples' rows in B equal leading blocks → (B, p, q)."""
    return torch.bmm(left.reshape(B, -1, left.shape[-1]).transpose(1, 2), right.reshape(B, -1, right.shape[-1]))


def _embedding_cots(use: _Use, g: Tensor, B: int) -> Cots | None:
    """The per-sample cotangent (B, V, H) of the table of ``F.embedding(ids, W, padding_idx)`` (no max_norm, no
    scaling by frequency) with ids split by sample (OPT's learned positions): row y of sample n's is Σ of g_t
    over its positions t with id y (none at ``padding_idx``), by one ``index_add_``."""
    call = _closed_call(use, "embedding")
    if call is None:
        return None
    ids, w, pad = call["input"], call["weight"], call.get("padding_idx")
    if ids.is_floating_point() or w.dim() != 2 or call.get("max_norm") is not None:
        return None
    if call.get("scale_grad_by_freq", False) or not (pad is None or isinstance(pad, int)):
        return None
    V, H = w.shape
    rows = ids.reshape(B, -1)
    gs = g.reshape(B, -1, H)
    if pad is not None:
        gs = gs.masked_fill((rows == pad % V)[..., None], 0.0)
    at = (rows + V * torch.arange(B, device=rows.device)[:, None]).reshape(-1)
    cot = gs.new_zeros(B * V, H).index_add_(0, at, gs.reshape(-1, H))
    return {id(w): cot.view(B, V, H).to(w.dtype)}


def _conv1d_cots(use: _Use, g: Tensor, B: int) -> Cots | None:
    """The per-sample cotangents of the weight (B, C, 1, K) and bias (B, C) of a depthwise ``F.conv1d`` (groups =
    channels, stride and dilation 1, zero padding p) on x (B·s, C, L) whose rows are split by sample (s = 1: the
    short convolutions of state-space and hybrid layers over positions): Σ_t g_{c,t} x_{c,t+k} over the padded
    input (:func:`covgrad.scores.rules.conv1d_weight_grads`), and Σ_t g_{c,t}, summed over each sample's rows."""
    call = _closed_call(use, "conv1d")
    if call is None:
        return None
    x, w, b = call["input"], call["weight"], call.get("bias")
    one = (1, (1,), [1])
    if x.dim() != 3 or call.get("stride", 1) not in one or call.get("dilation", 1) not in one:
        return None
    C, pad = x.shape[1], call.get("padding", 0)
    pad = pad[0] if isinstance(pad, tuple | list) and len(pad) == 1 else pad
    if call.get("groups", 1) != C or not isinstance(pad, int) or w.shape[:2] != (C, 1) or g.shape[:2] != x.shape[:2]:
        return None
    if g.shape[2] != x.shape[2] + 2 * pad - w.shape[2] + 1:
        return None
    xs, gs = x.reshape(B, -1, *x.shape[1:]).to(torch.float32), g.reshape(B, -1, *g.shape[1:]).to(torch.float32)
    cots = {id(w): conv1d_weight_grads(xs, gs, C, w.shape[2], pad).to(w.dtype)}
    if b is not None:
        cots[id(b)] = gs.sum((1, 3)).to(b.dtype)
    return cots


def _matmul_cots(use: _Use, g: Tensor, B: int) -> Cots | None:
    """The per-sample cotangent of a derived matrix W (m, k) in ``x @ W`` (x (…, m), rows split by sample) or
    ``W @ x`` (x (B, …, k, n)): Σ of xᵀ g, or of g xᵀ, over each sample's rows (Mamba's ``A @ x``)."""
    name = getattr(use.func, "__name__", "")
    if name not in ("matmul", "__matmul__") or any(use.dims) or use.out_dim or use.spec.child(1).num_leaves:
        return None
    if len(use.leaves) != 2 or set(use.modes) not in ({_SPLIT, _DERIVED}, {_FLAT, _DERIVED}):
        return None
    left = use.modes[0] == _DERIVED
    w, x = use.derived[0].real, use.leaves[1 if left else 0]
    if w.dim() != 2 or not x.is_floating_point():
        return None
    if left:  # out (B, …, m, n) = W (m, k) @ x (B, …, k, n)
        if x.dim() < 3 or x.shape[-2] != w.shape[1] or g.shape[-2:] != (w.shape[0], x.shape[-1]):
            return None
        xs, gs = x.reshape(B, -1, *x.shape[-2:]).to(g.dtype), g.reshape(B, -1, *g.shape[-2:])
        return {id(w): torch.einsum("bsmn,bskn->bmk", gs, xs).to(w.dtype)}
    if x.dim() < 2 or x.shape[-1] != w.shape[0] or g.shape[-1] != w.shape[1]:  # out (…, k) = x (…, m) @ W (m, k)
        return None
    return {id(w): _row_products(x.to(g.dtype), g, B).to(w.dtype)}


def _cat_cots(use: _Use, g: Tensor, B: int) -> Cots | None:
    """The per-sample cotangents (B, 1, …) of the derived tensors broadcast to the batch in ``torch.cat`` with
    data split by sample along another dimension than the samples' (GPT-OSS's sinks beside the attention logits):
    each sample's slice of its output gradient along that dimension."""
    if getattr(use.func, "__name__", "") != "cat" or any(use.dims) or use.out_dim or g.shape[0] != B:
        return None
    args, kwargs = _unflatten(use.leaves, use.spec)
    if not args or not isinstance(args[0], list | tuple) or not all(isinstance(t, Tensor) for t in args[0]):
        return None
    parts = list(args[0])
    modes = use.modes[: len(parts)]
    if any(m not in (_SPLIT, _DSPLIT) for m in modes) or _DSPLIT not in modes:
        return None
    if any(m != _SHARED for m in use.modes[len(parts) :]) or any(t.dim() != g.dim() for t in parts):
        return None
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % g.dim()
    if dim == 0:
        return None
    gs = g.unsqueeze(1)  # (B, 1, …): each sample's gradient as the op run on its rows sees it
    cots, at = {}, 0
    for t, m in zip(parts, modes, strict=True):
        if m == _DSPLIT:
            cots[id(t)] = gs.narrow(dim + 1, at, t.shape[dim]).to(t.dtype)
        at += t.shape[dim]
    return cots if at == g.shape[dim] else None


# Positional parameters of the functions whose calls :func:`_closed_call` reads.
_SIGNATURES = {
    "linear": ("input", "weight", "bias"),
    "embedding": ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
    "conv1d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
}


def _closed_call(use: _Use, name: str) -> dict[str, Any] | None:
    """The use's arguments by parameter name when it is a call of ``name`` (:data:`_SIGNATURES`) whose input is
    split by sample along the leading dimension and whose weight is derived, taken whole, its other arguments
    derived or constants; None otherwise."""
    if getattr(use.func, "__name__", "") != name or any(use.dims) or use.out_dim:
        return None
    args, kwargs = _unflatten(use.leaves, use.spec)
    params = _SIGNATURES[name]
    call = {**dict(zip(params, args, strict=False)), **kwargs}
    if len(args) > len(params) or not set(call) <= set(params):
        return None
    mode = {id(t): m for t, m in zip(use.leaves, use.modes, strict=True) if isinstance(t, Tensor)}
    x, w = call.get("input"), call.get("weight")
    if not isinstance(x, Tensor) or not isinstance(w, Tensor) or mode.get(id(w)) != _DERIVED:
        return None
    if mode.get(id(x)) not in (_SPLIT, _FLAT) or any(
        m not in (_DERIVED, _SHARED) for i, m in mode.items() if i != id(x)
    ):
        return None
    return call


# The uses whose per-sample cotangents have a closed form, tried before the vmapped vjp. Each takes calls of its own
# functions only (by name: none shares one), so at most one takes a use, whatever the order they are tried in.
_CLOSED_FORMS = (
    _elementwise_cots,
    _linear_cots,
    _embedding_cots,
    _conv1d_cots,
    _matmul_cots,
    _cat_cots,
    _baddbmm_cots,
)


def _row_grads(out: Tensor, leaves: list[Tensor], rows: Tensor) -> list[Tensor | None]:
    """Per sample n, the gradient of ``out`` (B, …) at ``leaves`` for the cotangent that is ``rows[n]`` (1, …) at
    out's row n and zero elsewhere: (B, *leaf.shape) each (None: unused); (chunk, B, …) cotangents at a time."""
    B = out.shape[0]
    step = max(1, _DSPLIT_CHUNK // max(1, out.numel()))
    parts: list[list[Tensor | None]] = []
    for lo in range(0, B, step):
        n = torch.arange(lo, min(lo + step, B), device=out.device)
        cot = out.new_zeros(len(n), *out.shape)
        cot[torch.arange(len(n), device=out.device), n] = rows[lo : lo + len(n), 0].to(out.dtype)
        parts.append(_batched_grad(out, leaves, cot))
    return [None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True)]


# Autograd nodes of views that keep their input's elements in their (row-major) order, whose backward is a reshape.
_RESHAPES = frozenset(
    {
        "ViewBackward0",
        "UnsafeViewBackward0",
        "AliasBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
    }
)


def _reshaped(out: Tensor, leaf: Tensor) -> bool:
    """Whether ``out`` is ``leaf`` reshaped: made from it by views that keep its elements in order alone
    (``bias[:, None, :]``), so that its gradient for a cotangent (…, *out.shape) is that cotangent reshaped to
    (…, *leaf.shape), what :func:`_batched_grad`'s backward through those views gives, element for element."""
    node = out.grad_fn
    while node is not None and type(node).__name__ in _RESHAPES and len(node.next_functions) == 1:
        node = node.next_functions[0][0]
    return node is not None and type(node).__name__ == "AccumulateGrad" and node.variable is leaf


def _batched_grad(out: Tensor, leaves: list[Tensor], cot: Tensor) -> list[Tensor | None]:
    """Σ over ``out``'s elements of cot[n] · ∂out/∂leaves for every n: (B, *leaf.shape) each (None: unused)."""
    try:
        return list(torch.autograd.grad(out, leaves, cot, retain_graph=True, allow_unused=True, is_grads_batched=True))
    except RuntimeError:
        rows = [torch.autograd.grad(out, leaves, c, retain_graph=True, allow_unused=True) for c in cot]
        return [None if r[0] is None else torch.stack(list(r)) for r in zip(*rows, strict=True)]
