"""Per-sample rules of experts blocks: a module whose forward sends each row to some of its E experts by the
routing ids of its call (top-k index and weights from a router that has its own rule), or every row to every
expert (Llama 4's).

:func:`covgrad.scores.binding.rule_for` gives such a block one of three rules. transformers' fused experts, recognised
by the source text of their forward and gate (:func:`_fused_experts_ok`: Qwen3-MoE's, shared by Mixtral, OLMoE,
Qwen2-MoE, DeepSeek, …, and GPT-OSS's), take :func:`_experts_rule`: closed-form per-sample products over the routed
(token, k) pairs sorted by (expert, sample), as segmented GEMMs (:class:`_Groups`); in a pass of
:class:`covgrad.scores.engine.PerSampleGrads` they run as one autograd node (:class:`_FusedExperts`,
:func:`fused_forward`) whose forward the rule reads and whose backward reuses the rule's δ. Llama 4's dense experts
take :func:`covgrad.scores.dense_experts._dense_experts_rule`, the same way. An experts block of any other class is
recognised by its shape (:func:`experts_shape`: parameters stacked along a leading expert dimension, or a ModuleList of
E look-alike experts) and takes :func:`_routed_experts_rule`, which runs its own forward once with every expert copied
per sample (E·B experts), verified once per module by a probe (:func:`_routed_separates`); where the probe fails the
module replay (:func:`covgrad.scores.rules.generic_rule`) takes it from then on (:func:`experts_path` says which).

Shape notation: B samples in the batch, T positions per sample, E experts, K routed experts per token, H hidden
size, I intermediate size, m routed (token, k) pairs of the batch.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from covgrad.scores.activations import act_vjp, clamp_mask, glu_forward, glu_vjp
from covgrad.scores.rules import _LOW, Call, Slot, _source_key, float_outputs, full_call, generic_rule

try:  # fused expert tensors arrived with transformers 5; older versions keep one Linear per expert
    from transformers.integrations.moe import _default_apply_gate
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
except ImportError:
    _default_apply_gate = Qwen3MoeExperts = None
try:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
except ImportError:
    GptOssExperts = None


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
    """Rows (m, ·) sorted by a group id (``group`` (m,) int64 in [0, n), non-decreasing; ``counts`` (n,) rows per
    group), and the segmented products over them: torch's grouped GEMM where the device has it for float32, else
    batched matmuls over zero-padded per-group blocks (n, M, ·), M the largest group's size."""

    def __init__(self, group: Tensor, counts: Tensor) -> None:
        self.group, self.counts, self.n = group, counts, counts.numel()
        self.offs = torch.cumsum(counts, 0).to(torch.int32)

    def _rank(self) -> Tensor:
        """(m,) each row's position in its group."""
        start = (self.offs.long() - self.counts)[self.group]
        return torch.arange(self.group.numel(), device=self.group.device) - start

    def _pack(self, rows: Tensor, rank: Tensor) -> Tensor:
        out = rows.new_zeros(self.n, int(self.counts.max()), *rows.shape[1:])
        out[self.group, rank] = rows
        return out

    def times(self, rows: Tensor, weights: Tensor) -> Tensor:
        """(m, k) rows, each times its group's matrix of ``weights`` (n, k, q): (m, q), column-major from the
        grouped GEMM (a gate's halves or interleaved columns are then runs of m contiguous values)."""
        out = _grouped_mm(weights.transpose(1, 2), rows.t(), self.offs)
        if out is not None:
            return out.t()
        rank = self._rank()
        return torch.bmm(self._pack(rows, rank), weights)[self.group, rank]

    def outer_sums(self, left: Tensor, right: Tensor) -> Tensor:
        """Per group Σ_r left_r right_rᵀ over its rows: left (m, p), right (m, q) → (n, p, q)."""
        out = _grouped_mm(left.t(), right, self.offs)
        if out is not None:
            return out
        rank = self._rank()
        return torch.bmm(self._pack(left, rank).transpose(1, 2), self._pack(right, rank))


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor | None:
    """``torch._grouped_mm(a, b, offs=offs)``, or None where it cannot run: the device has no grouped GEMM for the
    dtype (remembered in :data:`_GROUPED_MM`), or this call's operands have strides that are not multiples of 16
    bytes (an odd number of routed pairs: this call only)."""
    key = (a.device.type, a.dtype)
    if not _GROUPED_MM.get(key, True):
        return None
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, AttributeError) as exc:
        if "stride" not in str(exc):
            _GROUPED_MM[key] = False
        return None


# (device type, dtype) pairs where torch._grouped_mm failed for another reason than an operand's strides (False):
# _Groups pads instead there. Keyed by dtype too: a bf16 model's forward through the node must not take the float32
# grouped GEMM away from the rules.
_GROUPED_MM: dict[tuple[str, torch.dtype], bool] = {}


@functools.lru_cache(maxsize=32)
def _pair_samples(m: int, per_sample: int, device: torch.device) -> Tensor:
    """The sample of each of m routed (token, k) pairs, sample n owning ``per_sample`` consecutive pairs: (m,)
    int64, cached per shape."""
    return torch.div(torch.arange(m, device=device), per_sample, rounding_mode="floor")


class _Routes:
    """A call's m = B·T·K routed (token, k) pairs sorted by (expert e, sample n) group g = e·B + n, and the
    segmented products over them (:class:`_Groups`): per expert for the experts' products, per group for the
    per-sample outer products and sums. One stable sort by expert gives that order (the pairs are sample-major),
    and the shapes stay static: ids outside [0, E) (a router's padding) keep their pair, with weight 0, in expert
    min(max(id, 0), E − 1), where they add exact zeros; no host synchronisation on a device with grouped GEMMs.
    """

    def __init__(self, index: Tensor, weights: Tensor, B: int, E: int) -> None:
        """``index`` (B·T, K) expert ids and ``weights`` (B·T, K) routing weights of sample-major tokens."""
        K, m = index.shape[1], index.numel()
        ids = index.reshape(-1).long()
        expert = ids.clamp(0, E - 1)
        self.valid = expert == ids  # (m,) in pair order: the pair is routed to an expert
        self.w = torch.where(self.valid, weights.reshape(-1), 0.0)  # (m,) in pair order
        expert, order = torch.sort(expert, stable=True)
        self.order, self.tok = order, torch.div(order, K, rounding_mode="floor")  # (m,) pair, token of sorted row
        group = expert * B + _pair_samples(m, m // B, index.device).index_select(0, order)  # (m,) non-decreasing
        counts = torch.bincount(group, minlength=E * B)  # (E·B,)
        self.by_expert = _Groups(expert, counts.reshape(E, B).sum(1))
        self.by_pair = _Groups(group, counts)

    def rows(self, t: Tensor, scale: Tensor | None = None) -> Tensor:
        """Each sorted pair's row of token rows ``t`` (B·T, q), times its weight in ``scale`` (m,), pair order,
        where given: (m, q)."""
        r = t.index_select(0, self.tok)
        return r if scale is None else r * scale.index_select(0, self.order)[:, None]

    def times(self, rows: Tensor, weights: Tensor, bias: Tensor | None = None) -> Tensor:
        """Sorted rows (m, k), each times its expert's matrix of ``weights`` (E, k, q) plus its row of ``bias``
        (E, q): (m, q), column-major (:meth:`_Groups.times`)."""
        out = self.by_expert.times(rows, weights)
        if bias is None:
            return out
        return (out.t() + bias.t().index_select(1, self.by_expert.group)).t()  # added in the column-major layout

    def outer_sums(self, left: Tensor, right: Tensor) -> Tensor:
        """Per (expert, sample) Σ left_r right_rᵀ over its sorted rows: left (m, p), right (m, q) → (E·B, p, q)."""
        return self.by_pair.outer_sums(left, right)

    def sums(self, rows: Tensor) -> Tensor:
        """Per (expert, sample) Σ of sorted rows (m, q): (E·B, q) (from row-major rows: index_add_ of a column-major
        operand runs element by element)."""
        return rows.new_zeros(self.by_pair.n, rows.shape[1]).index_add_(0, self.by_pair.group, rows.contiguous())


# Gates of the form u(up) ⊙ f(gate) on two sets of the columns that _gate takes apart, by their source
# (:func:`_source_key`: no comments, no whitespace): the end of transformers' default gate (act_fn(gate) ⊙ up on
# the [gate; up] halves) and GPT-OSS's whole one ((clamp(up) + 1) ⊙ glu(gate) on interleaved columns).
_DEFAULT_GATE_BODY = "gate,up=gate_up_out.chunk(2,dim=-1)returnself.act_fn(gate)*up"
_GPT_OSS_GATE = (
    "def_apply_gate(self,gate_up:torch.Tensor)->torch.Tensor:gate,up=gate_up[...,::2],gate_up[...,1::2]"
    "gate=gate.clamp(min=None,max=self.limit)up=up.clamp(min=-self.limit,max=self.limit)"
    "glu=gate*torch.sigmoid(gate*self.alpha)gated_output=(up+1)*glureturngated_output"
)


@functools.cache
def _gate_form(cls: type) -> str | None:
    """The form of the class's gate: "default" (transformers' default gate, that function), "gpt-oss" (GPT-OSS's,
    by its source), or None (another function, which :func:`_gate` differentiates whole)."""
    gate = getattr(cls, "_apply_gate", None)
    key = _source_key(gate) if gate is not None else None
    if key is None:
        return None
    if gate is _default_apply_gate and key.endswith(_DEFAULT_GATE_BODY):
        return "default"
    return "gpt-oss" if key == _GPT_OSS_GATE else None


def _gate(module: nn.Module, gu: Tensor, da: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The module's gate on the rows ``gu`` (m, 2I): its output (m, I) and, where the output gradient ``da``
    (m, I) is given, its vector-Jacobian product (m, 2I), in the layout of ``gu``. A gate u(up) ⊙ f(gate) of a
    known form (:func:`_gate_form`) differentiates the product, u and f by the operations and kernels autograd
    runs for them (:mod:`covgrad.scores.activations`); any other gate is differentiated whole by autograd."""
    form = _gate_form(type(module))
    if form is None:
        with torch.enable_grad():
            gu = gu.detach().requires_grad_()
            act = module._apply_gate(gu)
            dgu = None if da is None else torch.autograd.grad(act, gu, da)[0]
        return act.detach(), dgu

    def halves(t: Tensor) -> tuple[Tensor, Tensor]:
        return t.chunk(2, dim=-1) if form == "default" else (t[..., ::2], t[..., 1::2])

    gate, up = halves(gu)
    if form == "default":
        f, factor = module.act_fn(gate), up
    else:
        limit, alpha = module.limit, module.alpha
        f, c, s = glu_forward(gate, limit, alpha)
        factor = up.clamp(min=-limit, max=limit) + 1
    act = f * factor
    if da is None:
        return act, None
    dgu = torch.empty_like(gu)
    d_gate, d_up = halves(dgu)
    if form == "gpt-oss":
        clamp_mask(da * f, up, -limit, limit, out=d_up)
        glu_vjp(gate, c, s, da * factor, limit, alpha, out=d_gate)
    else:
        torch.mul(da, f, out=d_up)
        act_vjp(module.act_fn, gate, da * factor, out=d_gate)
    return act, dgu


def _fused_weights(module: nn.Module) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The module's (E, k, q) matrices of the forward products xe ↦ gate_up and act ↦ down (stored transposed or
    not), and its biases (E, 2I), (E, H) where it has them, detached, in the module's dtype."""
    transposed, bias = getattr(module, "is_transposed", False), getattr(module, "has_bias", False)
    W_gu, W_d = module.gate_up_proj.detach(), module.down_proj.detach()
    if not transposed:
        W_gu, W_d = W_gu.transpose(1, 2), W_d.transpose(1, 2)
    b_gu = module.gate_up_proj_bias.detach() if bias else None
    b_d = module.down_proj_bias.detach() if bias else None
    return W_gu, W_d, b_gu, b_d


def _fused_weights32(module: nn.Module) -> tuple[Tensor | None, ...]:
    """:func:`_fused_weights` in float32 (the rules' and the node's backward's products)."""
    return tuple(w.to(torch.float32) if w is not None else None for w in _fused_weights(module))


@dataclass
class _FusedCall:
    """What one call of fused experts run by :class:`_FusedExperts` kept of its forward, for its rule and its
    backward: the routing, the input rows (B·T, H), and per sorted (token, k) pair the gate's input gu (m, 2I),
    its output act (m, I) and the expert's output y (m, H) before the routing weight, in the module's dtype.
    ``dgu`` (m, 2I) float32 and ``weights`` (:func:`_fused_weights` in float32) are set by the rule for the backward
    that follows it, which takes and clears them (a bf16 model's experts are cast once per backward, not twice);
    only where that backward runs (``backward``: the node is in the graph)."""

    routes: _Routes
    x: Tensor
    gu: Tensor
    act: Tensor
    y: Tensor
    dgu: Tensor | None = None
    weights: tuple[Tensor | None, ...] | None = None
    backward: bool = False


class _FusedExperts(torch.autograd.Function):
    """Fused experts' forward (the map of :func:`_experts_rule`) as one autograd node, so that the rule and the
    backward share one product per step: the forward keeps gu, act and y (:class:`_FusedCall`); the rule, run
    from the output's gradient hook before this node's backward, computes δ = ∂gu once and leaves it here; the
    backward then forms ∂x = Σ_k δ G_e and ∂w_{t,k} = ⟨g_t, y_{t,k}⟩ only. The experts' weights are constants
    (frozen during the pass). Per step: two grouped GEMMs forward, two for ∂a and ∂x, two for the per-sample
    outer products (a batched backward through transformers' forward: two forward, four backward)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        module: nn.Module,
        B: int,
        hidden: Tensor,
        index: Tensor,
        weights: Tensor,
    ) -> Tensor:
        H = hidden.shape[-1]
        x = hidden.detach().reshape(-1, H)  # (B·T, H)
        routes = _Routes(
            index.reshape(x.shape[0], -1), weights.detach().reshape(x.shape[0], -1).float(), B, module.num_experts
        )
        W_gu, W_d, b_gu, b_d = _fused_weights(module)
        gu = routes.times(routes.rows(x), W_gu, b_gu)  # (m, 2I)
        act, _ = _gate(module, gu, None)
        y = routes.times(act, W_d, b_d)  # (m, H)
        scaled = y * routes.w.index_select(0, routes.order).to(y.dtype)[:, None]
        out = x.new_zeros(x.shape).index_add_(0, routes.tok, scaled)
        saved = _FusedCall(routes, x, gu, act, y)
        ctx.module, ctx.saved, ctx.shapes = module, saved, (hidden.shape, hidden.dtype, weights.shape, weights.dtype)
        out = out.reshape(hidden.shape)
        out.covgrad_state = saved
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: Tensor) -> tuple[Tensor | None, ...]:
        saved, module = ctx.saved, ctx.module
        routes, (shape, dtype, w_shape, w_dtype) = saved.routes, ctx.shapes
        go = g.reshape(saved.x.shape).to(torch.float32)
        (W_gu, W_d, _, _), saved.weights = saved.weights or _fused_weights32(module), None
        dgu, saved.dgu = saved.dgu, None
        if dgu is None:  # the rule did not run for this backward (its tensors refused, or a probe's backward)
            da = routes.times(routes.rows(go, routes.w), W_d.transpose(1, 2))
            _, dgu = _gate(module, saved.gu.to(torch.float32), da)
        dx = None
        if ctx.needs_input_grad[2]:
            dxe = routes.times(dgu, W_gu.transpose(1, 2))  # (m, H)
            dx = go.new_zeros(go.shape).index_add_(0, routes.tok, dxe.contiguous()).to(dtype).reshape(shape)
        dw = None
        if ctx.needs_input_grad[4]:
            per_pair = (routes.rows(go) * saved.y.to(torch.float32)).sum(1)  # (m,) sorted
            dw = torch.zeros_like(per_pair).index_copy_(0, routes.order, per_pair)
            dw = torch.where(routes.valid, dw, 0.0).reshape(w_shape).to(w_dtype)
        return None, None, dx, None, dw


class _Restore:
    """The handle of :func:`fused_forward`: ``remove()`` gives the module its class's forward back."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def node_forward(owner: Any, module: nn.Module, run: Callable[[tuple, dict, int], Tensor | None]) -> _Restore:
    """Replace ``module``'s forward on the instance, until the returned handle's ``remove()``, by ``run(args,
    kwargs, B)`` (an autograd node's output carrying ``covgrad_state``, or None to decline the call) in the passes
    of ``owner`` (a :class:`covgrad.scores.engine.PerSampleGrads`, whose ``_blocks.B`` is the call's batch). A call
    made while a rule re-runs a forward or the op taps probe rows, or that ``run`` declines, runs the class's
    forward."""
    original = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        B = owner._blocks.B
        out = None if owner._replaying or owner._probing or B < 1 else run(args, kwargs, B)
        if out is None:
            return original(module, *args, **kwargs)
        out.covgrad_state.backward = out.grad_fn is not None
        return out

    module.forward = forward
    return _Restore(module)


def fused_forward(owner: Any, module: nn.Module) -> _Restore:
    """Run a fused-experts module (:func:`_fused_experts_ok`) as :class:`_FusedExperts` in the passes of
    ``owner`` (:func:`node_forward`); a call whose rows are not a whole number per sample runs the class's
    forward."""

    def run(args: tuple, kwargs: dict, B: int) -> Tensor | None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if (hidden.numel() // hidden.shape[-1]) % B:
            return None
        call = Call(args, kwargs, False)
        index, weights = _call_arg(call, 1, "top_k_index"), _call_arg(call, 2, "top_k_weights")
        return _FusedExperts.apply(module, B, hidden, index, weights)

    return node_forward(owner, module, run)


def _routed(x: Tensor, call: Call, B: int, E: int) -> tuple[_Routes, Tensor]:
    """The routes of an experts call on x (B, T, H) (its ``top_k_index`` and ``top_k_weights``, (B·T, K) each; sample
    n owns rows [n·T, (n+1)·T)) and each sorted pair's input row (m, H), in float32."""
    h = x.reshape(-1, x.shape[-1]).to(torch.float32)
    index = _call_arg(call, 1, "top_k_index").reshape(h.shape[0], -1)
    weights = _call_arg(call, 2, "top_k_weights").reshape(h.shape[0], -1).to(torch.float32)
    routes = _Routes(index, weights, B, E)
    return routes, routes.rows(h)


def _write_groups(s: tuple[Tensor, bool] | None, blocks: Tensor, E: int, B: int) -> None:
    """s's (B, E, …) view (None: not selected) = (``s[1]``) or += ``blocks`` (E·B, …), one per (expert, sample)
    group, expert-major."""
    if s is None:
        return
    blocks = blocks.reshape(E, B, *blocks.shape[1:]).transpose(0, 1)
    if s[1]:
        s[0].copy_(blocks)
    else:
        s[0].add_(blocks)


@full_call
def _experts_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot, call: Call) -> None:
    """Fused experts: out_t = Σ_k w_{t,k} [D_e a(G_e x_t + b_e) + c_e] with e = index_{t,k} and a the module's
    gate (act(gate) ⊙ up; biases b, c only where the module has them; D, G stored transposed where it says so).

    Per sample and expert, ∂D_e = Σ_{(t,k)→e} (w_{t,k} g_t) a_tᵀ, ∂c_e = Σ w_{t,k} g_t, ∂G_e = Σ δ_t x_tᵀ and
    ∂b_e = Σ δ_t with δ the gate's vector-Jacobian product; only the sample's own tokens routed to e
    contribute. Computed in float32 on the routed (token, k) pairs sorted by (expert, sample) (:class:`_Routes`):
    the experts' forward and δ as one segmented product per expert, the per-sample outer products and sums as one
    per (expert, sample); δ by hand where the gate's form is known (:func:`_gate`). The router weights w are
    constants here (the router has its own rule). A call run by :class:`_FusedExperts` (``call.state``) takes
    its routing, gu and a from the forward and leaves δ for that node's backward.
    """
    B, H = g.shape[0], x.shape[-1]
    go = g.reshape(-1, H).to(torch.float32)
    E, saved = module.num_experts, call.state
    transposed, bias = getattr(module, "is_transposed", False), getattr(module, "has_bias", False)
    s_gu, s_d = slot("gate_up_proj"), slot("down_proj")
    s_gub = slot("gate_up_proj_bias") if bias else None
    s_db = slot("down_proj_bias") if bias else None
    W_gu, W_d, b_gu, _ = weights32 = _fused_weights32(module)
    if saved is not None:
        routes = saved.routes
        xe = routes.rows(saved.x).to(torch.float32)  # (m, H) each sorted pair's input
        gu = saved.gu.to(torch.float32)  # (m, 2I)
    else:
        routes, xe = _routed(x, call, B, E)
        gu = routes.times(xe, W_gu, b_gu)
    do = routes.rows(go, routes.w)  # (m, H) the gradient of its expert's weighted output
    da = None  # (m, I): gradient of each pair's gate output
    if s_gu is not None or s_gub is not None or saved is not None:
        da = routes.times(do, W_d.transpose(1, 2))
    act, dgu = _gate(module, gu, da)
    if saved is not None:
        act = saved.act.to(torch.float32)
        if saved.backward:
            saved.dgu, saved.weights = dgu, weights32

    def write(s: tuple[Tensor, bool] | None, blocks: Tensor) -> None:
        _write_groups(s, blocks, E, B)

    if s_d is not None:
        write(s_d, routes.outer_sums(act, do) if transposed else routes.outer_sums(do, act))
    if s_gu is not None:
        write(s_gu, routes.outer_sums(xe, dgu) if transposed else routes.outer_sums(dgu, xe))
    if s_db is not None:
        write(s_db, routes.sums(do))
    if s_gub is not None:
        write(s_gub, routes.sums(dgu))


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
