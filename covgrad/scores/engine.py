"""Exact per-sample scores of a causal LM from one batched forward and one backward.

The score of sample n is the gradient of *its own* objective, the sum over its scored response tokens
of the (centered) token log-probability: s_n = ∇θ Σ_t w_t [z_{t-1,y_t} − Σ_v q_v z_{t-1,v}] / τ
(:func:`covgrad.scores.centering.score_logit_grad`). It is neither divided by the number of tokens T nor by the
batch size N, so Fisher and covariance built from it are in per-sample units; a mean loss would scale every score
by 1/T_n (and the ordinary batched gradient by 1/N).

How: forward hooks (:mod:`covgrad.scores.hooks`) on the modules that own the selected parameters save each module's
input, and a tensor hook on the module's output receives ∂objective/∂output during the backward; a per-module rule
(:mod:`covgrad.scores.rules`: Linear, GPT-2 Conv1D, Embedding, LayerNorm, RMSNorm; :mod:`covgrad.scores.experts`: fused
experts (run as one autograd node in the pass), Llama 4's dense experts, experts recognised by structure (one backward
with the experts widened per sample); and the generic per-sample vector-Jacobian product of any other module's forward,
or of the ops that use its parameters, :mod:`covgrad.scores.optaps`; picked by :mod:`covgrad.scores.binding`) turns the
pair into every sample's parameter gradient. The first call traces one forward of two samples
(:mod:`covgrad.scores.tracing`): a parameter used outside the forward of the module that owns it (a weight its parent
hands to a functional conv) moves to the smallest module whose forward holds all its uses, and every module that runs on
a flattened (B·L, …) batch or whose forward a rule replays must keep the samples apart (checked by autograd, not by a
list of classes). During the call all parameters are frozen and the backward is taken with respect to the outputs of the
first hooked modules (leaves standing for them; the model goes on with copies it may update in place,
:func:`covgrad.scores.hooks.graph_root`), so autograd never computes a batched weight gradient: the per-sample products
replace those GEMMs instead of adding to them. A parameter shared by several modules (tied embedding and LM head) gets
the sum of their contributions per sample; one registered by a module and again inside it (an LM head's bias that is its
decoder's) is bound once.

Two outputs: ``__call__`` returns the (B, P) float32 rows; ``accumulate`` (the scores stage's fused
reduction) folds each tensor's (B, numel) block into a :class:`covgrad.moments.accum.MomentAccumulator` as soon
as its last contribution of the backward has arrived and drops it, so no B × P buffer exists; a Linear or Conv1D
weight with one contribution is not even formed whole (:mod:`covgrad.scores.blocks`; ``benchmarks/scores.py``
compares the two). ``accumulate_many`` does the same for K objectives of one batch (the score and regimes' g, each
a :class:`Cotangent` with its own accumulator): one forward, then one backward per logit-space cotangent through
the same hooks, the graph kept until the last, each accumulator folded exactly as a separate ``accumulate`` would
fold it. With ``check``, the first call compares each tensor's Σ_n s_n with autograd and proves the samples apart in
the whole model (:mod:`covgrad.scores.selfcheck`): a random sample's rows against the gradient of its own objective,
and one forward with that sample's tokens replaced, after which no other sample's logits may move; where they
move, every selected tensor whose gradient flows through the place where the samples mix is refused
(:func:`covgrad.scores.tracing.locate_mixing`).

Shape notation: B samples in the batch, L sequence positions (prompt, response and padding), V
vocabulary, P selected parameter elements (the flat axis of :class:`covgrad.layout.ParamLayout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from covgrad.layout import ParamLayout, TensorEntry
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.blocks import Blocks
from covgrad.scores.dense_experts import _dense_experts_ok, dense_forward
from covgrad.scores.experts import _fused_experts_ok, fused_forward
from covgrad.scores.hooks import forward_hook
from covgrad.scores.opgrads import Crossed
from covgrad.scores.optaps import OpTaps
from covgrad.scores.rules import Rule, generic_rule
from covgrad.scores.selfcheck import Mixing, SelfCheck, probe_sample, separation
from covgrad.scores.tracing import (
    Binding,
    RefusalError,
    Refusals,
    bind_rules,
    check_apart,
    locate_mixing,
    rebind,
    trace_forward,
)


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
_Target = tuple[Callable[[Tensor], Tensor], Tensor | None, MomentAccumulator | None, SelfCheck | None]


class PerSampleGrads:
    """Every sample's gradient of its own objective, flat in a layout's order, from one batched pass.

    Args:
        model: a Hugging Face causal LM (or any module called as ``model(input_ids=..., attention_mask=...,
            position_ids=..., use_cache=False)`` returning ``.logits``), in eval mode.
        layout: the selected parameters (:func:`covgrad.layout.select_parameters` on this model).
        check: on the first call, compare Σ_n s_n per tensor with the ordinary batched gradient of the
            summed objective and raise if they differ (catches a module whose forward a rule does not
            match, e.g. a Linear subclass that rescales its weight), and (B ≥ 2) prove the samples apart: a
            random sample's rows against its own objective's gradient, and no other sample's logits moved by
            replacing its tokens (a refusal of the tensors upstream of a place where they mix). Costs two extra
            forwards and two backwards (one more forward and backward where the samples mix).
        chunk_bytes: bytes of one row chunk of a Linear/Conv1D weight's per-sample block in the fused
            reduction (None: :func:`covgrad.scores.blocks.default_chunk_bytes` of the device; 0: fold whole
            blocks). Chunks change the GEMM shapes, so the fp32 products may differ in their last bits from
            whole blocks.
        op_taps: give the parameters of generic-rule bindings their per-sample gradients at the ops that use
            them (:mod:`covgrad.scores.optaps`), falling back to the module replay where that is not shown exact;
            False: always the module replay (:func:`covgrad.scores.rules.generic_rule`).

    Raises:
        ValueError: when a selected parameter is not in the model, or has no per-sample rule (a
            :class:`covgrad.scores.tracing.RefusalError`: one message naming every such parameter and its module
            type, with a selection that runs). The first call refuses, the same way, every parameter that only
            the model's top-level forward uses, of a module that mixes samples or whose flattened rows are not
            sample by sample (see :meth:`_trace`), of a module whose call cannot be split by sample, and of a
            module whose forward cannot be differentiated per sample: the pass goes on without them, so that one
            refusal names them all and proposes a selection whose pass ran, and every later call raises it.
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
        self._modules = list(model.named_modules())  # what every call checks (eval mode) and freezes
        self._names = {id(m): name for name, m in self._modules}
        # fused and dense experts run as one autograd node in every pass, selected or not, so that a tensor's rows
        # do not depend on which others are selected (covgrad.scores.experts.fused_forward, dense_experts)
        self._nodes = [(m, fused_forward) for _, m in self._modules if _fused_experts_ok(m)]
        self._nodes += [(m, dense_forward) for _, m in self._modules if _dense_experts_ok(m)]
        # Set by the first call's trace (_trace): parameter uses checked, and (first call with B ≥ 2) which
        # hooked modules run on a flattened (B·L, …) batch whose row n·L + t is sample n's position t.
        self._traced = False
        self._verified = False
        self._flat_ok: set[int] = set()
        self._outer: set[int] = set()  # of those, the ones with outer-major rows (see tracing.check_apart)
        # generic-rule modules whose batch is another dimension of their arguments (op-level path only)
        self._crossed: dict[int, Crossed] = {}
        # Per-call state, set and cleared by _per_sample.
        self._L = 0
        self._replaying = False  # a rule re-runs a module's forward: the hooks of its submodules stand aside
        # covgrad.scores.optaps checks rows by autograd mid-forward: the backward hooks stand aside
        self._probing = False
        self._roots: list[Tensor] = []
        self._refused = Refusals(layout)
        self._probe_next = False  # the next self-check reference also probes the separation of the samples
        self._mixing: Mixing | None = None  # what that probe found, located by the next pass (_per_sample)
        self._blocks = Blocks()
        self._taps = OpTaps(self) if op_taps else None

    @property
    def skipped_columns(self) -> int:
        """Columns of row chunks the last call did not form (its accumulator keeps none of them), summed over
        its backward passes."""
        return self._blocks.skipped_columns

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
        self._probe_next = self.check
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
        self._probe_next = self.check  # with the first cotangent's reference
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
        self._refused.raise_any()  # refused by an earlier call: never served as zeros
        training = next((name for name, m in self._modules if m.training), None)
        if training is not None:
            raise ValueError(f"model must be in eval mode (dropout off); {training or 'the model'} is training")
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
        self._L = L
        blocks = self._blocks
        blocks.begin(B, self.chunk_bytes)
        # read every call: FSDP and other wrappers swap a model's parameter objects after construction
        flags = [(p, p.requires_grad) for p in self.model.parameters()]
        handles = []
        try:
            # Frozen parameters: the graph starts at the first hooked outputs, no weight grads are formed.
            for p, _ in flags:
                p.requires_grad_(False)
            if not self._traced or (B >= 2 and not self._verified):
                # a refusal is named with the pass's own ones once it is over (self._refused keeps it)
                with contextlib.suppress(RefusalError):
                    self._trace(inputs)
            if self._mixing is not None:
                mixing, self._mixing = self._mixing, None
                flat = (self._flat_ok, self._outer)
                self._refused.add(
                    locate_mixing(
                        self.model, self.layout, self._params, self._bindings, self._names, flat, inputs, mixing
                    )
                )
                self._bindings = self._refused.drop(self._bindings)
            for module, rule, local in self._bindings:
                if rule is generic_rule and self._taps is not None:
                    handles += self._taps.hooks(module, local)
                else:
                    handles.append(module.register_forward_hook(self._forward_hook(B, rule, local), with_kwargs=True))
            handles += [node(self, module) for module, node in self._nodes]
            with torch.enable_grad():
                logits = self.model(**inputs, use_cache=False).logits
                calls = dict(blocks.calls)  # module calls per tensor: the contributions each backward brings
                for k, (dlogits_fn, out, acc, check) in enumerate(targets):
                    blocks.begin_target(out, acc, check, calls)
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
                    blocks.finish_target(self.layout.entries)
            self._refused.raise_any()
            return targets[0][1]
        finally:
            if self._taps is not None:
                self._taps.reset()
            for h in handles:
                h.remove()
            for p, flag in flags:
                p.requires_grad_(flag)
            self._roots = []
            blocks.end()

    def _forward_hook(self, B: int, rule: Rule, local: dict[str, TensorEntry]) -> Callable:
        """The forward hook of one module bound to ``rule`` (:func:`covgrad.scores.hooks.forward_hook`)."""
        return forward_hook(self, B, rule, local)

    def _trace(self, inputs: dict[str, Tensor | None]) -> None:
        """One forward of the batch's first (at most) two samples, cut to their last positions
        (:func:`covgrad.scores.tracing.trace_forward`), that checks where the selected parameters are used and,
        with two samples, that every hooked module whose rule replays its forward or that runs on a flattened
        (B·L, …) batch keeps the samples apart.

        A parameter used outside the forward of every module bound to it (a weight handed to a functional
        conv by its parent, so its own module never runs and no hook would fire) is rebound to the smallest
        module whose forward holds all its uses, with :func:`covgrad.scores.rules.generic_rule` for it alone
        (:func:`covgrad.scores.tracing.rebind`). Samples apart (:func:`covgrad.scores.tracing.check_apart`): Σ of
        random projections of sample b's rows of those modules' inputs and outputs must have a zero gradient on
        the other sample's embeddings (one backward per sample). A generic-rule module whose batch is another
        dimension of its arguments (Gemma 3n's decoder layer) is kept for the op-level path, which probes the rows of
        every use (:class:`covgrad.scores.opgrads.Crossed`), and refused without it (``op_taps=False``).

        Raises:
            RefusalError: naming every parameter only the model's top-level forward uses, and every parameter of
                a module that mixes samples or whose flattened rows are not sample by sample, once the trace is
                done: they are left out of the bindings and kept refused (a pass goes on without them).
        """
        seen = trace_forward(self.model, self.layout, self._params, self._bindings, self._names, inputs)
        self._bindings, refused = rebind(self.model, self.layout, self._bindings, self._names, seen.uses)
        self._refused.add(refused)
        self._traced = True
        if seen.n >= 2:
            if seen.emb:
                self._flat_ok, self._outer, self._crossed, refused = check_apart(
                    self._bindings, self._names, seen.emb[0], seen.records, seen.length, self._taps is not None
                )
                self._refused.add(refused)
                self._bindings = self._refused.drop(self._bindings)
            self._verified = True
        self._refused.raise_any()

    def _reference(self, inputs: dict[str, Tensor | None], dlogits_fn: Callable[[Tensor], Tensor]) -> SelfCheck:
        """The self-check's reference: the batched autograd gradient of the summed objective (one extra
        forward and backward, before the per-sample pass), compared tensor by tensor as each one's
        per-sample block completes and dropped then, so it never holds more than the model's gradient.

        With ``_probe_next`` (once per checked pass, B ≥ 2), also the gradient of a random sample j's objective
        alone (one more backward of the same graph: twice the model's gradient held), and the separation probe
        (:func:`covgrad.scores.selfcheck.separation`, one more forward without a graph), whose finding the pass
        locates after its trace."""
        probe, self._probe_next = self._probe_next and inputs["input_ids"].shape[0] >= 2, False
        with torch.enable_grad():
            logits = self.model(**inputs, use_cache=False).logits
            dlogits = _checked_dlogits(dlogits_fn, logits).to(logits.dtype)
            grads = torch.autograd.grad(logits, self._params, dlogits, allow_unused=True, retain_graph=probe)
            if not probe:
                return SelfCheck(self.layout, self._params, grads)
            j = probe_sample(logits.shape[0])
            alone = torch.zeros_like(dlogits)
            alone[j] = dlogits[j]
            own = torch.autograd.grad(logits, self._params, alone, allow_unused=True)
        self._mixing = separation(self.model, inputs, logits.detach(), j)
        return SelfCheck(self.layout, self._params, grads, (j, own))


def _checked_dlogits(dlogits_fn: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """``dlogits_fn`` of the detached logits, (B, L, V) like them.

    Raises:
        ValueError: when it returns another shape.
    """
    dlogits = dlogits_fn(logits.detach())
    if dlogits.shape != logits.shape:
        raise ValueError(f"dlogits_fn must return the logits' shape {tuple(logits.shape)}; got {tuple(dlogits.shape)}")
    return dlogits
