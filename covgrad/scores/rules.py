"""Per-module rules: a hooked module's saved input and output gradient → every sample's parameter gradient.

A rule is called once per module call during the backward with the module, its saved (detached)
input ``x`` and the gradient ``g`` of the objective with respect to the module's output, both with a
leading batch dimension B. For each parameter it owns it asks ``slot(name)`` for a (B, *param.shape)
float32 view to write (first contribution) or accumulate into (a later call of the same module or a
tied module), or None when that parameter is not selected. The Linear and Conv1D rules first ask
``slot.rows(name, n)`` for the weight's block in chunks of its leading dimension, which the fused
reduction folds while each is still in cache (see :class:`Slot`). :func:`rule_for` picks a module's rule.

Fast rules are matched by exact class (a subclass may change the forward: Gemma's scaled embedding
multiplies inside it), and RMSNorm and fused-expert classes by the source text of their forward, so any
family whose norm is a verbatim copy of Llama's, OLMo2's or Gemma's gets the fast rule. An experts block of any
other class is recognised by its shape (:func:`experts_shape`) and takes :func:`_routed_experts_rule`, which runs
its own forward once with the experts widened per sample, verified by a probe. Every other module
gets :func:`generic_rule`, the exact per-sample vector-Jacobian product of its own forward with respect to
its selected parameters only: a leaf module's, or a mixer's own small parameters (dt_bias, A_log, D,
attention sinks, router biases) while its parametrised submodules keep their fast rules. Rules marked by
:func:`full_call` also receive the hooked call's full inputs (:class:`Call`).
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm, GemmaTextScaledWordEmbedding
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.opt.modeling_opt import OPTDecoderLayer
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.pytorch_utils import Conv1D

try:  # fused expert tensors arrived with transformers 5; older versions keep one Linear per expert
    from transformers.integrations.moe import _default_apply_gate
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
except ImportError:
    _default_apply_gate = Qwen3MoeExperts = None
try:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
except ImportError:
    GptOssExperts = None


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
    """

    args: tuple
    kwargs: dict[str, Any]
    flat: bool
    length: int = 0
    params: tuple[str, ...] = ()
    where: str = ""
    outer: int = 0


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
    cast) and Gemma-style (x̂ ⊙ (1 + w), then cast) multiply in float32, so x̂ stays float32 there.
    """
    B, n = g.shape[0], module.weight.numel()
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if _rmsnorm_style(type(module)) == "cast-then-scale":
        h = h.to(x.dtype)
    view, first = slot("weight")
    _sum_into(view.view(B, n), _flat(g, B, n) * _flat(h, B, n), first)


def _torch_rmsnorm_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """torch.nn.RMSNorm: x̂ recomputed by F.rms_norm without weight, ∂w = Σ_t g ⊙ x̂."""
    B, n = g.shape[0], module.weight.numel()
    xhat = F.rms_norm(x, module.normalized_shape, None, module.eps)
    view, first = slot("weight")
    _sum_into(view.view(B, n), _flat(g, B, n) * _flat(xhat, B, n), first)


def _source_key(fn: Callable) -> str | None:
    """A function's source without comments and whitespace (None when it has no Python source)."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    return re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", src))


# Verbatim RMSNorm forwards of transformers and how each multiplies the weight (see rmsnorm_rule);
# Gemma's forward calls self._norm, which must match too.
_RMSNORM_FORWARDS = {
    "cast-then-scale": (LlamaRMSNorm, ("forward",)),
    "scale-then-cast": (Olmo2RMSNorm, ("forward",)),
    "one-plus-w": (GemmaRMSNorm, ("forward", "_norm")),
}


@functools.cache
def _rmsnorm_style(cls: type) -> str | None:
    """Which verified RMSNorm forward ``cls`` runs, or None."""
    for style, (ref, methods) in _RMSNORM_FORWARDS.items():
        if all(hasattr(cls, m) and _source_key(getattr(cls, m)) == _source_key(getattr(ref, m)) for m in methods):
            return style
    return None


def _fused_experts_ok(module: nn.Module) -> bool:
    """Whether ``module`` runs transformers' fused-expert forward: Qwen3-MoE's (Mixtral, OLMoE, Qwen2-MoE,
    DeepSeek, …: gate_up_proj (E, 2I, H) concatenated [gate; up], down_proj (E, H, I), no biases) or GPT-OSS's
    (transposed weights (E, H, 2I) and (E, I, H), biases, its own clamped gate on interleaved columns), each
    with its own gate function, no post-expert norm, in any of transformers' expert implementations (eager,
    batched or grouped matmuls compute the same map)."""
    cls = type(module)
    if not (
        getattr(module, "has_gate", False)
        and not getattr(module, "has_post_expert_norm", True)
        and not getattr(module, "_is_expert_parallel", False)
    ):
        return False
    forward = _source_key(cls.forward)
    if Qwen3MoeExperts is not None and forward == _source_key(Qwen3MoeExperts.forward):
        return (
            getattr(cls, "_apply_gate", None) is _default_apply_gate
            and getattr(module, "is_concatenated", False)
            and not getattr(module, "is_transposed", True)
            and not getattr(module, "has_bias", True)
        )
    if GptOssExperts is not None and forward == _source_key(GptOssExperts.forward):
        return (
            _source_key(cls._apply_gate) == _source_key(GptOssExperts._apply_gate)
            and getattr(module, "is_transposed", False)
            and getattr(module, "has_bias", False)
        )
    return False


def _experts_params(module: nn.Module) -> frozenset[str]:
    """The parameters :func:`_experts_rule` covers on a module accepted by :func:`_fused_experts_ok`."""
    names = {"gate_up_proj", "down_proj"}
    if getattr(module, "has_bias", False):
        names |= {"gate_up_proj_bias", "down_proj_bias"}
    return frozenset(names)


def _call_arg(call: Call, i: int, name: str) -> Any:
    return call.args[i] if len(call.args) > i else call.kwargs[name]


class _Groups:
    """Rows (m, ·) sorted by a group id (``group`` (m,) int64 in [0, n), non-decreasing), and the segmented
    products over them: torch's grouped GEMM where the device has it for float32, else batched matmuls over
    zero-padded per-group blocks (n, M, ·), M the largest group's size."""

    def __init__(self, group: Tensor, n: int) -> None:
        counts = torch.bincount(group, minlength=n)
        self.group, self.n = group, n
        self.offs = torch.cumsum(counts, 0).to(torch.int32)
        self.rank = torch.arange(group.numel(), device=group.device) - (self.offs.long() - counts)[group]
        self.M = int(counts.max()) if group.numel() else 0

    def _pack(self, rows: Tensor) -> Tensor:
        out = rows.new_zeros(self.n, self.M, *rows.shape[1:])
        out[self.group, self.rank] = rows
        return out

    def times(self, rows: Tensor, weights: Tensor) -> Tensor:
        """(m, k) rows, each times its group's matrix of ``weights`` (n, k, q): (m, q)."""
        if _GROUPED_MM.get(rows.device.type, True):
            try:
                return torch._grouped_mm(rows, weights, offs=self.offs)
            except (RuntimeError, AttributeError):
                _GROUPED_MM[rows.device.type] = False
        return torch.bmm(self._pack(rows), weights)[self.group, self.rank]

    def outer_sums(self, left: Tensor, right: Tensor) -> Tensor:
        """Per group Σ_r left_r right_rᵀ over its rows: left (m, p), right (m, q) → (n, p, q)."""
        if _GROUPED_MM.get(left.device.type, True):
            try:
                return torch._grouped_mm(left.t(), right, offs=self.offs)
            except (RuntimeError, AttributeError):
                _GROUPED_MM[left.device.type] = False
        return torch.bmm(self._pack(left).transpose(1, 2), self._pack(right))


# Device types where torch._grouped_mm failed on float32 operands (False): _Groups pads instead there.
_GROUPED_MM: dict[str, bool] = {}


@full_call
def _experts_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot, call: Call) -> None:
    """Fused experts: out_t = Σ_k w_{t,k} [D_e a(G_e x_t + b_e) + c_e] with e = index_{t,k} and a the module's
    gate (act(gate) ⊙ up; biases b, c only where the module has them; D, G stored transposed where it says so).

    Per sample and expert, ∂D_e = Σ_{(t,k)→e} (w_{t,k} g_t) a_tᵀ, ∂c_e = Σ w_{t,k} g_t, ∂G_e = Σ δ_t x_tᵀ and
    ∂b_e = Σ δ_t with δ the gate's vector-Jacobian product; only the sample's own tokens routed to e
    contribute. Computed in float32 on the routed (token, k) pairs sorted by (expert, sample): the experts'
    forward and δ as one segmented product per expert, the per-sample outer products as one per (expert,
    sample) (:class:`_Groups`). The router weights w are constants here (the router has its own rule).
    """
    B, H = g.shape[0], x.shape[-1]
    h = x.reshape(-1, H).to(torch.float32)  # (B·T, H), sample n owns rows [n·T, (n+1)·T)
    go = g.reshape(-1, H).to(torch.float32)
    T = h.shape[0] // B
    index = _call_arg(call, 1, "top_k_index").reshape(B * T, -1)
    weights = _call_arg(call, 2, "top_k_weights").reshape(B * T, -1).to(torch.float32)
    transposed, bias = getattr(module, "is_transposed", False), getattr(module, "has_bias", False)
    s_gu, s_d = slot("gate_up_proj"), slot("down_proj")
    s_gub = slot("gate_up_proj_bias") if bias else None
    s_db = slot("down_proj_bias") if bias else None
    E, K = module.num_experts, index.shape[1]
    expert = index.reshape(-1).long()  # (B·T·K,) the expert of each routed (token, k) pair
    pair = torch.nonzero((expert >= 0) & (expert < E))[:, 0]  # out-of-range ids (a router's padding) route nowhere
    tok = torch.div(pair, K, rounding_mode="floor")
    sample = torch.div(tok, T, rounding_mode="floor")
    group = expert[pair] * B + sample  # (m,) the (expert, sample) group of each pair
    order = torch.argsort(group, stable=True)
    pair, tok, group = pair[order], tok[order], group[order]
    by_expert, by_pair = _Groups(torch.div(group, B, rounding_mode="floor"), E), _Groups(group, E * B)
    xe = h[tok]  # (m, H)
    do = go[tok] * weights.reshape(-1)[pair, None]  # (m, H): gradient of each pair's expert output
    W_gu, W_d = module.gate_up_proj.to(torch.float32), module.down_proj.to(torch.float32)
    with torch.enable_grad():
        gu = by_expert.times(xe, W_gu if transposed else W_gu.transpose(1, 2))  # (m, 2I)
        if bias:
            gu = gu + module.gate_up_proj_bias.to(torch.float32)[by_expert.group]
        gu = gu.detach().requires_grad_()
        act = module._apply_gate(gu)  # (m, I)
        dgu = None
        if s_gu is not None or s_gub is not None:
            da = by_expert.times(do, W_d.transpose(1, 2) if transposed else W_d)  # (m, I)
            (dgu,) = torch.autograd.grad(act, gu, da)
    act = act.detach()

    def write(s: tuple[Tensor, bool] | None, blocks: Tensor) -> None:
        """s's (B, E, …) view = or += blocks (E·B, …) of every (expert, sample) group."""
        if s is None:
            return
        blocks = blocks.reshape(E, B, *blocks.shape[1:]).transpose(0, 1)
        if s[1]:
            s[0].copy_(blocks)
        else:
            s[0].add_(blocks)

    if s_d is not None:
        write(s_d, by_pair.outer_sums(act, do) if transposed else by_pair.outer_sums(do, act))
    if s_gu is not None:
        write(s_gu, by_pair.outer_sums(xe, dgu) if transposed else by_pair.outer_sums(dgu, xe))
    if s_db is not None:
        write(s_db, do.new_zeros(E * B, H).index_add_(0, group, do))
    if s_gub is not None:
        write(s_gub, dgu.new_zeros(E * B, dgu.shape[1]).index_add_(0, group, dgu))


def _takes_routing(module: nn.Module) -> bool:
    """Whether the module's forward takes more than one positional argument (hidden states and a routing)."""
    try:
        takes = [
            q
            for q in inspect.signature(module.forward).parameters.values()
            if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD, q.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        return False
    return len(takes) >= 2 or any(q.kind is q.VAR_POSITIONAL for q in takes)


@dataclass(frozen=True)
class Experts:
    """A module shaped like a block of E ≥ 2 experts (:func:`experts_shape`): its parameters stacked along a
    leading expert dimension (``listed`` None: own parameters (E, out, in), (E, out), …), or a ModuleList
    ``listed`` of E experts with the same parameter names and shapes (``suffixes``: one expert's names)."""

    E: int
    suffixes: tuple[str, ...]
    listed: str | None = None

    def local(self, suffix: str, e: int) -> str:
        """The module-local name of expert e's tensor ``suffix`` (the stacked tensor itself when not listed)."""
        return suffix if self.listed is None else f"{self.listed}.{e}.{suffix}"

    def names(self) -> frozenset[str]:
        """Every module-local parameter name the experts hold."""
        return frozenset(self.local(sx, e) for sx in self.suffixes for e in range(self.E if self.listed else 1))

    def stacks(self, module: nn.Module) -> dict[str, Tensor]:
        """suffix → (E, …) detached values of every expert's tensor."""
        if self.listed is None:
            return {sx: module.get_parameter(sx).detach() for sx in self.suffixes}
        experts = module.get_submodule(self.listed)
        return {sx: torch.stack([x.get_parameter(sx).detach() for x in experts]) for sx in self.suffixes}


def experts_shape(module: nn.Module) -> Experts | None:
    """The module's experts when it is shaped like a block of E ≥ 2 experts whose forward takes a routing (more
    than the hidden states), else None: either its own parameters (at least one) all stacked along a leading
    dimension E (every one at least 2-D, one 3-D) and no parametrised submodules, or no own parameters and one
    parametrised child, a ModuleList of E modules with the same parameter names and shapes that the module calls
    experts (the list's attribute name or an integer attribute equal to E says "expert": an encoder's stack of
    layers is a ModuleList of look-alikes too). Only the shape:
    :func:`_routed_experts_rule` verifies at the call what the forward does with them."""
    if getattr(module, "_is_expert_parallel", False) or not _takes_routing(module):
        return None
    own = list(module.named_parameters(recurse=False))
    holders = [(n, c) for n, c in module.named_children() if next(c.parameters(), None) is not None]
    if own:
        shapes = [p.shape for _, p in own]
        if holders or any(len(sh) < 2 for sh in shapes) or not any(len(sh) == 3 for sh in shapes):
            return None
        E = shapes[0][0]
        return Experts(E, tuple(n for n, _ in own)) if E >= 2 and all(sh[0] == E for sh in shapes) else None
    if len(holders) != 1 or not isinstance(holders[0][1], nn.ModuleList) or len(holders[0][1]) < 2:
        return None
    attr, experts = holders[0]
    counted = any("expert" in k and type(v) is int and v == len(experts) for k, v in vars(module).items())
    if "expert" not in attr and not counted:  # a stack of layers is a ModuleList of look-alikes too
        return None
    first = [(n, p.shape) for n, p in experts[0].named_parameters()]
    if any([(n, p.shape) for n, p in x.named_parameters()] != first for x in experts):
        return None
    return Experts(len(experts), tuple(n for n, _ in first), attr)


# Per experts module taken by _routed_experts_rule: "routed" once its forward passed the probe
# (_routed_separates), "replay" when it did not (the module replay, generic_rule, takes it from then on).
_ROUTED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def experts_path(module: nn.Module) -> str | None:
    """How the per-sample gradients of an experts module recognised by structure (:func:`experts_shape`) are
    taken after its first call: "routed" (one batched backward of its forward with the experts widened per
    sample, :func:`_routed_experts_rule`) or "replay" (:func:`generic_rule`); None before its first call."""
    return _ROUTED.get(module)


def _routing_leaf(leaves: list, rows: int, E: int) -> int | None:
    """The position in a call's pytree leaves of its routing: the first integer tensor of shape (rows, K) (or
    (…, K) with rows positions) whose ids lie in [−1, E] (E: a "no expert" sentinel)."""
    for i, t in enumerate(leaves):
        integer = isinstance(t, Tensor) and not t.is_floating_point() and t.dtype is not torch.bool
        if (
            integer
            and t.dim() >= 2
            and t.numel()
            and t[..., 0].numel() == rows
            and -1 <= int(t.min()) <= int(t.max()) <= E
        ):
            return i
    return None


class _Copy(nn.Module):
    """One widened expert of a listed block: the expert module's forward with other values of its tensors."""

    def __init__(self, expert: nn.Module, params: dict[str, Tensor]) -> None:
        super().__init__()
        self._expert = (expert,)  # not a submodule: its parameters stay the block's
        self._params = params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self._expert[0], self._params, args, kwargs)


def _widened(module: nn.Module, ex: Experts, wide: int, stacks: dict[str, Tensor], leaves: list, spec: Any) -> Any:
    """The module's forward on the call's ``leaves`` with ``wide`` experts, wide expert i holding ``stacks``' row
    i (suffix → (wide, …)) and being expert i // (wide / E) of the module; every integer attribute named like an
    expert count that equals E is set to ``wide`` meanwhile. Its floating outputs."""
    counts = [k for k, v in vars(module).items() if "expert" in k and type(v) is int and v == ex.E]
    args, kwargs = tree_unflatten(leaves, spec)
    original = module._modules.get(ex.listed) if ex.listed is not None else None
    try:
        for k in counts:
            setattr(module, k, wide)
        if ex.listed is None:
            with _reparametrize_module(module, stacks):
                return float_outputs(module.forward(*args, **kwargs))
        per = wide // ex.E
        copies = [_Copy(original[i // per], {sx: t[i] for sx, t in stacks.items()}) for i in range(wide)]
        module._modules[ex.listed] = nn.ModuleList(copies)
        return float_outputs(module.forward(*args, **kwargs))
    finally:
        for k in counts:
            setattr(module, k, ex.E)
        if original is not None:
            module._modules[ex.listed] = original


def _routed_separates(
    module: nn.Module, ex: Experts, B: int, wide: dict[str, Tensor], leaves: list, spec: Any, at: int, ids: Tensor
) -> bool:
    """The probe that makes :func:`_routed_experts_rule` exact for this forward: with every expert's tensors
    copied per sample (expert e of sample n is wide expert e·B + n) and the routing ids remapped to match
    (``ids``), the forward gives the same outputs as with the module's own experts, and moving the copies of one
    sample (the first and the last, each in turn) moves that sample's rows only: each sample's rows then depend
    on its own copies alone, so one backward gives every sample's gradient in the copies' blocks."""
    with torch.no_grad():
        base = _widened(module, ex, ex.E, ex.stacks(module), leaves, spec)
        remapped = list(leaves)
        remapped[at] = ids
        same = _widened(module, ex, ex.E * B, wide, remapped, spec)
        scale = max((float(o.abs().max()) for o in base if o.numel()), default=0.0)
        if len(same) != len(base) or not base or scale == 0.0:
            return False
        if any(
            a.shape != b.shape or float((a - b).abs().max()) > 1e-5 * scale for a, b in zip(same, base, strict=True)
        ):
            return False
        gen = torch.Generator(device="cpu").manual_seed(0)
        for n in sorted({0, B - 1}):
            moved = {}
            for sx, w in wide.items():
                noise = torch.randn(w[n::B].shape, generator=gen).to(w.device, w.dtype)
                moved[sx] = w.clone()
                moved[sx][n::B] *= 1.0 + 0.5 * noise
            out = _widened(module, ex, ex.E * B, moved, remapped, spec)
            for a, b in zip(out, same, strict=True):
                d = (a - b).reshape(B, -1).abs().amax(1)  # per sample, how far its rows moved
                others = torch.cat([d[:n], d[n + 1 :]])
                if float(d[n]) == 0.0 or (others.numel() and float(others.max()) > 1e-6 * scale):
                    return False
    return True


@full_call
def _routed_experts_rule(
    module: nn.Module, x: Tensor, g: Tensor | tuple[Tensor, ...], slot_of: Slot, call: Call
) -> None:
    """Experts recognised by what they do (any module :func:`experts_shape` accepts): a forward that routes its
    rows to E experts by the routing ids of its call (``weight[e]`` on each expert's gathered rows, grouped or
    batched matmuls over per-expert slices, a ModuleList of expert modules called on gathered rows, …).

    Every expert's tensors are copied per sample, (E, …) → (E·B, …) with expert e of sample n at row e·B + n
    (a listed block: a ModuleList of E·B functional copies of its experts), and each routed id e of a row of
    sample n becomes e·B + n (ids outside [0, E) keep their meaning: E → E·B). The module's own forward on these
    is one batched forward with E·B experts; one backward of it against the output gradient ``g`` gives, in the
    copies' gradient (E·B, …) → (B, E, …), every sample's gradient: sample n's rows touch only its own copies,
    which the probe :func:`_routed_separates` verified once per module (else the module takes
    :func:`generic_rule` from then on). The routing weights are constants here (the router has its own rule).
    Computed in float32; the call's rows are sample-major (B·T rows, sample n owns [n·T, (n+1)·T)).
    """
    cots = (g,) if isinstance(g, Tensor) else tuple(g)
    B = cots[0].shape[0]
    ex = experts_shape(module)
    asked: dict[str, tuple[Tensor, bool] | None] = {}  # a view is asked for once (the next ask would accumulate)
    slot = Slot(lambda pn: asked[pn] if pn in asked else asked.setdefault(pn, slot_of(pn)))
    if ex is None or _ROUTED.get(module) == "replay" or call.outer or not call.args:
        return generic_rule(module, x, g, slot, call)
    leaves, spec = tree_flatten((call.args, call.kwargs))
    hidden = leaves[0]
    rows = hidden[..., 0].numel() if isinstance(hidden, Tensor) and hidden.dim() >= 2 else 0
    at = _routing_leaf(leaves, rows, ex.E) if rows and rows % B == 0 else None
    if at is None:
        _ROUTED[module] = "replay"
        return generic_rule(module, x, g, slot, call)
    index, E = leaves[at], ex.E
    sample = (torch.arange(rows, device=index.device) // (rows // B)).reshape(index.shape[:-1] + (1,))
    inside = (index >= 0) & (index < E)
    ids = torch.where(inside, index * B + sample, torch.where(index < 0, index, index + E * (B - 1)))
    leaves = [t.to(torch.float32) if isinstance(t, Tensor) and t.dtype in _LOW else t for t in leaves]
    wide = {
        sx: t.to(torch.float32).unsqueeze(1).expand(E, B, *t.shape[1:]).reshape(E * B, *t.shape[1:])
        for sx, t in ex.stacks(module).items()
    }
    if module not in _ROUTED:
        try:
            ok = _routed_separates(module, ex, B, wide, leaves, spec, at, ids)
        except Exception:  # a forward that cannot run with E·B experts: the module replay
            ok = False
        _ROUTED[module] = "routed" if ok else "replay"
        if not ok:
            return generic_rule(module, x, g, slot, call)
    # (suffix, expert) → the slot of each selected tensor
    slots = {
        (sx, e): s
        for sx in ex.suffixes
        for e in range(E if ex.listed else 1)
        if (s := slot(ex.local(sx, e))) is not None
    }
    wanted = tuple(dict.fromkeys(sx for sx, _ in slots))
    leaves[at] = ids
    with torch.enable_grad():
        wide = {sx: w.requires_grad_(sx in wanted) for sx, w in wide.items()}
        outs = _widened(module, ex, E * B, wide, leaves, spec)
        pairs = [(o, c.reshape(o.shape).to(o.dtype)) for o, c in zip(outs, cots, strict=True) if o.requires_grad]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [wide[sx] for sx in wanted], [c for _, c in pairs], allow_unused=True
        )
    per = {}
    for sx, gr in zip(wanted, grads, strict=True):
        gr = wide[sx].new_zeros(wide[sx].shape) if gr is None else gr
        per[sx] = gr.reshape(E, B, *gr.shape[1:]).transpose(0, 1)  # (B, E, …): sample n's gradient
    for (sx, e), (view, first) in slots.items():
        blocks = per[sx] if ex.listed is None else per[sx][:, e]
        if first:
            view.copy_(blocks)
        else:
            view.add_(blocks)


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


_EXACT: dict[type, tuple[Rule, frozenset[str]]] = {
    nn.Linear: (_linear_rule, frozenset({"weight", "bias"})),
    FalconLinear: (_linear_rule, frozenset({"weight", "bias"})),  # input @ weight.T + bias: the same map
    Conv1D: (_conv1d_rule, frozenset({"weight", "bias"})),
    nn.Embedding: (_embedding_rule, frozenset({"weight"})),
    nn.LayerNorm: (_layernorm_rule, frozenset({"weight", "bias"})),
    nn.RMSNorm: (_torch_rmsnorm_rule, frozenset({"weight"})),
    **_scaled_embeddings(),
}


def writes_weight_in_row_chunks(module: nn.Module) -> bool:
    """Whether the module's rule asks ``slot.rows`` for its weight (Linear, Falcon's Linear, GPT-2 Conv1D, the
    embeddings)."""
    found = rule_for(module)
    return not isinstance(found, str) and found[0] in (
        _linear_rule,
        _conv1d_rule,
        _embedding_rule,
        _scaled_embedding_rule,
    )


def folds_in_row_chunks(owners: list[nn.Module]) -> bool:
    """Whether the fused reduction forms a weight's per-sample block in row chunks, given the modules that own it:
    one whose rule writes its weight in chunks (:func:`writes_weight_in_row_chunks`), or two (a tied embedding),
    one of them writing in chunks and the other's rule adding rows to them (:func:`adds_rows`)."""
    if len(owners) == 1:
        return writes_weight_in_row_chunks(owners[0])
    if len(owners) != 2:
        return False
    adds = [not isinstance(f := rule_for(m), str) and hasattr(f[0], "row_adder") for m in owners]
    return any(adds[i] and writes_weight_in_row_chunks(owners[1 - i]) for i in range(2))


def writes_row_parts(module: nn.Module) -> bool:
    """Whether the module's rule writes only the rows of a row-cut block (marked by :func:`row_parts`)."""
    found = rule_for(module)
    return not isinstance(found, str) and getattr(found[0], "row_parts", False)


def rule_for(module: nn.Module) -> tuple[Rule, frozenset[str]] | str:
    """The module's rule and the parameter names it covers, or the reason it has none.

    Fast rules by exact class (and verified forward source for RMSNorms and fused experts); any other
    module gets :func:`generic_rule` over its own parameters (a module with parametrised submodules too:
    they keep their own rules, and its forward is replayed per sample with them as constants).
    """
    cls = type(module)
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
        return "max_norm and scale_grad_by_freq change the gradient and have no per-sample rule"
    if cls in _EXACT:
        return _EXACT[cls]
    if _rmsnorm_style(cls) is not None:
        return rmsnorm_rule, frozenset({"weight"})
    if _fused_experts_ok(module):
        return _experts_rule, _experts_params(module)
    if (experts := experts_shape(module)) is not None:
        return _routed_experts_rule, experts.names()
    own = frozenset(pn for pn, _ in module.named_parameters(recurse=False))
    return generic_rule, own
