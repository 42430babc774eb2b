"""Exact per-sample scores of a causal LM from one batched forward and one backward.

The score of sample n is the gradient of *its own* objective, the sum over its scored response tokens
of the (centered) token log-probability: s_n = ∇θ Σ_t w_t [z_{t-1,y_t} − Σ_v q_v z_{t-1,v}] / τ. It is
neither divided by the number of tokens T nor by the batch size N, so Fisher and covariance built from
it are in per-sample units; a mean loss would scale every score by 1/T_n (and the ordinary batched
gradient by 1/N).

How: forward hooks on the modules that own the selected parameters save each module's input, and
a tensor hook on the module's output receives ∂objective/∂output during the backward; a per-module rule
(:mod:`covgrad.scores.rules`: Linear, GPT-2 Conv1D, Embedding, LayerNorm, RMSNorm, fused experts, and the generic
per-sample vector-Jacobian product of any other module's forward) turns the pair into every sample's
parameter gradient. The first call traces one forward of two samples: a parameter used outside the
forward of the module that owns it (a weight its parent hands to a functional conv) moves to the smallest
module whose forward holds all its uses, and every module that runs on a flattened (B·L, …) batch or whose
forward a rule replays must keep the samples apart (checked by autograd, not by a list of classes).
During the call all parameters are frozen and the backward is taken with respect to the
outputs of the first hooked modules, so autograd never computes a batched weight gradient: the
per-sample products replace those GEMMs instead of adding to them. A parameter shared by several
modules (tied embedding and LM head) gets the sum of their contributions per sample.

Two outputs: ``__call__`` returns the (B, P) float32 rows; ``accumulate`` (the scores stage's fused
reduction) folds each tensor's (B, numel) block into a :class:`covgrad.moments.accum.MomentAccumulator` as soon
as its last contribution of the backward has arrived (modules' forward calls are counted, so tied and
repeated modules are summed first) and drops it, so no B × P buffer exists. A Linear or Conv1D weight
with one contribution is not even formed whole: its rule writes it in chunks of rows
(:func:`default_chunk_bytes`) into one reused buffer, each folded while it is still in cache rather than read
back from memory (``benchmarks/scores.py`` compares the two). ``accumulate_many`` does the same for K
objectives of one batch (the score and regimes' g, each a :class:`Cotangent` with its own accumulator): one
forward, then one backward per logit-space cotangent through the same hooks, the graph kept until the last,
each accumulator folded exactly as a separate ``accumulate`` would fold it.

Shape notation: B samples in the batch, L sequence positions (prompt, response and padding), V
vocabulary, P selected parameter elements (the flat axis of :class:`covgrad.layout.ParamLayout`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from covgrad.devices import l2_cache_bytes
from covgrad.heap import release_free_memory
from covgrad.layout import ParamLayout, TensorEntry
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.optaps import METADATA_READS, OpTaps
from covgrad.scores.rules import Call, RowAdder, Rule, Slot, float_outputs, generic_rule, rule_for

# Bytes of one row chunk of a Linear/Conv1D weight's per-sample block in the fused reduction. CPU: four times
# the core's L2 cache (2 MiB on a 512 KiB-L2 AMD EPYC, 8 MiB on a 2 MiB-L2 Xeon), within [1, 64] MiB, so the
# fold reads each chunk while it is still cached and the GEMMs stay large (benchmarks/scores.py,
# docs/measurements.md). Accelerators: large GEMMs; the chunk only bounds the block in flight.
_CPU_CHUNK_PER_L2 = 4
_CPU_CHUNK_RANGE = (1 << 20, 64 << 20)
_CPU_CHUNK_UNKNOWN_L2 = 2 << 20
_CHUNK_BYTES_DEFAULT = 256 << 20


def default_chunk_bytes(device_type: str) -> int:
    """Bytes of one row chunk of a weight's per-sample block on a device of this type ("cpu", "cuda")."""
    if device_type != "cpu":
        return _CHUNK_BYTES_DEFAULT
    l2 = l2_cache_bytes()
    if l2 is None:
        return _CPU_CHUNK_UNKNOWN_L2
    lo, hi = _CPU_CHUNK_RANGE
    return min(hi, max(lo, _CPU_CHUNK_PER_L2 * l2))


def chunk_rows(chunk_bytes: int, B: int, row: int) -> int:
    """Rows of a weight per row chunk of its (B, rows, row) float32 per-sample block: at least one."""
    return max(1, chunk_bytes // (B * row * 4))


# Largest per-sample block buffer kept for reuse (every decoder-layer block of a ~1B model fits).
_POOL_MAX_BYTES = 256 << 20

# Positions of the first call's trace (PerSampleGrads._trace): the last ones of each row (real tokens under
# left padding).
_TRACE_POSITIONS = 16

# Elements per step of the self-check's comparison of one tensor (its float64 temporaries hold this many:
# B samples × _CHECK_COLUMNS / B columns of a block converted, then the sum and the reference's columns).
_CHECK_COLUMNS = 1 << 22

# Self-check tolerance on ‖Σ_n s_n − g‖ / ‖g‖ per tensor. Low-precision models get a looser bound
# because the batched reference gradient itself is accumulated in bf16/fp16.
_CHECK_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def score_logit_grad(
    logits: Tensor,
    input_ids: Tensor,
    target_mask: Tensor,
    mu: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Gradient of every sample's score objective with respect to its logits.

    The objective of sample n is Σ_t w_t [z_{t-1,y_t} − Σ_v q_v z_{t-1,v}] / τ, where position t-1's
    logits predict token t. With ``mu=None``, q = softmax(z/τ) and this is exactly ∇ log p (policy
    centering); otherwise q = mu, a constant (sampler centering, stop-gradient on the sampler).

    Args:
        logits: shape (B, L, V), any float dtype; ``logits[:, t]`` predicts ``input_ids[:, t + 1]``.
        input_ids: shape (B, L), integer token ids.
        target_mask: shape (B, L), bool or float; weight w_t of token position t as a scored response
            token (prompt and padding positions 0; position 0 must be 0, nothing predicts it).
        mu: shape (B, L, V) sampler probabilities aligned like ``logits`` (``mu[:, t - 1]`` is the
            sampler's distribution for token t), or None for policy centering.
        temperature: τ > 0 that divides the logits.

    Returns:
        shape (B, L, V) float32: w_{t+1} (e_{y_{t+1}} − q_t) / τ at position t, zero at position L-1.

    Raises:
        ValueError: on mismatched shapes, τ ≤ 0, a scored first position, token ids outside the
            vocabulary, or sampler rows that are not probabilities.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, L, V); got {tuple(logits.shape)}")
    B, L, V = logits.shape
    if input_ids.shape != (B, L) or target_mask.shape != (B, L):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and target_mask {tuple(target_mask.shape)} must both "
            f"have the logits' (B, L) = {(B, L)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    w = target_mask.to(torch.float32)
    if bool((w[:, 0] != 0).any()):
        raise ValueError("target_mask[:, 0] must be 0 (no logit predicts the first token); shift the mask")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= V:
        raise ValueError(f"input_ids must lie in [0, {V}); got range [{int(input_ids.min())}, {int(input_ids.max())}]")
    if mu is None:
        q = torch.softmax(logits[:, :-1].to(torch.float32) / temperature, dim=-1)  # (B, L-1, V)
    else:
        if mu.shape != logits.shape:
            raise ValueError(f"mu must have the logits' shape {tuple(logits.shape)}; got {tuple(mu.shape)}")
        q = mu[:, :-1].to(torch.float32)
        scored = w[:, 1:] != 0
        row_sums = q.sum(-1)[scored]
        if bool((q[scored] < 0).any()) or bool(((row_sums - 1).abs() > 1e-3).any()):
            raise ValueError(
                "mu rows at scored positions must be probability vectors (non-negative, summing to 1); "
                "got sums in "
                f"[{float(row_sums.min()):.4g}, {float(row_sums.max()):.4g}]"
            )
    dlogits = torch.zeros(B, L, V, dtype=torch.float32, device=logits.device)
    d = dlogits[:, :-1]
    torch.neg(q, out=d)
    d.scatter_add_(-1, input_ids[:, 1:, None].long(), torch.ones_like(d[..., :1]))  # e_y − q
    d.mul_((w[:, 1:] / temperature)[..., None])
    return dlogits


Binding = tuple[nn.Module, Rule, dict[str, TensorEntry]]


@dataclass(frozen=True)
class Cotangent:
    """One objective of :meth:`PerSampleGrads.accumulate_many` and where its per-sample gradients go.

    Attributes:
        fn: maps the detached logits (B, L, V) to ∂objective/∂logits (B, L, V) (zero at unscored positions).
        acc: the accumulator its blocks are folded into (its own: no two cotangents of a pass share one).
        advantages: shape (B,), each sample's advantage in ``acc`` (zeros for a regime's g).
        half: shape (B,) integers in [0, acc.H), each sample's accumulator row.
        out: optional (B, P) float32 buffer that also receives its rows.
        done: called once the pass has folded every cotangent (e.g. to record bound scalars ``fn`` set).
    """

    fn: Callable[[Tensor], Tensor]
    acc: MomentAccumulator
    advantages: Tensor | np.ndarray
    half: Tensor | np.ndarray
    out: Tensor | None = None
    done: Callable[[], None] | None = None


# One backward of PerSampleGrads._per_sample: logit-gradient function, rows buffer, accumulator, self-check.
_Target = tuple[Callable[[Tensor], Tensor], Tensor | None, MomentAccumulator | None, "_Check | None"]


def bind_rules(model: nn.Module, layout: ParamLayout) -> list[Binding]:
    """Every module owning selected parameters, with its per-sample rule and its selected parameters
    (local name → layout entry), in ``named_modules`` order. A module whose fast rule covers only some of
    its parameters gets a second binding, :func:`covgrad.scores.rules.generic_rule` over the others.

    Raises:
        ValueError: when a selected parameter is not in the model, or (one message naming every such
            parameter, with a ``model.params`` selection without them) has no per-sample rule: owned by
            the model's top-level module or by a module whose rule refuses it.
    """
    params = dict(model.named_parameters())
    missing = [name for name in layout.names if name not in params]
    if missing:
        raise ValueError(f"layout parameters {missing[:3]} are not in the model; build the layout from it")
    by_id = {id(params[e.name]): e for e in layout.entries}
    bindings: list[Binding] = []
    refused: list[tuple[str, str]] = []
    for module_name, module in model.named_modules():
        local = {pn: by_id[id(p)] for pn, p in module.named_parameters(recurse=False) if id(p) in by_id}
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
        raise ValueError(refusal(layout, refused))
    return bindings


def refusal(layout: ParamLayout, refused: list[tuple[str, str]]) -> str:
    """One line naming every refused parameter (``(layout name, reason)`` pairs) and a ``model.params``
    selection of the layout's other parameters that runs (globs over layer indices where they stay exact)."""
    bad = {name for name, _ in refused}
    keep = [name for name in layout.names if name not in bad]
    head = (
        f"no per-sample rule for parameter {refused[0][1]}"
        if len(refused) == 1
        else f"no per-sample rule for {len(refused)} selected parameters: " + "; ".join(r for _, r in refused)
    )
    if not keep:
        return f"{head}; nothing else is selected"
    return f"{head}; a selection without them that runs: model.params = {suggest_params(keep, layout.names)}"


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


class PerSampleGrads:
    """Every sample's gradient of its own objective, flat in a layout's order, from one batched pass.

    Args:
        model: a Hugging Face causal LM (or any module called as ``model(input_ids=..., attention_mask=...,
            position_ids=..., use_cache=False)`` returning ``.logits``), in eval mode.
        layout: the selected parameters (:func:`covgrad.layout.select_parameters` on this model).
        check: on the first call, compare Σ_n s_n per tensor with the ordinary batched gradient of the
            summed objective and raise if they differ (catches a module whose forward a rule does not
            match, e.g. a Linear subclass that rescales its weight). Costs one extra forward and backward.
        chunk_bytes: bytes of one row chunk of a Linear/Conv1D weight's per-sample block in the fused
            reduction (None: :func:`default_chunk_bytes` of the device; 0: fold whole blocks). Chunks
            change the GEMM shapes, so the fp32 products may differ in their last bits from whole blocks.
        op_taps: give the parameters of generic-rule bindings their per-sample gradients at the ops that use
            them (:mod:`covgrad.scores.optaps`), falling back to the module replay where that is not shown exact;
            False: always the module replay (:func:`covgrad.scores.rules.generic_rule`).

    Raises:
        ValueError: when a selected parameter is not in the model, or has no per-sample rule (one message
            naming every such parameter and its module type, with a selection that runs). The first call
            refuses, the same way, a parameter only the model's top-level forward uses and a module that
            mixes samples or whose flattened rows are not sample by sample (see :meth:`_trace`).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        check: bool = True,
        chunk_bytes: int | None = None,
        op_taps: bool = True,
    ) -> None:
        params = dict(model.named_parameters())
        self.model = model
        self.layout = layout
        self.check = check
        self.chunk_bytes = chunk_bytes
        self._bindings = bind_rules(model, layout)
        self._params = [params[e.name] for e in layout.entries]
        self._names = {id(m): name for name, m in model.named_modules()}
        # Set by the first call's trace (_trace): parameter uses checked, and (first call with B ≥ 2) which
        # hooked modules run on a flattened (B·L, …) batch whose row n·L + t is sample n's position t.
        self._traced = False
        self._verified = False
        self._flat_ok: set[int] = set()
        self._outer: set[int] = set()  # of those, the ones with outer-major rows (see _check_apart)
        # Per-call state, set and cleared by _per_sample.
        self._B = 0
        self._L = 0
        self._replaying = False  # a rule re-runs a module's forward: the hooks of its submodules stand aside
        # covgrad.scores.optaps checks rows by autograd mid-forward: the backward hooks stand aside
        self._probing = False
        self._out: Tensor | None = None
        self._acc: MomentAccumulator | None = None
        self._check: _Check | None = None
        self._written: set[str] = set()
        self._folded: set[str] = set()
        self._pending: dict[str, int] = {}  # module calls whose backward contribution is still to come
        self._calls: dict[str, int] = {}  # module calls in the forward, per tensor (1: the block may be chunked)
        self._chunk: Tensor | None = None  # the row-chunk buffer of the fused reduction, reused
        # Fused reduction without rows: rule calls held back until their tensors' last contribution, with the
        # tensors they write (a tied embedding's LM-head product waits for the embedding's rows).
        self._deferred: list[tuple[Callable[[], None], tuple[str, ...]]] = []
        # Row adders of a tied tensor's last contribution while the held call writes its chunks (_run_rule).
        self._adders: dict[str, RowAdder] = {}
        self._blocks: dict[str, Tensor] = {}  # in-flight per-sample blocks (fused reduction without rows)
        # Whole-tensor (B, *shape) buffers of the row-cut tensors whose rule writes whole tensors only (not
        # marked by covgrad.scores.rules.row_parts): the block takes its rows from it once its contributions are in.
        self._whole: dict[str, Tensor] = {}
        # Flat float32 buffers of finished blocks, reused by the next ones: fresh large host allocations
        # page-fault on first touch (about as slow as the products themselves on a CPU). Buffers above
        # _POOL_MAX_BYTES (a tied embedding's block) are freed instead: kept, they would sit idle through
        # every forward and backward, when the activations peak.
        self._pool: list[Tensor] = []
        self._roots: list[Tensor] = []
        self._taps = OpTaps(self) if op_taps else None
        # Columns of row chunks the last call did not form (their accumulator keeps none of them), summed
        # over its backward passes.
        self.skipped_columns = 0

    def bindings(self) -> list[Binding]:
        """The modules hooked, with their rules and selected parameters (after the first call's trace, which
        may move a parameter to the module whose forward uses it)."""
        return list(self._bindings)

    def generic_paths(self) -> dict[str, str]:
        """Each generic-rule parameter (layout name) and how its per-sample gradient is taken: "op" (at the
        ops that use it, :mod:`covgrad.scores.optaps`) or "replay" (the module's forward per sample); after a call,
        which may move a module to the replay."""
        return {
            e.name: "replay" if self._taps is None else self._taps.path(module)
            for module, rule, local in self._bindings
            if rule is generic_rule
            for e in local.values()
        }

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        dlogits_fn: Callable[[Tensor], Tensor],
        position_ids: Tensor | None = None,
        *,
        out: Tensor | None = None,
    ) -> Tensor:
        """Per-sample gradients of the objective whose logit gradient ``dlogits_fn`` returns.

        Args:
            input_ids: shape (B, L) token ids (left padding allowed).
            attention_mask: shape (B, L), 1 for real tokens, 0 for padding.
            dlogits_fn: maps the detached logits (B, L, V) to ∂objective/∂logits (B, L, V), e.g.
                ``lambda z: score_logit_grad(z, input_ids, target_mask)``; zero at unscored positions.
            position_ids: shape (B, L) or None (the model's default); pass ``cumsum(mask) − 1`` with
                padding for models with absolute position embeddings.
            out: optional (B, P) float32 contiguous buffer on the inputs' device to write into and
                return; reusing one across batches avoids first-touch page faults on a fresh B·P·4-byte
                allocation.

        Returns:
            shape (B, P) float32: row n is ∇θ of sample n's objective over the layout's flat axis
            (products accumulated in float32 for bf16/fp16 models).

        Raises:
            ValueError: when the model is in training mode, shapes or ``out`` disagree, or (first call,
                ``check``) a parameter's summed per-sample gradient differs from the batched gradient.
        """
        inputs = self._checked_inputs(input_ids, attention_mask, position_ids)
        B, device = input_ids.shape[0], input_ids.device
        if out is None:
            out = torch.empty(B, self.layout.P, dtype=torch.float32, device=device)
        else:
            self._check_out(out, B, device)
        check = self._reference(inputs, dlogits_fn) if self.check else None
        scores = self._per_sample(inputs, [(dlogits_fn, out, None, None)])
        if check is not None:
            for e in self.layout.entries:
                check.compare(e, scores[:, e.offset : e.offset + e.numel])
            check.raise_first()
            self.check = False
        return scores

    def accumulate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        dlogits_fn: Callable[[Tensor], Tensor],
        acc: MomentAccumulator,
        advantages: Tensor | np.ndarray,
        half: Tensor | np.ndarray,
        position_ids: Tensor | None = None,
        *,
        out: Tensor | None = None,
    ) -> None:
        """The fused reduction: fold every sample's gradient into ``acc``, tensor by tensor, as it is produced.

        Each selected tensor's per-sample block (B, *shape) lives only from its first contribution in the
        backward until its last (tied tensors sum their modules' contributions first) and is then folded
        into the accumulator's rows and dropped, so the extra device memory is the blocks in flight (one
        tensor's, or a tied embedding's across the backward) instead of B × P. Same arguments as
        :meth:`__call__`, plus:

        Args:
            acc: accumulator on the inputs' device with the layout's P.
            advantages: shape (B,), each sample's advantage.
            half: shape (B,) integers in [0, acc.H), the accumulator row of each sample.
            out: optional (B, P) float32 buffer: the per-sample rows are also written there (for stores
                that keep them); the fold then reads them from it.

        Raises:
            ValueError: as :meth:`__call__`, or when ``acc`` does not match the layout or device.
        """
        target = Cotangent(dlogits_fn, acc, advantages, half, out)
        self.accumulate_many(input_ids, attention_mask, [target], position_ids)

    def accumulate_many(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        cotangents: Sequence[Cotangent],
        position_ids: Tensor | None = None,
    ) -> None:
        """The fused reduction of K objectives of one batch (the score and regimes' g) from one forward.

        One forward with the hooks, then per cotangent k in order one backward of its logit gradient
        (``cotangents[k].fn`` of the detached logits; the graph is kept until the last), during which every
        tensor's per-sample block is folded into ``cotangents[k].acc`` exactly as :meth:`accumulate` folds
        it: each accumulator receives the same blocks, bit for bit, as a separate :meth:`accumulate` of its
        objective (the forward is the same computation, the backward and the rules the same operations),
        and only the forward (and its hooks' saved inputs) is shared. With ``check``, each objective is
        compared with its own batched gradient.

        Args:
            input_ids, attention_mask, position_ids: the batch, as :meth:`__call__`.
            cotangents: the objectives, each with its own accumulator (distinct accumulators, on the
                inputs' device with the layout's P).

        Raises:
            ValueError: as :meth:`accumulate`, for no cotangents, or when two share an accumulator.
        """
        inputs = self._checked_inputs(input_ids, attention_mask, position_ids)
        B, device = input_ids.shape[0], input_ids.device
        if not cotangents:
            raise ValueError("accumulate_many needs at least one cotangent")
        if len({id(c.acc) for c in cotangents}) != len(cotangents):
            raise ValueError("every cotangent of accumulate_many needs its own accumulator; two share one")
        for c in cotangents:
            if c.acc.P != self.layout.P or c.acc.device != device:
                raise ValueError(
                    f"accumulator has P={c.acc.P} on {c.acc.device}; this layout needs P={self.layout.P} on {device}"
                )
            if c.out is not None:
                self._check_out(c.out, B, device)
        checks = [self._reference(inputs, c.fn) if self.check else None for c in cotangents]
        begun: list[MomentAccumulator] = []
        try:
            for c in cotangents:
                c.acc.begin_batch(c.advantages, c.half)
                begun.append(c.acc)
            self._per_sample(inputs, [(c.fn, c.out, c.acc, check) for c, check in zip(cotangents, checks, strict=True)])
        except BaseException:
            for acc in begun:
                acc.abort_batch()
            raise
        for c in cotangents:
            c.acc.end_batch()
        for c in cotangents:
            if c.done is not None:
                c.done()
        for check in checks:
            if check is not None:
                check.raise_first()
        if self.check:
            self.check = False

    def _checked_inputs(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None
    ) -> dict[str, Tensor | None]:
        training = [name for name, m in self.model.named_modules() if m.training]
        if training:
            raise ValueError(f"model must be in eval mode (dropout off); {training[0] or 'the model'} is training")
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids must be (B, L) and attention_mask the same shape; got {tuple(input_ids.shape)} "
                f"and {tuple(attention_mask.shape)}"
            )
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids must have shape {tuple(input_ids.shape)}; got {tuple(position_ids.shape)}")
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def _check_out(self, out: Tensor, B: int, device: torch.device) -> None:
        if (
            out.shape != (B, self.layout.P)
            or out.dtype != torch.float32
            or out.device != device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous float32 tensor of shape {(B, self.layout.P)} on {device}; got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
            )

    def _per_sample(self, inputs: dict[str, Tensor | None], targets: list[_Target]) -> Tensor | None:
        """One forward with the hooks, then one backward per target (logit-gradient function, rows, accumulator,
        self-check), each writing its rows and folding its accumulator; returns the first target's rows."""
        B, L = inputs["input_ids"].shape
        self._B, self._L = B, L
        self.skipped_columns = 0
        flags = [(p, p.requires_grad) for p in self.model.parameters()]
        handles = []
        try:
            # Frozen parameters: the graph starts at the first hooked outputs, no weight grads are formed.
            for p, _ in flags:
                p.requires_grad_(False)
            if not self._traced or (B >= 2 and not self._verified):
                self._trace(inputs)
            for module, rule, local in self._bindings:
                if rule is generic_rule and self._taps is not None:
                    handles += self._taps.hooks(module, local)
                else:
                    handles.append(module.register_forward_hook(self._forward_hook(B, rule, local), with_kwargs=True))
            with torch.enable_grad():
                logits = self.model(**inputs, use_cache=False).logits
                calls = dict(self._calls)  # module calls per tensor: the contributions each backward brings
                for k, (dlogits_fn, out, acc, check) in enumerate(targets):
                    self._out, self._acc, self._check = out, acc, check
                    self._written, self._folded, self._blocks, self._deferred = set(), set(), {}, []
                    self._whole = {}
                    self._pending = dict(calls)
                    if self._roots:
                        dlogits = _checked_dlogits(dlogits_fn, logits)
                        torch.autograd.grad(
                            logits,
                            self._roots,
                            dlogits.to(logits.dtype),
                            allow_unused=True,
                            retain_graph=k < len(targets) - 1,
                        )
                        del dlogits
                    self._flush_deferred(None)
                    for e in self.layout.entries:
                        if out is not None and e.name in self._whole:
                            self._take_rows(e)
                        if e.name not in self._written and out is not None:  # the parameter does not reach the logits
                            out[:, e.offset : e.offset + e.numel].zero_()
                        if acc is not None and e.name not in self._folded:  # not reached, or a call without a backward
                            self._fold(e)
            return targets[0][1]
        finally:
            if self._taps is not None:
                self._taps.reset()
            for h in handles:
                h.remove()
            for p, flag in flags:
                p.requires_grad_(flag)
            self._out, self._acc, self._check, self._roots = None, None, None, []
            self._written, self._folded, self._pending, self._blocks = set(), set(), {}, {}
            self._calls, self._whole = {}, {}
            self._deferred = []

    def _block(self, entry: TensorEntry) -> Tensor:
        """The (B, numel) float32 per-sample block of ``entry``: a view of the output rows, or its own
        buffer while it is in flight (fused reduction without rows)."""
        if self._out is not None:
            return self._out[:, entry.offset : entry.offset + entry.numel]
        block = self._blocks.get(entry.name)
        if block is None:
            need = self._B * entry.numel
            # the smallest pooled buffer that holds the block without wasting more than its size: tensors of
            # one shape (every decoder layer's) reuse each other's buffers, and a small block never pins a
            # buffer sized for the embedding (B × V × H floats, GBs for a real vocabulary)
            fits = [
                (buf.numel(), i)
                for i, buf in enumerate(self._pool)
                if need <= buf.numel() <= 2 * need and buf.device == self._acc.device
            ]
            if fits:
                buf = self._pool.pop(min(fits)[1])
            else:
                if need * 4 > _POOL_MAX_BYTES:  # a tied embedding's block: the heap's free pages go back first
                    release_free_memory()
                buf = torch.empty(need, dtype=torch.float32, device=self._acc.device)
            block = buf[:need].view(self._B, entry.numel)
            self._blocks[entry.name] = block
        return block

    def _tap_view(self, entry: TensorEntry) -> tuple[Tensor, bool]:
        """``entry``'s (B, *shape) block for an op-level contribution and whether it is the first (write)."""
        first = entry.name not in self._written
        self._written.add(entry.name)
        return self._block(entry).view(self._B, *entry.shape), first

    def _fold(self, entry: TensorEntry) -> None:
        """Fold ``entry``'s finished block into the accumulator and release it."""
        block = self._block(entry)
        if entry.name in self._whole:
            self._take_rows(entry)
        elif entry.name not in self._written:
            block.zero_()
        self._acc.fold(entry.offset, block)
        if self._check is not None:
            self._check.compare(entry, block)
        if entry.name in self._blocks:
            buf = self._blocks.pop(entry.name)._base
            if buf.numel() * buf.element_size() <= _POOL_MAX_BYTES:
                self._pool.append(buf)
        self._folded.add(entry.name)

    def _whole_view(self, entry: TensorEntry) -> Tensor:
        """The (B, *full shape) float32 buffer of a row-cut tensor whose rule writes whole tensors."""
        buf = self._whole.get(entry.name)
        if buf is None:
            buf = torch.empty(self._B, *entry.full_shape, dtype=torch.float32, device=self._device())
            self._whole[entry.name] = buf
        return buf

    def _take_rows(self, entry: TensorEntry) -> None:
        """Copy the entry's rows of its whole-tensor buffer into its block and drop the buffer."""
        r0, r1 = entry.rows
        self._block(entry).view(self._B, *entry.shape).copy_(self._whole.pop(entry.name)[:, r0:r1])

    def _device(self) -> torch.device:
        return self._acc.device if self._acc is not None else self._out.device

    def _row_chunks(self, entry: TensorEntry, n_rows: int) -> Iterator[tuple[int, int, Tensor]] | None:
        """Chunks of ``entry``'s block for its rule to write, each folded when the next is asked for (see
        :meth:`covgrad.scores.rules.Slot.rows`); None unless this is the fused reduction without rows and the
        tensor's only contribution (a tied or repeated tensor sums its contributions whole first)."""
        if self._acc is None or self._out is not None:
            return None
        if self._calls.get(entry.name) != 1 and entry.name not in self._adders:
            return None
        device = self._acc.device
        limit = default_chunk_bytes(device.type) if self.chunk_bytes is None else self.chunk_bytes
        if limit <= 0:
            return None
        self._written.add(entry.name)
        B, row = self._B, entry.row_size
        per = chunk_rows(limit, B, row)
        need = B * min(per, entry.full_shape[0]) * row
        if self._chunk is None or self._chunk.numel() < need or self._chunk.device != device:
            self._chunk = torch.empty(need, dtype=torch.float32, device=device)
        return self._fold_chunks(entry, per, row)

    def _fold_chunks(self, entry: TensorEntry, per: int, row: int) -> Iterator[tuple[int, int, Tensor]]:
        """Yield views of ``per`` rows (``row`` elements each) of the chunk buffer, on the whole tensor's grid
        of chunks; fold the entry's rows of each (all of them, or a row-cut tensor's rows only: its first and
        last chunks are computed whole, so every product is the one without the cut) into the accumulator
        once the rule has written it (and sum them for the self-check). A chunk none of whose columns the
        accumulator keeps (``wants``: a rank's :class:`covgrad.distributed.fsdp.ShardAccumulator`) is not yielded, so
        its
        rows are never formed: under FSDP2 each rank forms about 1/R of a chunked weight's block. An accumulator
        with ``row_spans`` (an aligned rank's) gets chunks on a grid starting at each of its spans instead, so it
        forms exactly its own rows."""
        B, check, add = self._B, self._check, self._adders.get(entry.name)
        first, end = entry.rows
        spans = self._acc.row_spans(entry.offset, first, end, row)
        if spans is None:  # the unsharded grid of the whole tensor
            grid = [(r0, min(entry.full_shape[0], r0 + per)) for r0 in range(first - first % per, end, per)]
        else:  # a rank's own rows, each span on a grid of its own (ShardAccumulator.aligned)
            grid = [(r0, min(hi, r0 + per)) for lo, hi in spans for r0 in range(lo, hi, per)]
            self.skipped_columns += (end - first - sum(r1 - r0 for r0, r1 in spans)) * row
        for r0, r1 in grid:
            a, b = max(r0, first), min(end, r1)
            at = (a - first) * row
            if not self._acc.wants(entry.offset + at, (b - a) * row):  # none of a rank's columns: not formed
                self.skipped_columns += (b - a) * row
                continue
            chunk = self._chunk[: B * (r1 - r0) * row]
            yield r0, r1, chunk.view(B, r1 - r0, *entry.shape[1:])
            if add is not None:  # a tied tensor's other contribution (_run_rule)
                add(r0, r1, chunk.view(B, r1 - r0, *entry.shape[1:]))
            cols = chunk.view(B, (r1 - r0) * row)[:, (a - r0) * row : (b - r0) * row]
            self._acc.fold(entry.offset + at, cols)
            if check is not None:
                check.add(entry, at, cols)
        if check is not None:
            check.close(entry)
        self._folded.add(entry.name)

    def _run_rule(
        self, apply: Callable[[], None], local: dict[str, TensorEntry], adds: Callable[[], RowAdder] | None = None
    ) -> None:
        """Run a rule (``apply``); in the fused reduction, fold every tensor whose last contribution this was.

        In the fused reduction without rows, a call none of whose tensors is complete with it (each has a
        contribution still to come: a tied or repeated module) is held back, with its saved input and output
        gradient, until one of them gets its last contribution; then the held calls run first, in their
        order, so the sums are the same as without holding. A tied embedding's (B, V, H) block thus exists
        only from the embedding's gradient (the end of the backward) to its fold, not through the whole
        backward alongside the activations and logits.

        ``adds`` (a rule marked by :func:`covgrad.scores.rules.adds_rows`) makes this call's contribution an adder of
        rows. When it is the last of a tensor's two contributions and the held one writes row chunks (a tied
        embedding: the LM head's Linear rule), each chunk the held call writes gets this call's rows added
        before it is folded, so the tensor's (B, V, H) block is never whole; each element is summed in the
        whole block's order (the LM head's product, then the positions in order), the product's chunk GEMM
        rounding its last bits as any chunked weight's does.
        """
        if self._acc is None:
            apply()
            return
        names = tuple(entry.name for entry in local.values())
        for name in names:
            self._pending[name] -= 1
        if self._out is None and all(self._pending[name] > 0 for name in names):
            self._deferred.append((apply, names))
            return
        if adds is not None and self._adds_to_chunks(local):
            (entry,) = local.values()
            self._adders[entry.name] = adds()
            try:
                self._flush_deferred(set(names))
            finally:
                del self._adders[entry.name]
            if entry.name in self._folded:  # the held call wrote it in chunks, with this call's rows added
                return
            apply()  # the held call wrote the whole block: add to it
            self._fold(entry)
            return
        self._flush_deferred(set(names))
        apply()
        for entry in local.values():
            if self._pending[entry.name] == 0 and entry.name not in self._folded:  # chunked ones are folded
                self._fold(entry)

    def _adds_to_chunks(self, local: dict[str, TensorEntry]) -> bool:
        """Whether this call's one tensor, with this its last contribution of two, may be folded in the held
        call's row chunks with this call's rows added (fused reduction without rows)."""
        if self._acc is None or self._out is not None or len(local) != 1:
            return False
        (entry,) = local.values()
        return self._pending[entry.name] == 0 and self._calls.get(entry.name) == 2 and entry.name not in self._written

    def _flush_deferred(self, names: set[str] | None) -> None:
        """Run the held-back calls that write any tensor of ``names`` (all of them when None), in order."""
        keep = []
        for apply, written in self._deferred:
            if names is None or names.intersection(written):
                apply()
            else:
                keep.append((apply, written))
        self._deferred = keep

    def _forward_hook(self, B: int, rule: Rule, local: dict[str, TensorEntry]) -> Callable:
        """Forward hook: save the input, make the output a graph root if needed, hook its gradient."""

        parts = getattr(rule, "row_parts", False)

        def view(name: str) -> tuple[Tensor, bool] | None:
            entry = local.get(name)
            if entry is None:
                return None
            first = entry.name not in self._written
            self._written.add(entry.name)
            if entry.is_part and not parts:
                return self._whole_view(entry), first
            return self._block(entry).view(B, *entry.shape), first

        slot = _FoldingSlot(self, view, local)
        needs_call = getattr(rule, "needs_call", False)
        rows = B * self._L  # a flattened (B·L, …) batch

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Tensor | tuple) -> Tensor | tuple | None:
            if self._replaying:
                return None
            first_in = args[0] if args else next(iter(kwargs.values()), None)
            outs = float_outputs(output)
            n_in = first_in.shape[0] if isinstance(first_in, Tensor) and first_in.dim() else None
            n_out = outs[0].shape[0] if outs and outs[0].dim() else None
            if needs_call:  # per tensor: leading dimension B, or k·B for a flattened batch (k = L, L·heads, …)
                leads = [o.shape[0] if o.dim() else None for o in outs]
                multiples = [n for n in (*leads, n_in) if n is not None and n != B and n % B == 0]
                flat = bool(multiples)
                n_flat = multiples[0] if flat else rows
                ok = bool(leads) and all(n in (B, n_flat) for n in leads)
            else:
                flat = n_in is not None and n_in == n_out != B and n_in % B == 0
                ok = flat or (n_in, n_out) == (B, B)
                n_flat = n_in
            if not ok:
                self._batch_dims_error(module, n_in, n_out, B)
            outer = needs_call and flat and id(module) in self._outer and n_flat % rows == 0
            if flat and B > 1 and id(module) not in self._flat_ok:
                raise ValueError(
                    f"a hooked {type(module).__name__} ({self._names.get(id(module), '?')}) ran on a flattened "
                    f"batch of {n_flat} = {B}·{n_flat // B} rows (its caller reshaped (B, L, …) to (B·L, …)) "
                    "whose rows were not verified to be sample by sample; deselect its parameters"
                )

            def unflat(t: object) -> object:
                if flat and isinstance(t, Tensor) and t.dim() and t.shape[0] == n_flat:
                    if outer:  # (m·B·L, …) outer-major → (B, m·L, …): sample n's rows, in their order
                        return (
                            t.reshape(n_flat // rows, B, self._L, *t.shape[1:])
                            .transpose(0, 1)
                            .reshape(B, n_flat // B, *t.shape[1:])
                        )
                    return t.reshape(B, n_flat // B, *t.shape[1:])
                return t

            x = unflat(first_in.detach()) if isinstance(first_in, Tensor) else first_in
            call = None
            if needs_call:  # rules that read more than the first input (generic rule, fused experts)
                detached = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, (args, kwargs))
                where = self._names.get(id(module), type(module).__name__)
                m = n_flat // rows if outer else 0
                call = Call(detached[0], detached[1], flat, n_flat // B, tuple(local), where, m)

            def run(g: Tensor | tuple[Tensor, ...]) -> None:
                if self._probing:
                    return
                g = unflat(g) if isinstance(g, Tensor) else tuple(unflat(t) for t in g)
                if needs_call:
                    self._run_rule(lambda: self._replay(rule, module, x, g, slot, call), local)
                else:
                    adder = getattr(rule, "row_adder", None)
                    adds = None if adder is None else (lambda: adder(module, x, g))
                    self._run_rule(lambda: rule(module, x, g, slot), local, adds)

            for entry in local.values():  # contributions the backward will bring (tied or repeated modules)
                self._pending[entry.name] = self._pending.get(entry.name, 0) + 1
                self._calls[entry.name] = self._calls.get(entry.name, 0) + 1

            if isinstance(output, Tensor):
                if not output.requires_grad:
                    output = output.detach().requires_grad_()
                    self._roots.append(output)
                output.register_hook(run)
                return output
            if not isinstance(output, tuple | list) or not outs:
                raise ValueError(
                    f"a hooked {type(module).__name__} returned {type(output).__name__}; per-sample rules need "
                    "a tensor or a tuple of tensors"
                )
            if not any(o.requires_grad for o in outs):
                outs = tuple(o.detach().requires_grad_() for o in outs)
                self._roots.extend(outs)
            tapped = iter(_Tap.apply(run, *outs))
            return type(output)(next(tapped) if isinstance(t, Tensor) and t.is_floating_point() else t for t in output)

        return hook

    def _replay(self, rule: Rule, module: nn.Module, x: Tensor, g: object, slot: Slot, call: Call) -> None:
        """Run a rule that may re-run the module's forward, with every hook standing aside meanwhile."""
        self._replaying = True
        try:
            rule(module, x, g, slot, call=call)
        finally:
            self._replaying = False

    def _batch_dims_error(self, module: nn.Module, n_in: int | None, n_out: int | None, B: int) -> None:
        where = f"{type(module).__name__} ({self._names.get(id(module), '?')})"
        if B > 1 and 1 in (n_in, n_out):
            raise ValueError(
                f"a hooked {where} ran with batch dims {(n_in, n_out)} (input, output), not {B}: a tensor "
                "broadcast over the batch (e.g. default position ids) has no per-sample gradient; pass "
                "position_ids of shape (B, L)"
            )
        raise ValueError(
            f"a hooked {where} ran with leading dims {(n_in, n_out)} (input, output), neither B = {B} nor "
            f"B·L = {B * self._L}: its rows cannot be split by sample; deselect its parameters"
        )

    def _trace(self, inputs: dict[str, Tensor | None]) -> None:
        """One forward of the batch's first (at most) two samples, cut to their last ``_TRACE_POSITIONS``
        positions (the trace keeps a graph, and a real vocabulary's logits), that checks where the selected
        parameters are used and, with two samples, that every hooked module whose rule replays its forward
        or that runs on a flattened (B·L, …) batch keeps the samples apart.

        A parameter used outside the forward of every module bound to it (a weight handed to a functional
        conv by its parent, so its own module never runs and no hook would fire) is rebound to the smallest
        module whose forward holds all its uses, with :func:`covgrad.scores.rules.generic_rule` for it alone.
        Samples apart: Σ of random projections of sample b's rows of those modules' inputs and outputs must
        have a zero gradient on the other sample's embeddings (one backward per sample).

        Raises:
            ValueError: naming the parameter when only the model's top-level forward uses it, or the module
                that mixes samples or whose flattened rows are not sample by sample.
        """
        n = min(inputs["input_ids"].shape[0], 2)
        sub = {k: v[:n, -_TRACE_POSITIONS:] if v is not None else None for k, v in inputs.items()}
        wanted = {id(p): e.name for e, p in zip(self.layout.entries, self._params, strict=True)}
        bound = {id(m) for m, _, _ in self._bindings}
        stack: list[str] = []
        uses: dict[str, set[tuple[str, ...]]] = {}
        users: set[str] = set()
        records: list[tuple[nn.Module, list[Tensor], list[Tensor]]] = []
        emb: list[Tensor] = []
        try:
            embedding = self.model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            embedding = None

        def pre(module: nn.Module, args: tuple) -> None:
            stack.append(self._names[id(module)])

        def post(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            name = stack.pop()
            if n == 2 and (id(module) in bound or name in users):
                first = args[0] if args else next(iter(kwargs.values()), None)
                ins = [first] if isinstance(first, Tensor) and first.is_floating_point() else []
                records.append((module, ins, list(float_outputs(output))))

        def leaf(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            out = output.detach().requires_grad_()
            emb.append(out)
            return out

        handles = []
        for m in self.model.modules():
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        if n == 2 and isinstance(embedding, nn.Module):
            handles.append(embedding.register_forward_hook(leaf))
        try:
            with torch.enable_grad(), _ParamUses(wanted, stack, uses, users):
                self.model(**sub, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        self._rebind(uses)
        self._traced = True
        if n < 2:
            return
        if emb:
            self._check_apart(emb[0], records, sub["input_ids"].shape[1])
        self._verified = True

    def _rebind(self, uses: dict[str, set[tuple[str, ...]]]) -> None:
        """Move every selected parameter with a use outside its bound modules' forwards to the smallest
        module whose forward holds all its uses (see :meth:`_trace`)."""
        modules = dict(self.model.named_modules())
        bound_in: dict[str, set[str]] = {}
        for module, _, local in self._bindings:
            for e in local.values():
                bound_in.setdefault(e.name, set()).add(self._names[id(module)])
        moves: dict[str, str] = {}
        refused: list[tuple[str, str]] = []
        for name, stacks in uses.items():
            if all(st and st[-1] in bound_in.get(name, ()) for st in stacks):
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
        if refused:
            raise ValueError(refusal(self.layout, refused))
        if not moves:
            return
        kept = []
        for module, rule, local in self._bindings:
            local = {pn: e for pn, e in local.items() if e.name not in moves}
            if local:
                kept.append((module, rule, local))
        added: dict[str, dict[str, TensorEntry]] = {}
        for name, target in moves.items():
            added.setdefault(target, {})[name[len(target) + 1 :]] = self.layout.entry(name)
        # a module's generic binding takes the moved parameters too: one replay of its forward for all of them
        merged = []
        for module, rule, local in kept:
            extra = added.pop(self._names[id(module)], {}) if rule is generic_rule else {}
            merged.append((module, rule, {**local, **extra}))
        self._bindings = merged + [(modules[t], generic_rule, local) for t, local in added.items()]

    def _check_apart(self, emb: Tensor, records: list[tuple[nn.Module, list[Tensor], list[Tensor]]], L: int) -> None:
        """Verify that the recorded module calls keep the two traced samples apart (see :meth:`_trace`; L: the
        traced positions); mark the modules that ran flattened as verified: sample-major rows (row n·k + j is
        sample n's), or, for a rule that reads the whole call, outer-major ones (an (m·B·L, …) batch whose
        row (i·B + n)·L + t is sample n's position t, as experts that see every token once per expert)."""
        rules = {id(m): rule for m, rule, _ in self._bindings}
        checked = []
        for module, ins, outs in records:
            if id(module) not in rules:
                continue
            needs = getattr(rules[id(module)], "needs_call", False)
            flat = any(t.shape[0] > 2 for t in (*ins, *outs) if t.dim() and t.shape[0] % 2 == 0)
            if needs or flat:
                checked.append((module, ins, outs, flat))
        gen = torch.Generator().manual_seed(0)

        def part(t: Tensor, b: int, outer: bool) -> Tensor:
            if outer and t.shape[0] % (2 * L) == 0:
                return t.reshape(t.shape[0] // (2 * L), 2, L, *t.shape[1:])[:, b]
            k = t.shape[0] // 2
            return t[b * k : (b + 1) * k]

        def leaks(ts: list[Tensor], b: int, outer: bool = False) -> bool:
            ts = [t for t in ts if t.requires_grad and t.dim() and t.shape[0] % 2 == 0]
            if not ts:
                return False
            total = sum(
                (part(t, b, outer).float() * torch.randn(part(t, b, outer).shape, generator=gen).to(t.device)).sum()
                for t in ts
            )
            (grad,) = torch.autograd.grad(total, emb, retain_graph=True, allow_unused=True)
            # NaN/inf entries (0·∞ through a zero-norm padding embedding) carry no evidence either way
            return grad is not None and bool((grad[1 - b].nan_to_num(0.0, 0.0, 0.0) != 0).any())

        every = [t for _, ins, outs, _ in checked for t in (*ins, *outs)]
        outer: set[int] = set()
        if any(leaks(every, b) for b in (0, 1)):
            refused: list[tuple[str, str]] = []
            for module, ins, outs, flat in checked:
                where = f"{self._names[id(module)]} (a {type(module).__name__})"
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
                elif any(leaks(outs, b) for b in (0, 1)):
                    what = "mixes samples (its output for one sample depends on another sample's input)"
                else:
                    continue
                refused += [
                    (e.name, f"{e.name!r}: {where} {what}, so no per-sample gradient exists")
                    for m, _, local in self._bindings
                    if m is module
                    for e in local.values()
                ]
            if refused:
                raise ValueError(refusal(self.layout, refused))
        self._flat_ok = {id(module) for module, _, _, flat in checked if flat}
        self._outer = outer

    def _reference(self, inputs: dict[str, Tensor | None], dlogits_fn: Callable[[Tensor], Tensor]) -> _Check:
        """The self-check's reference: the batched autograd gradient of the summed objective (one extra
        forward and backward, before the per-sample pass), compared tensor by tensor as each one's
        per-sample block completes and dropped then, so it never holds more than the model's gradient."""
        with torch.enable_grad():
            logits = self.model(**inputs, use_cache=False).logits
            dlogits = _checked_dlogits(dlogits_fn, logits).to(logits.dtype)
            grads = torch.autograd.grad(logits, self._params, dlogits, allow_unused=True)
        return _Check(self.layout, self._params, grads)


class _FoldingSlot(Slot):
    """The slot of one hooked module in a :class:`PerSampleGrads` call: whole views, and row chunks folded
    as they are written when the owner's fused reduction allows (:meth:`PerSampleGrads._row_chunks`)."""

    def __init__(
        self, owner: PerSampleGrads, views: Callable[[str], tuple[Tensor, bool] | None], local: dict[str, TensorEntry]
    ) -> None:
        super().__init__(views)
        self._owner, self._local = owner, local

    def rows(self, name: str, n_rows: int) -> Iterator[tuple[int, int, Tensor]] | None:
        entry = self._local.get(name)
        return None if entry is None else self._owner._row_chunks(entry, n_rows)

    def first_row(self, name: str) -> int:
        entry = self._local.get(name)
        return 0 if entry is None else entry.row0


class _Check:
    """The self-check of one batch: Σ_n s_n of every selected tensor against the batched gradient.

    ``add(entry, at, cols)`` takes columns [at, at + n) of a tensor's (B, numel) float32 per-sample block and
    sums them over the samples in column chunks (in float64); ``close(entry)`` compares the tensor's sum with
    the reference within the dtype's tolerance and drops the reference (``compare``: both, for a whole block);
    ``raise_first`` raises the mismatches (one ValueError naming every mismatched parameter) once the batch is
    done. No (numel,) float64 copy of a sum or of the reference is made whole (1.3 GB for a 262k × 640
    embedding).

    Args:
        layout: the selected parameters.
        params: the model's parameter of each layout entry, in layout order.
        grads: the batched gradient of each (None where the parameter does not reach the logits).
    """

    def __init__(self, layout: ParamLayout, params: list[Tensor], grads: tuple[Tensor | None, ...]) -> None:
        # A tensor whose exact gradient is zero (a key bias: the softmax ignores a shift shared by all keys)
        # holds only rounding noise; it is compared against 1e-4 of the whole gradient's norm instead.
        self.floor = 1e-4 * float(sum(float(g.double().norm()) ** 2 for g in grads if g is not None) ** 0.5)
        self.refs = {e.name: (p.dtype, g) for e, p, g in zip(layout.entries, params, grads, strict=True)}
        self.sq: dict[str, Tensor] = {}  # per tensor: ‖summed − ref‖², ‖ref‖², ‖summed‖² so far
        self.errors: list[tuple[str, float]] = []  # (parameter, relative difference) of every mismatch
        self.rtol = 1e-4

    def add(self, entry: TensorEntry, at: int, cols: Tensor) -> None:
        """Columns [at, at + n) of ``entry``'s per-sample block, ``cols`` (B, n) float32 (of a row-cut tensor:
        columns of the entry's rows)."""
        g = self.refs[entry.name][1]
        ref = None if g is None else g.detach().reshape(entry.full_shape[0] if entry.shape else 1, -1)
        if ref is not None:
            ref = ref[entry.rows[0] : entry.rows[1]].reshape(-1)
        sq = self.sq.setdefault(entry.name, torch.zeros(3, dtype=torch.float64))
        step = max(1, _CHECK_COLUMNS // max(1, cols.shape[0]))
        for j in range(0, cols.shape[1], step):
            s = cols[:, j : j + step].sum(0, dtype=torch.float64)
            r = torch.zeros_like(s) if ref is None else ref[at + j : at + j + s.numel()].to(torch.float64)
            sq += torch.stack([(s - r).square().sum(), r.square().sum(), s.square().sum()]).cpu()

    def close(self, entry: TensorEntry) -> None:
        """Compare ``entry``'s summed per-sample gradient (every column added) with its reference."""
        dtype, _ = self.refs.pop(entry.name)
        sq = self.sq.pop(entry.name, torch.zeros(3, dtype=torch.float64))
        err, ref_norm, sum_norm = (float(v) for v in sq.sqrt())
        scale = max(ref_norm, sum_norm, self.floor)
        rtol = _CHECK_RTOL.get(dtype, 1e-4)
        if err > rtol * scale:
            self.errors.append((entry.name, err / scale))
            self.rtol = rtol

    def compare(self, entry: TensorEntry, block: Tensor) -> None:
        """Check ``entry``'s whole per-sample block (B, numel) float32 and drop its reference."""
        self.add(entry, 0, block)
        self.close(entry)

    def raise_first(self) -> None:
        """Raise one error naming every mismatch found (the first in full), if any."""
        if not self.errors:
            return
        (name, rel), rest = self.errors[0], self.errors[1:]
        also = "; also for " + ", ".join(f"{n!r} ({r:.3g})" for n, r in rest) if rest else ""
        raise ValueError(
            f"self-check failed for parameter {name!r}: the summed per-sample gradient differs from the "
            f"batched gradient by {rel:.3g} (relative, tolerance {self.rtol:g}); its module's forward does not "
            f"match the per-sample rule, or the parameter is used where no rule sees it{also}"
        )


# Tensor methods and attribute getters (``.dtype``, ``.shape``: ``__get__``) that read metadata, not values.
_METADATA = METADATA_READS | {"__get__"}


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


def _common_prefix(stacks: set[tuple[str, ...]]) -> list[str]:
    """The longest common prefix of module call stacks (outermost first)."""
    common = list(min(stacks, key=len))
    for st in stacks:
        k = next((i for i, (a, b) in enumerate(zip(common, st, strict=False)) if a != b), len(common))
        common = common[:k]
    return common


def _checked_dlogits(dlogits_fn: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    dlogits = dlogits_fn(logits.detach())
    if dlogits.shape != logits.shape:
        raise ValueError(f"dlogits_fn must return the logits' shape {tuple(logits.shape)}; got {tuple(dlogits.shape)}")
    return dlogits
