"""The backward of the token Fisher: per-sample gradients of many logit cotangents from one forward.

:class:`TokenBackward` runs one forward of a batch with per-sample hooks, then backward passes of *batched*
logit cotangents (``torch.autograd.grad(..., is_grads_batched=True)``): a block of R cotangent rows, each a
(B, L, V) gradient on the logits, gives R·B per-sample gradient rows, the per-module rules of
:mod:`covgrad.scores.rules` being applied to the (R·B, …) output gradient against the module's (B, …) saved input
repeated R times. Every row costs one per-sample backward of the body; the forward is shared by all rows of all
modes (and the stage's token and sequence scores). A block of one row is a plain backward (vmap's fallback loops
over ops without a batching rule, e.g. CPU flash attention's backward, and small blocks stay in cache). A model
whose rules need their module's whole call, or that flattens the batch, takes the repeated-batch path instead
(:func:`repeated_batch`): :class:`covgrad.scores.engine.PerSampleGrads` on the batch repeated R times.

The estimators that build the cotangents are in :mod:`covgrad.tokens.fisher`.

Shape notation: B samples in the batch, L padded sequence length, V vocabulary, H hidden size, P selected
parameter elements, R cotangent rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from covgrad.choices import TOKENS_ROW_BYTES
from covgrad.distributed.fsdp import RankColumns
from covgrad.layout import ParamLayout, TensorEntry
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.hooks import graph_root
from covgrad.scores.rules import FLATTENING_PARENTS, Rule, Slot
from covgrad.scores.tracing import Binding, bind_rules

DEFAULT_ROW_BYTES: int = TOKENS_ROW_BYTES  # memory aimed at per block of rows
SQUARE_CHUNK: int = 1 << 22  # elements of squared gradients per matrix product of TokenBackward.square_sums_


def repeated_batch(model: nn.Module, bindings: list[Binding]) -> bool:
    """Whether :class:`TokenBackward` takes the repeated-batch path for ``model`` with the rule ``bindings`` of
    its selection (:func:`covgrad.scores.tracing.bind_rules`): a rule that needs its module's call (the generic
    path, fused experts) or a module that flattens the batch (:data:`covgrad.scores.rules.FLATTENING_PARENTS`).
    That path does not run on a sharded model."""
    return any(getattr(rule, "needs_call", False) for _, rule, _ in bindings) or any(
        type(m) in FLATTENING_PARENTS for m in model.modules()
    )


class TokenBackward:
    """One forward of a batch with per-sample hooks, then per-sample gradients of batched logit cotangents.

    The forward runs with every parameter frozen and saves each hooked module's input; the first hooked
    outputs become the graph's roots, so no batched weight gradient is ever formed. ``grads`` then
    takes R cotangents at once.

    Args:
        model: causal LM called as ``model(input_ids=, attention_mask=, position_ids=, use_cache=False)``
            returning ``.logits`` (B, L, V), in ``eval()``.
        layout: the selected parameters (the P axis).
        input_ids: shape (B, L) token ids.
        attention_mask: shape (B, L).
        position_ids: shape (B, L) or None for 0..L-1 on every row (right-padded rows).
        closed_form_head: allow the LM head weight's closed form (``head_entry``); False always takes it
            from the backward.
        columns: one rank's columns of a model sharded by :func:`covgrad.distributed.fsdp.shard_model` (the per-sample
            blocks are still formed whole, from the all-gathered layers); the weighted sums of
            :meth:`square_sums_` and the head's closed form then hold only these columns (``width`` = P_r),
            each column computed by the same products as without ranks. None: every column (P).

    Raises:
        ValueError: when the model is training, a selected parameter is not in the model or its module has
            no per-sample rule, or with ``columns`` when the model needs the repeated-batch path.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor | None = None,
        closed_form_head: bool = True,
        columns: RankColumns | None = None,
    ) -> None:
        training = [name for name, m in model.named_modules() if m.training]
        if training:
            raise ValueError(f"model must be in eval mode (dropout off); {training[0] or 'the model'} is training")
        params = dict(model.named_parameters())
        bindings = bind_rules(model, layout)
        self.layout = layout
        self.columns = columns
        self.width = layout.P if columns is None else columns.P
        self.B, self.L = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(self.L, device=input_ids.device).expand(self.B, self.L)
        head = model.get_output_embeddings()
        tied = head is None or head.weight is model.get_input_embeddings().weight
        # named before the forward: a sharded root holds its unsharded parameters in their place after it
        head_name = next((n for n, p in params.items() if head is not None and p is head.weight), None)
        self._calls: list[tuple[nn.Module, Rule, dict[str, TensorEntry], Tensor]] = []
        outputs: list[Tensor] = []
        head_io: list[tuple[Tensor, Tensor]] = []
        # Rules that read the whole module call (the generic torch.func rule, MoE experts) and modules run
        # on a flattened (B·L, …) batch go through PerSampleGrads on the batch repeated R times instead.
        self._repeat: PerSampleGrads | None = None
        inputs = (input_ids, attention_mask, position_ids)
        if repeated_batch(model, bindings):
            why = "a generic or fused-experts rule, or a flattening module"
            self._repeated_path(model, layout, columns, inputs, why)
            bindings = []
            closed_form_head = False

        def hooked(rule: Rule, local: dict[str, TensorEntry]) -> Callable:
            def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
                if args[0].shape[:1] != (self.B,) or output.shape[:1] != (self.B,):
                    raise ValueError(
                        f"a hooked {type(module).__name__} ran without the batch dimension {self.B}; "
                        "pass position_ids of shape (B, L)"
                    )
                if output.grad_fn is not None:
                    outputs.append(output)
                else:  # a graph root the model may update in place (inputs_embeds *= √d); also a leaf requiring grad
                    output = graph_root(output, outputs)
                self._calls.append((module, rule, local, args[0].detach()))
                if module is head:
                    head_io.append((args[0].detach(), output))
                return output

            return hook

        flags = [(p, p.requires_grad) for p in model.parameters()]
        handles = [m.register_forward_hook(hooked(rule, local)) for m, rule, local in bindings]
        try:
            for p, _ in flags:
                p.requires_grad_(False)
            with torch.set_grad_enabled(self._repeat is None):
                logits = model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                ).logits
        finally:
            for h in handles:
                h.remove()
            for p, flag in flags:
                p.requires_grad_(flag)
        ran = {id(m) for m, _, _, _ in self._calls}
        if self._repeat is None and any(id(m) not in ran for m, _, _ in bindings):
            # a module whose parameters its parent uses (LFM2's short conv: the parent calls F.conv1d on
            # conv.weight): its hook never ran, so only PerSampleGrads, which traces where parameters are used,
            # can give their rows
            silent = next(type(m).__name__ for m, _, _ in bindings if id(m) not in ran)
            why = f"a bound {silent} never runs its forward: its parent uses its parameters"
            self._repeated_path(model, layout, columns, inputs, why)
            self._calls, outputs, closed_form_head = [], [], False
            logits = logits.detach()
        self.logits = logits
        self._outputs = outputs
        last: dict[str, tuple[int, TensorEntry]] = {}
        for i, (_, _, local, _) in enumerate(self._calls):
            for entry in local.values():
                last[entry.name] = (i, entry)
        self._last_use: dict[int, list[TensorEntry]] = {}  # call index -> entries no later call writes
        for i, entry in last.values():
            self._last_use.setdefault(i, []).append(entry)
        # Closed form for the LM head weight: untied nn.Linear, selected, called once, output = logits.
        self.head_entry: TensorEntry | None = None
        self.hidden: Tensor | None = None
        if (
            closed_form_head
            and not tied
            and isinstance(head, nn.Linear)
            and head_name in layout.names
            and len(head_io) == 1
            and head_io[0][1] is logits
        ):
            self.head_entry = layout.entry(head_name)
            self.hidden = head_io[0][0]  # (B, L, H)

    def _repeated_path(
        self, model: nn.Module, layout: ParamLayout, columns: RankColumns | None, inputs: tuple, why: str
    ) -> None:
        """Take the repeated-batch path (PerSampleGrads on the batch repeated R times) because of ``why``.

        Raises:
            ValueError: on a sharded model (``columns``), where that path does not run.
        """
        if columns is not None:
            raise ValueError(
                f"{type(model).__name__} needs the repeated-batch path ({why}), which does not run on a sharded "
                "model; set scores.ranks=1 or tokens.enabled=false"
            )
        self._repeat = PerSampleGrads(model, layout, check=False)
        self._inputs = inputs

    @property
    def V(self) -> int:
        """Vocabulary size (last dimension of the logits)."""
        return self.logits.shape[-1]

    def rows_per_block(self, budget_bytes: int = DEFAULT_ROW_BYTES) -> int:
        """Cotangent rows per ``grads`` call that keep its memory near ``budget_bytes`` (at least 1)."""
        # gradient elements per row; the repeated-batch path holds a forward's activations per row instead
        act = sum(o.numel() for o in self._outputs) + self.logits.numel() * (8 if self._repeat else 1)
        per_row = 4 * (2 * act + 2 * self.B * self.layout.P)
        return max(1, budget_bytes // per_row)

    def grads(self, cot: Tensor, head: bool = True) -> Tensor:
        """Per-sample parameter gradients of R logit cotangents.

        Args:
            cot: shape (R, B, L, V): row r's gradient of the objective with respect to the logits.
            head: False skips the LM head weight's rule when it is in closed form (``head_entry`` set);
                its columns are then 0.

        Returns:
            shape (R, B, P) float32; [r, n] is ∇θ of row r's objective restricted to sample n.
        """
        R = cot.shape[0]
        if self._repeat is not None:
            return self._repeated(cot).view(R, self.B, self.layout.P)
        out = torch.zeros(R * self.B, self.layout.P, dtype=torch.float32, device=self.logits.device)
        self._apply_rules(cot, head, lambda e: out[:, e.offset : e.offset + e.numel], accumulate=True)
        return out.view(R, self.B, self.layout.P)

    def add_columns_(self, fisher: Tensor, offset: int, values: Tensor) -> None:
        """``fisher`` (n, width) += ``values`` (n, w), the values of global columns [offset, offset + w): all of
        them without ``columns``, else the parts the rank owns, at its local columns."""
        if self.columns is None:
            fisher[:, offset : offset + values.shape[1]].add_(values)
            return
        for a, b, at in self.columns.pieces(offset, offset + values.shape[1]):
            fisher[:, at : at + b - a].add_(values[:, a:b])

    def whole_entry(self, fisher: Tensor, e: TensorEntry) -> Tensor:
        """Entry ``e``'s (numel,) columns of a (width,) float64 sum: a view without ``columns``, else every
        rank's columns put together (a collective: each rank's columns in place, zeros elsewhere, summed over
        the ranks; every column is one rank's, so the values are exact)."""
        if self.columns is None:
            return fisher[e.offset : e.offset + e.numel]
        out = torch.zeros(e.numel, dtype=fisher.dtype, device=fisher.device)
        for a, b, at in self.columns.pieces(e.offset, e.offset + e.numel):
            out[a:b] = fisher[at : at + b - a]
        dist.all_reduce(out)
        return out

    def square_sums_(self, cot: Tensor, w: Tensor, fisher: Tensor, head: bool = True) -> Tensor:
        """``fisher`` (n, width) float64 += Σ_{r,b} w[r, b, i] g[r, b]² for each weighting i, where
        g = ``grads(cot)`` (the rank's columns with ``columns``: a column chunk's product is formed when the rank
        owns some of it, whole, as without ranks); returns the squared norms ‖g[r, b]‖² (R, B) float64 over
        every column.

        Holds one tensor's (R·B, numel) float32 block at a time (a tensor several modules use, e.g. tied
        embeddings, until its last module's rule has run), never the (R·B, P) gradients: per block the
        weighted sum over the R·B rows is a float32 matrix product, in column chunks, added to the float64
        ``fisher`` (its rounding is ~1e-7 relative). ``w``: (R, B, n) float64.
        """
        R, B, n = w.shape
        RB = R * B
        wf = w.reshape(RB, n).to(torch.float32)
        norms = torch.zeros(RB, dtype=torch.float64, device=w.device)
        chunk = max(1, SQUARE_CHUNK // RB)

        def consume(e: TensorEntry, blk: Tensor) -> None:
            sq = blk.square_()  # (R·B, numel)
            for lo in range(0, e.numel, chunk):
                hi = min(lo + chunk, e.numel)
                if self.columns is None or next(self.columns.pieces(e.offset + lo, e.offset + hi), None):
                    self.add_columns_(fisher, e.offset + lo, (sq[:, lo:hi].t() @ wf).t())
            norms.add_(sq.sum(-1))

        if self._repeat is not None:
            out = self._repeated(cot)
            for e in self.layout.entries:
                consume(e, out[:, e.offset : e.offset + e.numel])
            return norms.view(R, B)
        bufs: dict[str, Tensor] = {}

        def block_of(e: TensorEntry) -> Tensor:
            if e.name not in bufs:
                bufs[e.name] = torch.empty(RB, e.numel, dtype=torch.float32, device=self.logits.device)
            return bufs[e.name]

        self._apply_rules(cot, head, block_of, finished=lambda e: consume(e, bufs.pop(e.name)))
        return norms.view(R, B)

    def add_grads_(self, out: Tensor, cot: Tensor) -> Tensor:
        """``out += grads(cot)`` in place, for ``out`` (R·B, P) float32 rows (row r·B + n: row r, sample n),
        without a second (R·B, P) buffer; the LM head weight is taken from the backward. Returns ``out``."""
        RB = cot.shape[0] * self.B
        if out.shape != (RB, self.layout.P) or out.dtype != torch.float32:
            raise ValueError(f"out must be float32 ({RB}, {self.layout.P}); got {out.dtype} {tuple(out.shape)}")
        if self._repeat is not None:
            return out.add_(self._repeated(cot))
        self._apply_rules(cot, True, lambda e: out[:, e.offset : e.offset + e.numel], accumulate=True)
        return out

    def _repeated(self, cot: Tensor) -> Tensor:
        """The repeated-batch path: (R·B, P) per-sample gradients of the R cotangents from PerSampleGrads."""
        self._check_cot(cot)
        R = cot.shape[0]
        ids, attn, pos = (t.repeat(R, 1) for t in self._inputs)  # row r·B + n is sample n
        rows = cot.reshape(R * self.B, *self.logits.shape[1:])
        return self._repeat(ids, attn, lambda z: rows, position_ids=pos)

    def _check_cot(self, cot: Tensor) -> None:
        if cot.shape[1:] != self.logits.shape:
            raise ValueError(f"cot must have shape (R, *{tuple(self.logits.shape)}); got {tuple(cot.shape)}")

    def _apply_rules(
        self,
        cot: Tensor,
        head: bool,
        block_of: Callable[[TensorEntry], Tensor],
        accumulate: bool = False,
        finished: Callable[[TensorEntry], None] | None = None,
    ) -> set[str]:
        """One (batched) backward of ``cot`` (R, B, L, V) and every hooked module's rule, writing entry e's
        (R·B, numel) rows into ``block_of(e)`` (added to it when ``accumulate``); returns the names written.
        ``finished(e)`` is called once e's last module has run, for each entry written."""
        self._check_cot(cot)
        R = cot.shape[0]
        RB = R * self.B
        written: set[str] = set()
        skip = None if head or self.head_entry is None else self.head_entry.name
        if R == 1:  # a plain backward: no vmap, whose fallback loops over ops without a batching rule
            gs = torch.autograd.grad(
                self.logits, self._outputs, cot[0].to(self.logits.dtype), retain_graph=True, allow_unused=True
            )
            gs = [None if g is None else g[None] for g in gs]
        else:
            gs = torch.autograd.grad(
                self.logits,
                self._outputs,
                cot.to(self.logits.dtype),
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
            gs = list(gs)
        for i, (module, rule, local, x) in enumerate(self._calls):
            g, gs[i] = gs[i], None  # each output gradient is released once its rule has run
            if g is None:
                self._finish(i, written, finished)
                continue

            def slot(name: str, local: dict[str, TensorEntry] = local) -> tuple[Tensor, bool] | None:
                entry = local.get(name)
                if entry is None or entry.name == skip:
                    return None
                first = entry.name not in written and not accumulate
                written.add(entry.name)
                return block_of(entry).view(RB, *entry.shape), first

            xr = x.expand(R, *x.shape).reshape(RB, *x.shape[1:])
            rule(module, xr, g.reshape(RB, *g.shape[2:]), Slot(slot))
            del g, xr
            self._finish(i, written, finished)
        return written

    def _finish(self, i: int, written: set[str], finished: Callable[[TensorEntry], None] | None) -> None:
        """Hand ``finished`` every written entry whose last module is call ``i``."""
        if finished is None:
            return
        for entry in self._last_use.get(i, ()):
            if entry.name in written:
                finished(entry)
