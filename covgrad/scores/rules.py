"""Per-module rules: a hooked module's saved input and output gradient → every sample's parameter gradient.

A rule is called once per module call during the backward with the module, its saved (detached)
input ``x`` and the gradient ``g`` of the objective with respect to the module's output, both with a
leading batch dimension B. For each parameter it owns it asks ``slot(name)`` for a (B, *param.shape)
float32 view to write (first contribution) or accumulate into (a later call of the same module or a
tied module), or None when that parameter is not selected. The Linear and Conv1D rules first ask
``slot.rows(name, n)`` for the weight's block in chunks of its leading dimension, which the fused
reduction folds while each is still in cache (see :class:`Slot`). :func:`covgrad.scores.binding.rule_for`
picks a module's rule.

Here: the rules' interface (:class:`Slot`, :class:`Call`, the marks :func:`row_parts`, :func:`full_call` and
:func:`adds_rows`), the fast rules of Linear, GPT-2 Conv1D, Embedding (Gemma's scaled one too), LayerNorm and
RMSNorm (Hugging Face norms recognised by the source text of their forward, :func:`_rmsnorm_style`), and
:func:`generic_rule`, the exact per-sample vector-Jacobian product of a module's own forward with respect to its
selected parameters only: a leaf module's, or a mixer's own small parameters (dt_bias, A_log, D, attention sinks,
router biases) while its parametrised submodules keep their fast rules. Rules marked by :func:`full_call` also
receive the hooked call's full inputs (:class:`Call`). The experts blocks' rules are in
:mod:`covgrad.scores.experts`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.opt.modeling_opt import OPTDecoderLayer
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock


class Slot:
    """A rule's access to the per-sample blocks it writes.

    Args:
        views: name → ((B, *param.shape) float32 view, first) for a selected parameter of the module, None
            otherwise; ``first`` says whether this is the call's first contribution (write) or a later one
            from a tied or repeated module (accumulate).
    """

    def __init__(self, views: Callable[[str], tuple[Tensor, bool] | None]) -> None:
        self._views = views

    def __call__(self, name: str) -> tuple[Tensor, bool] | None:
        """The parameter's whole view and whether to write (True) or accumulate into it, or None."""
        return self._views(name)

    def rows(self, name: str, n_rows: int) -> Iterator[tuple[int, int, Tensor]] | None:
        """The parameter's block in chunks of its leading dimension (``n_rows`` long), or None: then the
        rule writes the whole view from ``slot(name)``.

        Each item is (r0, r1, view) with view (B, r1 − r0, *param.shape[1:]) float32 to *write* rows r0:r1
        of every sample's gradient into; a chunk is consumed (folded) when the next one is asked for, so the
        rule must run the iteration to its end. This base class yields nothing to chunk (None); the fused
        reduction (:mod:`covgrad.scores.blocks`) chunks a parameter that gets one contribution per call.
        """
        return None

    def first_row(self, name: str) -> int:
        """The first row (along dim 0) of the parameter that the views of a rule marked by :func:`row_parts`
        hold: a row-cut parameter block's views hold rows ``first_row … first_row + view.shape[1]`` only
        (and ``rows`` yields absolute rows inside them). 0 here: whole tensors."""
        return 0


Rule = Callable[[nn.Module, Tensor, Tensor, Slot], None]


class RuleError(Exception):
    """A rule cannot differentiate its module's forward per sample (the message says why); the engine refuses
    the parameters of the binding, naming them."""


def row_parts(rule: Callable[..., None]) -> Callable[..., None]:
    """Mark a rule that writes only the rows ``slot.first_row(name) …`` of its views' leading dimension (a
    row-cut parameter block); other rules are handed whole-tensor views and the block keeps its rows."""
    rule.row_parts = True  # type: ignore[attr-defined]
    return rule


@dataclass(frozen=True)
class Call:
    """A hooked call's full (detached) inputs, passed as ``call=`` to rules marked by :func:`full_call`.

    ``args``/``kwargs`` are the call's arguments as the module received them. ``flat`` says that the
    module ran on a flattened (B·L, …) batch (row n·L + t is sample n's position t, verified by
    :class:`covgrad.scores.engine.PerSampleGrads`); ``length`` is L, so that :func:`generic_rule` splits a
    tensor with leading dimension B·L into the samples' (L, …) rows. ``params`` are the local (dotted)
    names of the parameters the rule differentiates (empty: the module's own), ``where`` the module's
    qualified name for error messages. ``outer`` = m > 0: the flattened rows are outer-major instead, an
    (m·B·L, …) batch whose row (i·B + n)·L + t is sample n's position t (experts that see every token once).
    ``state``: what the module's forward kept for its rule, where a pass ran it as a custom autograd function
    (:func:`covgrad.scores.experts.fused_forward`), else None.
    """

    args: tuple
    kwargs: dict[str, Any]
    flat: bool
    length: int = 0
    params: tuple[str, ...] = ()
    where: str = ""
    outer: int = 0
    state: Any = None


# Parents known to run their submodules on a (B·L, …) view of a (B, L, …) batch (row n·L + t is sample n's
# position t): OPT's decoder layer (final norm and MLP) and the MoE blocks (router, experts, shared expert).
# PerSampleGrads does not rely on this list (it verifies every flattened call by a check, see
# PerSampleGrads._trace); covgrad.tokens.backward reads it to pick its repeated-batch path.
FLATTENING_PARENTS = frozenset(
    {OPTDecoderLayer, Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, OlmoeSparseMoeBlock, Qwen2MoeSparseMoeBlock}
)


def full_call(rule: Callable[..., None]) -> Callable[..., None]:
    """Mark a rule that needs the call's full inputs: it is called as ``rule(module, x, g, slot, call=...)``."""
    rule.needs_call = True  # type: ignore[attr-defined]
    return rule


_LOW = (torch.bfloat16, torch.float16)


def _flat(t: Tensor, B: int, features: int) -> Tensor:
    """(B, *, features) -> (B, T', features) float32; a bf16/fp16 source dtype is remembered on the result
    (``covgrad_low``) so that :func:`_bmm_into` can run the product on tensor cores without rounding."""
    out = t.reshape(B, -1, features).to(torch.float32)
    if t.dtype in _LOW:
        out.covgrad_low = t.dtype
    return out


def _low_dtype(*ts: Tensor) -> torch.dtype | None:
    """The common bf16/fp16 source dtype of float32 operands made by :func:`_flat` (or views of them), on
    cuda, where ``bmm(..., out_dtype=float32)`` exists (CPU kernels lack it: None there)."""
    found = {getattr(t, "covgrad_low", None) or getattr(t._base, "covgrad_low", None) for t in ts}
    low = found.pop() if len(found) == 1 else None
    return low if low is not None and all(t.is_cuda for t in ts) else None


def _bmm_into(view: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """view (B, m, n) float32 = or += a @ b. Operands that hold bf16/fp16 values exactly (from a low-precision
    model) are cast back and multiplied with fp32 accumulation on tensor cores: the same products as the
    fp32 GEMM on the upcast values, about 10x faster."""
    low = _low_dtype(a, b)
    if low is not None:
        a, b = a.to(low), b.to(low)
        if first:
            torch.bmm(a, b, out_dtype=torch.float32, out=view)
        else:
            view.add_(torch.bmm(a, b, out_dtype=torch.float32))
    elif first:
        torch.bmm(a, b, out=view)
    else:
        view.baddbmm_(a, b)


# Fewest rows of a product computed for a row-cut view (:func:`_rows_into`): CPU GEMMs of under 4 rows run another
# kernel than wider ones, with other last bits.
_MIN_PART_ROWS = 16


def _rows_into(view: Tensor, a: Tensor, b: Tensor, first: bool, r0: int) -> None:
    """view (B, m, n) = or += rows r0 … r0 + m of a @ b, a (B, M, k) (a row-cut view; m = M: the whole product).
    A part of fewer than ``_MIN_PART_ROWS`` rows is computed inside a window of that many rows around it, so
    that its products are bit for bit those of the whole product (the GEMM kernel depends on the row count)."""
    m, M = view.shape[1], a.shape[1]
    lo = max(0, min(r0, M - _MIN_PART_ROWS))
    hi = max(r0 + m, min(M, lo + _MIN_PART_ROWS))
    if (lo, hi) == (r0, r0 + m):
        _bmm_into(view, a[:, r0 : r0 + m], b, first)
        return
    window = view.new_zeros(view.shape[0], hi - lo, view.shape[2])
    part = window[:, r0 - lo : r0 - lo + m]
    if not first:
        part.copy_(view)
    _bmm_into(window, a[:, lo:hi], b, first)
    view.copy_(part)


def _sum_into(view: Tensor, x: Tensor, first: bool) -> None:
    """view (B, n) = or += x.sum over positions; x (B, T', n)."""
    if first:
        torch.sum(x, dim=1, out=view)
    else:
        view.add_(x.sum(dim=1))


@row_parts
def _linear_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """y = x Wᵀ + b: per-sample ∂W = Σ_t g_t x_tᵀ (B, out, in), ∂b = Σ_t g_t."""
    B = g.shape[0]
    g = _flat(g, B, module.out_features)  # (B, T', O)
    if (chunks := slot.rows("weight", module.out_features)) is not None:
        x = _flat(x, B, module.in_features)
        for r0, r1, view in chunks:
            _bmm_into(view, g[:, :, r0:r1].transpose(1, 2), x, True)
    elif (s := slot("weight")) is not None:
        _rows_into(s[0], g.transpose(1, 2), _flat(x, B, module.in_features), s[1], slot.first_row("weight"))
    if (s := slot("bias")) is not None:
        _sum_into(s[0], g, s[1])


@row_parts
def _conv1d_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """GPT-2 Conv1D, y = x W + b with W (in, out): per-sample ∂W = Σ_t x_t g_tᵀ (B, in, out)."""
    B = g.shape[0]
    g = _flat(g, B, module.nf)
    if (chunks := slot.rows("weight", module.nx)) is not None:
        x = _flat(x, B, module.nx)
        for r0, r1, view in chunks:
            _bmm_into(view, x[:, :, r0:r1].transpose(1, 2), g, True)
    elif (s := slot("weight")) is not None:
        _rows_into(s[0], _flat(x, B, module.nx).transpose(1, 2), g, s[1], slot.first_row("weight"))
    if (s := slot("bias")) is not None:
        _sum_into(s[0], g, s[1])


def conv1d_weight_grads(x: Tensor, g: Tensor, groups: int, K: int, pad: int) -> Tensor:
    """Per-sample weight gradients of ``F.conv1d`` with stride and dilation 1 and zero padding ``pad``: x (B, s, C,
    L) each sample's s inputs, g (B, s, O, T) their output gradients (T = L + 2·pad − K + 1), both float32 →
    (B, O, C / groups, K), ∂W[o, i, k] = Σ over the sample's rows and t of g[o, t] · x_pad[group(o)·C/groups + i,
    t + k]. One product of (B, s, C, T) values per tap k, never the (…, T, K) windows whole."""
    B, s, C, _ = x.shape
    O, T = g.shape[2], g.shape[3]
    xp = F.pad(x, (pad, pad))
    gg = g.reshape(B, s, groups, O // groups, T)
    out = g.new_empty(B, groups, O // groups, C // groups, K)
    for k in range(K):
        xk = xp[..., k : k + T].reshape(B, s, groups, C // groups, T)
        if groups in (O, C) and O == C:  # depthwise: one channel in, one out per group
            out[:, :, 0, 0, k] = (gg[:, :, :, 0] * xk[:, :, :, 0]).sum((1, 3))
        else:
            out[..., k] = torch.einsum("bsgot,bsgit->bgoi", gg, xk)
    return out.reshape(B, O, C // groups, K)


def plain_conv1d(module: nn.Module) -> bool:
    """Whether an ``nn.Conv1d`` has what :func:`_torch_conv1d_rule` takes: stride and dilation 1, zero padding
    of an explicit size."""
    return (
        module.stride == (1,)
        and module.dilation == (1,)
        and module.padding_mode == "zeros"
        and isinstance(module.padding, tuple)
    )


@row_parts
def _torch_conv1d_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """torch.nn.Conv1d (the short convolutions of state-space and hybrid layers; :func:`plain_conv1d`): per-sample
    ∂W (B, O, C/groups, K) by :func:`conv1d_weight_grads` and ∂b = Σ_t g, over x (B, [s,] C, L)."""
    B, C, O = g.shape[0], module.in_channels, module.out_channels
    xs = x.reshape(B, -1, C, x.shape[-1]).to(torch.float32)
    gs = g.reshape(B, -1, O, g.shape[-1]).to(torch.float32)
    if (s := slot("weight")) is not None:
        grads = conv1d_weight_grads(xs, gs, module.groups, module.kernel_size[0], module.padding[0])
        r0 = slot.first_row("weight")
        part = grads[:, r0 : r0 + s[0].shape[1]]
        if s[1]:
            s[0].copy_(part)
        else:
            s[0].add_(part)
    if (s := slot("bias")) is not None:
        _sum_into(s[0], gs.sum(3), s[1])


# add(r0, r1, view): rows r0 … r1 of every sample's contribution added into view (B, r1 − r0, *shape[1:])
RowAdder = Callable[[int, int, Tensor], None]


def adds_rows(adder: Callable[[nn.Module, Tensor, Tensor], RowAdder]) -> Callable[[Rule], Rule]:
    """Mark a rule whose weight contribution can also be added chunk by chunk into rows another contribution
    wrote: ``adder(module, x, g)`` returns ``add(r0, r1, view)``, which adds rows r0 … r1 of every sample's
    contribution into ``view`` (B, r1 − r0, *shape[1:]). The fused reduction folds a tied embedding this way
    (:meth:`covgrad.scores.blocks.Blocks.row_chunks`: the LM head's chunk, then the embedding's rows
    added)."""

    def mark(rule: Rule) -> Rule:
        rule.row_adder = adder  # type: ignore[attr-defined]
        return rule

    return mark


def _embedding_inputs(module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """ids (B, T') and the output gradient (B, T', H) float32 of an embedding call, zero at the padding id."""
    B, H = g.shape[0], module.embedding_dim
    ids = x.reshape(B, -1)
    g = _flat(g, B, H)
    if module.padding_idx is not None:
        g = g.masked_fill((ids == module.padding_idx)[..., None], 0.0)
    return ids, g


def _embedding_adder(ids: Tensor, g: Tensor) -> RowAdder:
    """``add(r0, r1, view)``: rows r0 … r1 of every sample's embedding gradient added into ``view`` (B, r1 − r0,
    H), from ids (B, T') and g (B, T', H) float32. The positions are sorted by id once (stably), so a chunk adds
    only the positions whose id lies in it, each row's in position order, as the whole-table scatter does."""
    B, T = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids, sample, rows = flat[order], order // T, g.reshape(B * T, -1)

    def add(r0: int, r1: int, view: Tensor) -> None:
        lo, hi = torch.searchsorted(sorted_ids, torch.tensor([r0, r1], device=flat.device)).tolist()
        if hi > lo:
            n = r1 - r0
            view.view(B * n, -1).index_add_(0, sample[lo:hi] * n + (sorted_ids[lo:hi] - r0), rows[order[lo:hi]])

    return add


@adds_rows(lambda module, x, g: _embedding_adder(*_embedding_inputs(module, x, g)))
@row_parts
def _embedding_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """Row y of the table gets Σ_{t: id_t = y} g_t per sample; the padding row gets nothing. A view of rows
    r0 … r1 only (a row-cut block) gets the positions whose id lies there (the others add exact zeros). Chunks
    of rows (:meth:`Slot.rows`) are written from the positions sorted by id (:func:`_embedding_adder`)."""
    ids, g = _embedding_inputs(module, x, g)
    if (chunks := slot.rows("weight", module.num_embeddings)) is not None:
        add = _embedding_adder(ids, g)
        for r0, r1, view in chunks:
            add(r0, r1, view.zero_())
        return
    view, first = slot("weight")
    if first:
        view.zero_()
    r0 = slot.first_row("weight")
    if r0 or view.shape[1] != module.num_embeddings:
        inside = (ids >= r0) & (ids < r0 + view.shape[1])
        ids, g = torch.where(inside, ids - r0, 0), torch.where(inside[..., None], g, 0.0)
    view.scatter_add_(1, ids[..., None].expand(-1, -1, g.shape[-1]), g)  # view (B, V, H)


def _scale(module: nn.Module, g: Tensor) -> Tensor:
    """g·s, s = a scaled embedding's embed_scale cast to the weight's dtype (the product autograd forms)."""
    return g * module.embed_scale.to(module.weight.dtype)


@adds_rows(lambda module, x, g: _embedding_adder(*_embedding_inputs(module, x, _scale(module, g))))
@row_parts
def _scaled_embedding_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """Gemma's scaled embedding, y = W[id]·s with s = embed_scale cast to the weight's dtype: the plain
    embedding rule on g·s (the product autograd forms), row y of every sample's block Σ_{t: id_t = y} g_t·s."""
    _embedding_rule(module, x, _scale(module, g), slot)


def _scaled_embeddings() -> dict[type, tuple[Rule, frozenset[str]]]:
    """Table entries of the transformers scaled embeddings whose forward is verbatim Gemma's,
    ``super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)`` (Gemma 1–4, Gemma 3n, VaultGemma)."""
    import importlib

    ref = _source_key(GemmaTextScaledWordEmbedding.forward)
    found: dict[type, tuple[Rule, frozenset[str]]] = {}
    for family, name in (
        ("gemma", "GemmaTextScaledWordEmbedding"),
        ("gemma2", "Gemma2TextScaledWordEmbedding"),
        ("gemma3", "Gemma3TextScaledWordEmbedding"),
        ("gemma3n", "Gemma3nTextScaledWordEmbedding"),
        ("gemma4", "Gemma4TextScaledWordEmbedding"),
        ("vaultgemma", "VaultGemmaTextScaledWordEmbedding"),
    ):
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        except (ImportError, AttributeError):
            continue
        if issubclass(cls, nn.Embedding) and _source_key(cls.forward) == ref:
            found[cls] = (_scaled_embedding_rule, frozenset({"weight"}))
    return found


@full_call
@row_parts
def _learned_positions_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot, call: Call) -> None:
    """OPT's learned positions (a verbatim copy of its forward, :func:`learned_positions_ok`): the embedding rule on
    the ids its forward looks up, ``position_ids + offset``; without position ids, the positions it counts from the
    attention mask (cumsum · mask − 1 from ``cache_length`` on), as it does. x (B, L) the mask, g (B, L, H)."""
    position_ids = call.kwargs.get("position_ids", call.args[2] if len(call.args) > 2 else None)
    if position_ids is None:
        mask = call.args[0] if call.args else call.kwargs["attention_mask"]
        cache_length = call.kwargs.get("cache_length", call.args[1] if len(call.args) > 1 else 0)
        position_ids = ((torch.cumsum(mask, dim=1) * mask - 1).long())[:, cache_length:]
    _embedding_rule(module, position_ids + module.offset, g, slot)


@functools.cache
def learned_positions_ok(cls: type) -> bool:
    """Whether ``cls`` is an embedding whose forward is verbatim OPT's learned positions (OPT, BioGPT)."""
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    return issubclass(cls, nn.Embedding) and _source_key(cls.forward) == _source_key(
        OPTLearnedPositionalEmbedding.forward
    )


def _layernorm_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """y = x̂ ⊙ w + b with x̂ recomputed by the same kernel in float32: ∂w = Σ_t g ⊙ x̂, ∂b = Σ_t g."""
    B, n = g.shape[0], module.weight.numel()
    g = _flat(g, B, n)
    if (s := slot("weight")) is not None:
        xhat = F.layer_norm(x.to(torch.float32), module.normalized_shape, None, None, module.eps)
        _sum_into(s[0].view(B, n), g * _flat(xhat, B, n), s[1])
    if (s := slot("bias")) is not None:
        _sum_into(s[0].view(B, n), g, s[1])


def rmsnorm_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """Hugging Face RMSNorms: x̂ = x·rsqrt(mean x² + ε) in float32, ∂w = Σ_t g ⊙ x̂ per sample.

    Llama-style norms cast x̂ back to the input dtype before multiplying by w; OLMo2-style (w ⊙ x̂, then
    cast) and Gemma-style (x̂ ⊙ (1 + w), then cast) multiply in float32, so x̂ stays float32 there. Gemma 3n's
    and Gemma 4's take the power −1/2 of mean x² + ε (``torch.pow``, as their forward does), Cohere's centre x
    first (x − mean x, a LayerNorm without bias), both scaling in float32.
    """
    B, n = g.shape[0], module.weight.numel()
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    style = _rmsnorm_style(type(module))
    h = x.to(torch.float32)
    if style == "centered":
        h = h - h.mean(-1, keepdim=True)
    if style == "pow":
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    else:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "cast-then-scale":
        h = h.to(x.dtype)
    view, first = slot("weight")
    _sum_into(view.view(B, n), _flat(g, B, n) * _flat(h, B, n), first)


def _torch_rmsnorm_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """torch.nn.RMSNorm: x̂ recomputed by F.rms_norm without weight, ∂w = Σ_t g ⊙ x̂."""
    B, n = g.shape[0], module.weight.numel()
    xhat = F.rms_norm(x, module.normalized_shape, None, module.eps)
    view, first = slot("weight")
    _sum_into(view.view(B, n), _flat(g, B, n) * _flat(xhat, B, n), first)


@functools.cache
def _source_key(fn: Callable) -> str | None:
    """A function's source without comments and whitespace (None when it has no Python source); cached per function
    object (reading the source costs about a millisecond)."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    return re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", src))


# Verbatim RMSNorm forwards of transformers, by how each multiplies the weight (see rmsnorm_rule): per style the
# classes whose methods (Gemma's forward calls self._norm, which must match too) are the reference, compared
# without their signature lines (type hints differ between copies of one body), as (module, class, methods).
_RMSNORM_FORWARDS = {
    "cast-then-scale": (
        ("llama.modeling_llama", "LlamaRMSNorm", ("forward",)),
        ("llama4.modeling_llama4", "Llama4TextRMSNorm", ("forward", "_norm")),
    ),
    "scale-then-cast": (
        ("olmo2.modeling_olmo2", "Olmo2RMSNorm", ("forward",)),
        ("nemotron_h.modeling_nemotron_h", "NemotronHRMSNorm", ("forward",)),
    ),
    "one-plus-w": (("gemma.modeling_gemma", "GemmaRMSNorm", ("forward", "_norm")),),
    "pow": (("gemma3n.modeling_gemma3n", "Gemma3nRMSNorm", ("forward", "_norm")),),
    "centered": (("cohere2_moe.modeling_cohere2_moe", "Cohere2MoeLayerNorm", ("forward",)),),
}


def _body_key(fn: Callable) -> str | None:
    """:func:`_source_key` of a method without its signature line (the text after the first ``:`` that ends the
    ``def`` line)."""
    key = _source_key(fn)
    if key is None:
        return None
    head = re.match(r"def\w+\(.*?\)(->[^:]+)?:", key)
    return key[head.end() :] if head else key


@functools.cache
def _rmsnorm_refs() -> tuple[tuple[str, type, tuple[str, ...]], ...]:
    """(style, reference class, methods) for every reference this transformers version has."""
    refs = []
    for style, entries in _RMSNORM_FORWARDS.items():
        for module, name, methods in entries:
            try:
                ref = getattr(importlib.import_module(f"transformers.models.{module}"), name)
            except (ImportError, AttributeError):
                continue
            refs.append((style, ref, methods))
    return tuple(refs)


@functools.cache
def _rmsnorm_style(cls: type) -> str | None:
    """Which verified RMSNorm forward ``cls`` runs, or None."""
    for style, ref, methods in _rmsnorm_refs():
        if all(hasattr(cls, m) and _body_key(getattr(cls, m)) == _body_key(getattr(ref, m)) for m in methods):
            return style
    return None


def float_outputs(output: Any) -> tuple[Tensor, ...]:
    """The floating-point tensors a module returns (the ones a gradient can reach), in order."""
    if isinstance(output, Tensor):
        return (output,)
    if isinstance(output, tuple | list):
        return tuple(t for t in output if isinstance(t, Tensor) and t.is_floating_point())
    return ()


# Module classes whose forward torch.func.vmap cannot batch (in-place writes into fresh tensors, data-dependent
# control flow, autograd.Functions without setup_context): generic_rule loops over samples for them.
_NO_VMAP: set[type] = set()


def _split_modes(leaves: list, B: int, rows: int | None) -> list[int]:
    """Per pytree leaf of a call: 1 = a per-sample tensor (leading dimension B), 2 = a flattened one (leading
    dimension ``rows`` = B·L, row n·L + t is sample n's), 0 = shared by every sample."""
    modes = []
    for t in leaves:
        lead = t.shape[0] if isinstance(t, Tensor) and t.dim() else None
        modes.append(1 if lead == B else 2 if rows is not None and lead == rows else 0)
    return modes


def _sample_rows(t: Tensor, B: int, outer: int) -> Tensor:
    """A flattened (B·k, …) tensor as (B, k, …) of each sample's rows: sample-major (row n·k + j), or with
    ``outer`` = m outer-major ((m·B·L, …), row (i·B + n)·L + t, given as sample n's m·L rows in order)."""
    if outer:
        return t.reshape(outer, B, -1, *t.shape[1:]).transpose(0, 1).reshape(B, -1, *t.shape[1:])
    return t.reshape(B, -1, *t.shape[1:])


@full_call
def generic_rule(module: nn.Module, x: Tensor, g: Tensor | tuple[Tensor, ...], slot: Slot, call: Call) -> None:
    """Any module: per sample, the vector-Jacobian product of its own forward with respect to the parameters
    ``call.params`` (its own when empty; dotted names reach into submodules), at the sample's saved inputs
    and against the sample's output gradient(s) ``g`` (one per floating output, see :func:`float_outputs`,
    each with leading dimension B), vectorised over samples with torch.func.vmap, or in a loop over samples
    of plain autograd where vmap cannot batch the forward.

    Tensor arguments with leading dimension B are split by sample (shown to the forward with a batch of
    one); with leading dimension B·L (``call.length`` = L > 1) as the sample's own (L, …) rows (sample- or
    outer-major, see :class:`Call`); others are shared. Submodules run their own forward (their parameters
    are constants here), so their parameters keep their own rules and are not counted twice.

    Raises:
        RuleError: naming the module when neither vmap nor the loop can differentiate its forward.
    """
    cots = (g,) if isinstance(g, Tensor) else tuple(g)
    B = cots[0].shape[0]
    names = call.params or tuple(pn for pn, _ in module.named_parameters(recurse=False))
    slots = {pn: s for pn in names if (s := slot(pn)) is not None}
    if not slots:
        return
    primals = {pn: module.get_parameter(pn).detach() for pn in slots}
    leaves, spec = tree_flatten((call.args, call.kwargs))
    modes = _split_modes(leaves, B, B * call.length if call.length > 1 else None)
    per_sample = [t if m == 1 else _sample_rows(t, B, call.outer) for t, m in zip(leaves, modes, strict=True) if m]

    def forward(p: dict[str, Tensor], mine: list[Tensor]) -> tuple[Tensor, ...]:
        own = iter(mine)
        filled = [
            (next(own).unsqueeze(0) if m == 1 else next(own)) if m else t for t, m in zip(leaves, modes, strict=True)
        ]
        args, kwargs = tree_unflatten(filled, spec)
        with _reparametrize_module(module, p, tie_weights=True):  # every name of a tensor registered twice
            return float_outputs(module.forward(*args, **kwargs))

    def one(params: dict[str, Tensor], mine: list[Tensor], cot: tuple[Tensor, ...]) -> dict[str, Tensor]:
        outs, vjp_fn = torch.func.vjp(lambda p: forward(p, mine), params)
        return vjp_fn(tuple(c.reshape(o.shape) for c, o in zip(cot, outs, strict=True)))[0]

    grads = None
    if type(module) not in _NO_VMAP:
        try:
            with torch.enable_grad():
                grads = torch.func.vmap(one, in_dims=(None, 0, 0))(primals, per_sample, cots)
        except Exception:  # any failure to batch: the loop below
            _NO_VMAP.add(type(module))
    if grads is None:
        try:
            grads = _looped_vjp(module, forward, primals, per_sample, cots, call.where)
        except RuleError:
            if call.outer or (grads := _masked_vjp(module, primals, call, cots)) is None:
                raise
    for pn, (view, first) in slots.items():
        if first:
            view.copy_(grads[pn])
        else:
            view.add_(grads[pn].to(torch.float32))


# Bytes of the cotangents of one vmapped backward of _masked_vjp (k samples' masked copies of the outputs).
_MASKED_CHUNK_BYTES = 256 << 20


def _masked_vjp(
    module: nn.Module, primals: dict[str, Tensor], call: Call, cots: tuple[Tensor, ...]
) -> dict[str, Tensor] | None:
    """generic_rule's last fallback, for a forward that runs only on the batch it was called with (RecurrentGemma's
    RG-LRU keeps a recurrent state sized for the whole batch on the module): one forward of the call as it was,
    then per sample n a backward of its outputs against sample n's cotangent rows alone (the others zero), k
    samples at once as one backward vmapped over their cotangents (``is_grads_batched``; k·outputs within
    ``_MASKED_CHUNK_BYTES``), one at a time where vmap cannot batch the backward. {name: (B, *shape)} gradients,
    or None when that forward or backward fails too. Sample n's gradient, since the module keeps the samples
    apart (verified for every replayed module by the first call's trace)."""
    B = cots[0].shape[0]
    p = {pn: t.detach().requires_grad_() for pn, t in primals.items()}
    ps = list(p.values())
    rows: list[tuple[Tensor, ...]] = []
    try:
        with torch.enable_grad(), _reparametrize_module(module, p, tie_weights=True):
            outs = float_outputs(module.forward(*call.args, **call.kwargs))
        live = [(o, c.reshape(B, -1)) for o, c in zip(outs, cots, strict=True) if o.requires_grad]
        size = sum(o.numel() * o.element_size() for o, _ in live)
        k, batched = max(1, min(B, _MASKED_CHUNK_BYTES // max(size, 1))), True
        for a in range(0, B, k):
            n = torch.arange(a, min(a + k, B), device=cots[0].device)
            alone = []  # per output (len(n), *o.shape): copy i holds sample a + i's rows, zeros elsewhere
            for o, c in live:
                mine = c.new_zeros(len(n), B, c.shape[1])
                mine[torch.arange(len(n)), n] = c[n]
                alone.append(mine.reshape(len(n), *o.shape).to(o.dtype))
            outputs = [o for o, _ in live]
            grads = None
            if batched and len(n) > 1:
                try:
                    grads = torch.autograd.grad(
                        outputs, ps, alone, allow_unused=True, retain_graph=True, is_grads_batched=True
                    )
                except Exception:  # a backward vmap cannot batch: one backward per sample from here on
                    batched = False
            if grads is None:
                each = [
                    torch.autograd.grad(outputs, ps, [m[i] for m in alone], allow_unused=True, retain_graph=True)
                    for i in range(len(n))
                ]
                grads = tuple(
                    torch.stack([g[j] if g[j] is not None else t.new_zeros(t.shape) for g in each])
                    for j, t in enumerate(ps)
                )
            rows.append(
                tuple(t.new_zeros(len(n), *t.shape) if g is None else g for g, t in zip(grads, ps, strict=True))
            )
    except Exception:  # the loop's refusal stands
        return None
    return {pn: torch.cat([r[j] for r in rows]) for j, pn in enumerate(p)}


def _looped_vjp(
    module: nn.Module,
    forward: Callable[[dict[str, Tensor], list[Tensor]], tuple[Tensor, ...]],
    primals: dict[str, Tensor],
    per_sample: list[Tensor],
    cots: tuple[Tensor, ...],
    where: str,
) -> dict[str, Tensor]:
    """generic_rule's fallback: per sample n, one forward of the module at sample n's inputs and one plain
    autograd backward of its outputs against sample n's cotangents; {name: (B, *shape)} gradients."""
    B = cots[0].shape[0]
    rows: dict[str, list[Tensor]] = {pn: [] for pn in primals}
    try:
        for n in range(B):
            p = {pn: t.detach().requires_grad_() for pn, t in primals.items()}
            with torch.enable_grad():
                outs = forward(p, [t[n] for t in per_sample])
                pairs = [(o, c[n].reshape(o.shape)) for o, c in zip(outs, cots, strict=True) if o.requires_grad]
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], list(p.values()), [c for _, c in pairs], allow_unused=True
                )
            for (pn, t), gr in zip(p.items(), grads, strict=True):
                rows[pn].append(torch.zeros_like(t) if gr is None else gr)
    except Exception as exc:  # reported as a refusal naming the module's parameters
        first = (str(exc).strip().splitlines() or [""])[0]
        raise RuleError(
            f"the per-sample vector-Jacobian product of {where or 'a module'} (a {type(module).__name__}) failed "
            f"({type(exc).__name__}: {first[:200]})"
        ) from None
    return {pn: torch.stack(r) for pn, r in rows.items()}
