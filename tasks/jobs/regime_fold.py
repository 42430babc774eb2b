"""The fold of one regime stage: an analysed post-training objective's per-sample gradients in moment state.

``regime.<name>`` folds the regime's g_n through the scores machinery (:class:`covgrad.regimes.cotangents.RegimeGrad`
as the logit-gradient function), each prompt group's sum S_c as one row whose advantage is the group's size
(:class:`covgrad.moments.accum.GroupAccumulator`: G and its prompt-clustered standard error), into a
:class:`storage.stores.scores.ScoresStore` (the same layout, checkpoints and resume as a scores artifact, one job,
moment state only); plus each batch's bound scalars per half
(:mod:`storage.stores.regimes`), written before its checkpoint. The teacher and the reference run one forward on
the same padded batch; a teacher with a ``teacher_prompt`` (context distillation) runs on its own prompts
followed by the same response tokens (:func:`covgrad.regimes.context.prefixed_batch`), its logits moved back to the
policy's positions. With ``responses: teacher`` the responses are the teacher's own samples, drawn once per
run (seeded like the sampler's rollouts) and scored after the policy's prompts. The stage, and the regimes'
statistics: :mod:`tasks.regimes`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from covgrad.config import SamplerSection
from covgrad.devices import check_state_fits, pick_device
from covgrad.layout import select_parameters
from covgrad.models import context_length
from covgrad.moments import GroupAccumulator
from covgrad.regimes import (
    FULL_DISTRIBUTION_KINDS,
    RegimeGrad,
    align_prefixed_logits,
    head_token_fisher,
    prefixed_batch,
    regime_of,
)
from covgrad.rollouts import (
    RolloutBatch,
    SamplerSpec,
    check_context,
    generate,
    group_batches,
    response_texts,
    score_rewards,
)
from covgrad.scores import Cotangent, PerSampleGrads
from covgrad.tokens import head_forward
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_fixed_model, load_models, vocab_size
from storage.schema import ROLLOUTS
from storage.stores.prompts import load_task, prompt_places
from storage.stores.regimes import IMPORTED, create_bound_arrays, teacher_prompt_texts, write_bound, write_head_fisher
from storage.stores.rollouts import read_batch
from storage.stores.scores import ScoresStore
from tasks.specs import RegimeSpec


class RegimeJob:
    """One regime fold of regime spec ``spec`` (a ``tasks.specs.RegimeSpec``): the policy, teacher and reference
    models, the rollouts' batches and the store."""

    def __init__(
        self,
        store: ArtifactStore,
        ref: ArtifactRef,
        spec: RegimeSpec,
        up: dict[str, ArtifactRef],
        lead: RegimeJob | None = None,
    ) -> None:
        self.spec, self.regime, self.ref = spec, regime_of(spec.settings), ref
        if lead is None:  # its own policy, rollouts and loaded models
            self.ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
            self.device = pick_device(spec.device)
            model, self.tokenizer = load_models(store, up["base_model"], "policy", spec.policy)
            self.model = model.to(self.device).eval()
            self.layout = select_parameters(self.model, spec.params)
            self.loaded: dict[str, Any] = {}
        else:  # a member of ``lead``'s pass: the same policy, rollouts and batches
            self.ro, self.device, self.tokenizer = lead.ro, lead.device, lead.tokenizer
            self.model, self.layout, self.loaded = lead.model, lead.layout, lead.loaded
        r, V = spec.settings, vocab_size(self.model)
        self.teacher = self._model(store, up, r.teacher, V, "teacher")
        self.reference = self._model(store, up, r.reference if r.kl_beta else None, V, "reference")
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.teacher_prompts = self._teacher_prompts() if r.teacher_prompt is not None else None
        self.samples = self._teacher_samples() if r.responses == "teacher" else None
        source = self.ro if self.samples is None else self.samples
        self.group, self.adv = source["group"][:], source["advantage"][:]
        self.prompt_index = source["prompt_index"][:]
        self.batches = group_batches(self.group, spec.groups_per_batch)
        B = max(hi - lo for lo, hi in self.batches)
        for field, name in IMPORTED.items():
            wanted = r.advantages == "imported" if field == "advantages" else r.teacher_logprobs
            if wanted and name not in self.ro:
                raise ValueError(f"regime {spec.name}: the rollouts of {spec.sampler!r} hold no imported {field} field")
        N, nb, P = len(self.group), len(self.batches), self.layout.P
        self.group_comoment = len(set(np.unique(self.group, return_counts=True)[1].tolist())) > 1
        state = spec.state_dtype
        self.out = ScoresStore(store, ref, N, nb, B, 1, [P], state, keep_rows=False, comoment=self.group_comoment)

    def _model(self, store: ArtifactStore, up: dict[str, ArtifactRef], which: str | None, V: int, role: str) -> Any:
        """The teacher or reference ``which`` (None: none) on the device; ValueError for another vocabulary."""
        if which is None:
            return None
        if which == "policy":
            return self.model.to(self.device).eval()
        if which not in self.loaded:  # else loaded by another fold of the same pass
            model = load_fixed_model(
                store,
                up["base_model"],
                which,
                self.spec.policy,
                regime=self.spec.name,
                role=role,
                policy_vocab=V,
                trained=up.get("teacher"),
            )
            self.loaded[which] = model.to(self.device).eval()
        return self.loaded[which]

    def _teacher_prompts(self) -> list[list[int]]:
        """The token ids of the teacher's prompt for every prompt of the task (context distillation), each
        checked against the teacher's context with the sampler's response budget."""
        spec, r = self.spec, self.spec.settings
        assert spec.task is not None and r.teacher_prompt is not None
        what = f"regimes.{spec.name}.teacher_prompt"
        prompts = [self.tokenizer(t)["input_ids"] for t in teacher_prompt_texts(r.teacher_prompt, spec.task, what)]
        T = int(self.ro.attrs["sampler_spec"]["max_new_tokens"])
        where = prompt_places(spec.task, len(prompts))
        limit = context_length(self.teacher, self.tokenizer, spec.policy.max_length)
        try:
            check_context([len(p) for p in prompts], where, T, limit, f"rollouts.samplers.{spec.sampler}")
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
        return prompts

    def _policy_prompts(self) -> dict[int, list[int]]:
        """The policy's prompt tokens of every prompt index of the rollouts."""
        pidx, pl = self.ro["prompt_index"][:], self.ro["prompt_len"][:]
        first = {int(i): n for n, i in reversed(list(enumerate(pidx)))}
        return {i: self.ro["tokens"][n, : int(pl[n])].tolist() for i, n in sorted(first.items())}

    def _teacher_samples(self) -> dict[str, np.ndarray]:
        """The teacher's own samples, rollouts-store arrays in memory: ``group_size`` responses per prompt of the
        sampler's rollouts, drawn from the teacher at its temperature, untruncated (μ = q exactly), on the teacher's
        prompt (or the policy's), seeded like the sampler; each row is the policy's prompt then the response."""
        spec, r = self.spec, self.spec.settings
        s = SamplerSection(**self.ro.attrs["sampler_spec"])
        policy_prompts = self._policy_prompts()
        ids = list(policy_prompts)
        prompts = [policy_prompts[i] if self.teacher_prompts is None else self.teacher_prompts[i] for i in ids]
        eos = int(self.tokenizer.eos_token_id)
        out = generate(
            self.teacher,
            prompts,
            ids,
            s.group_size,
            SamplerSpec(temperature=r.teacher_temperature, max_new_tokens=s.max_new_tokens),
            s.seed,
            batch_size=s.batch_size,
            eos_id=eos,
            pad_id=self.pad_id,
        )
        pidx = [ids[int(k)] for k in out["prompt_index"]]
        pl = np.asarray([len(policy_prompts[i]) for i in pidx], dtype=np.int64)
        rl = out["response_len"].numpy().astype(np.int64)
        qpl = out["prompt_len"].numpy()
        width = int(max(pl) + s.max_new_tokens)
        tokens = np.full((len(pidx), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(pidx), width), dtype=np.float32)
        for n, i in enumerate(pidx):
            tokens[n, : pl[n]] = policy_prompts[i]
            tokens[n, pl[n] : pl[n] + rl[n]] = out["tokens"][n, qpl[n] : qpl[n] + rl[n]].numpy()
            mask[n, pl[n] : pl[n] + rl[n]] = 1.0
        problems, reward_fn = load_task(spec.task)
        texts = response_texts(self.tokenizer, tokens.tolist(), pl, rl)
        rewards = score_rewards(
            reward_fn, [problems[i].prompt for i in pidx], texts, [problems[i].answer for i in pidx]
        )
        self.teacher_reward = float(np.mean(rewards))
        group = np.asarray(pidx, dtype=np.int64)
        return {
            "tokens": tokens,
            "prompt_len": pl,
            "response_len": rl,
            "response_mask": mask,
            "group": group,
            "prompt_index": group,
            "advantage": np.zeros(len(pidx)),
        }

    def _read(self, b: int) -> RolloutBatch:
        lo, hi = self.batches[b]
        if self.samples is not None:
            d = self.samples
            keys = ("tokens", "prompt_len", "response_len", "response_mask", "advantage", "group")
            return RolloutBatch.from_arrays(*(d[k][lo:hi] for k in keys), trim=False)
        batch = read_batch(self.ro, lo, hi, trim=False)
        return RolloutBatch(**{**batch.__dict__, "advantages": torch.zeros_like(batch.advantages)})

    @torch.no_grad()
    def _logits(self, model: Any, batch: RolloutBatch) -> torch.Tensor:
        dev = self.device
        ids, attn, pos = batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.position_ids.to(dev)
        return model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.detach()

    @torch.no_grad()
    def _teacher_logits(self, b: int, batch: RolloutBatch) -> torch.Tensor:
        """The teacher's logits (B, L, V) aligned like the policy's: on the same rows, or (context distillation)
        on its own prompts followed by the same responses, moved back to the policy's positions."""
        if self.teacher_prompts is None:
            return self._logits(self.teacher, batch)
        lo, hi = self.batches[b]
        pl, rl = batch.prompt_len.tolist(), batch.response_len.tolist()
        responses = [batch.input_ids[n, pl[n] : pl[n] + rl[n]].tolist() for n in range(batch.size)]
        prompts = [self.teacher_prompts[int(i)] for i in self.prompt_index[lo:hi]]
        pb = prefixed_batch(prompts, responses, self.pad_id)
        dev = self.device
        zq = self.teacher(
            input_ids=pb.input_ids.to(dev),
            attention_mask=pb.attention_mask.to(dev),
            position_ids=pb.position_ids.to(dev),
        ).logits.detach()
        return align_prefixed_logits(zq, pb.start, batch.prompt_len, batch.response_len, batch.input_ids.shape[1])

    def _imported(self, field: str, lo: int, hi: int) -> torch.Tensor:
        return torch.from_numpy(self.ro[IMPORTED[field]][lo:hi].astype(np.float64))

    def _logit_grad(self, b: int, batch: RolloutBatch) -> RegimeGrad:
        lo, hi = self.batches[b]
        r = self.spec.settings
        adv = None
        if self.regime.kind in ("rl", "rl_token") and r.advantages != "none":
            adv = (
                torch.from_numpy(self.adv[lo:hi])
                if r.advantages == "sequence"
                else self._imported("advantages", lo, hi)
            )
        fn = RegimeGrad(
            self.regime,
            batch.input_ids.to(self.device),
            batch.response_mask.to(self.device),
            advantages=adv,
            teacher_logits=None if self.teacher is None else self._teacher_logits(b, batch),
            teacher_logprobs=self._imported("teacher_logprobs", lo, hi) if r.teacher_logprobs else None,
            ref_logits=None if self.reference is None else self._logits(self.reference, batch),
        )
        return fn

    def _prepare(self) -> None:
        self.out.prepare(np.zeros_like(self.adv), self.group, kl=False)
        create_bound_arrays(self.out.open(), len(self.batches))

    def _finish(self) -> dict[str, Any] | None:
        """Finalize the store once every batch is folded; the provenance (None while batches are pending)."""
        spec = self.spec
        sampler = spec.sampler if self.samples is None else "teacher"
        if not self.out.finalize(self.layout, "policy", sampler, str(self.device), spec.policy.dtype):
            return None
        attrs = {"regime": spec.name, "kind": self.regime.kind}
        if self.regime.kind in FULL_DISTRIBUTION_KINDS:
            self._head_fisher()
        if self.samples is not None:
            attrs["teacher_mean_reward"] = self.teacher_reward
        self.out.open().attrs.update(attrs)
        self.out.store.consolidate(self.out.ref, "scores.zarr")
        info = {"regime": spec.name, "kind": self.regime.kind, "n_samples": len(self.group), "n_params": self.layout.P}
        if self.samples is not None:
            info["teacher_mean_reward"] = self.teacher_reward
        return info

    def _head_fisher(self) -> None:
        """The LM head's token Fisher at this fold's rows (one policy forward per batch), summed per half into
        the store (``storage.stores.regimes.write_head_fisher``), when the head is selected and in closed form."""
        sums, counts, found = None, np.zeros(2), None
        for b in range(len(self.batches)):
            batch, dev = self._read(b), self.device
            io = head_forward(
                self.model, batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.position_ids.to(dev)
            )
            if io is None or io[0] not in self.layout.names:
                return
            found, hidden, logits = io
            half = batch.group % 2
            part = head_token_fisher(hidden, logits, batch.response_mask.to(dev), half, self.regime.temperature)
            sums = part if sums is None else sums + part
            np.add.at(counts, half.numpy(), 1.0)
        if found is not None and sums is not None:
            write_head_fisher(self.out.open(), self.layout.entry(found), sums.cpu().numpy(), counts)

    def run(
        self, progress: Callable[[str, int], Any], members: Sequence[RegimeJob] = ()
    ) -> list[dict[str, Any] | None]:
        """Fold every batch (resuming from the newest complete checkpoint), reporting to ``progress(label,
        total)`` (a context manager with ``update(n)``); finalize; the provenance of this fold, then of each of
        ``members``: other folds of the same batches (made with ``lead=self``), folded in the same pass
        (:func:`fold_pass`) and finalized too (the caller writes their completion markers)."""
        jobs = [self, *members]
        if any(m.batches != self.batches or m.samples is not None for m in members):
            raise ValueError(f"regime {self.spec.name}: a pass folds the same rollouts' batches in every regime")
        for job in jobs:
            job._prepare()
        P = self.layout.P
        check_state_fits(
            self.device, P * len(jobs), self.spec.state_dtype, f"regime {self.spec.name}", self.group_comoment
        )
        psg = PerSampleGrads(self.model, self.layout, check=self.spec.self_check)
        label = "regime " + " + ".join(j.spec.name for j in jobs)
        with ExitStack() as stack:
            accs = [GroupAccumulator(P, self.device, j.spec.state_dtype, comoment=self.group_comoment) for j in jobs]
            writers = [
                stack.enter_context(j.out.job((0, 0), a, list(range(len(j.batches))), j.batches))
                for j, a in zip(jobs, accs, strict=True)
            ]
            bar = stack.enter_context(progress(label, len(self.batches)))
            bar.update(len(self.batches) - max(len(w.todo) for w in writers))
            fold_pass(self, psg, list(zip(jobs, accs, writers, strict=True)), bar)
        return [j._finish() for j in jobs]


def fold_pass(
    lead: RegimeJob, psg: PerSampleGrads, folds: list[tuple[RegimeJob, GroupAccumulator, Any]], bar: Any
) -> None:
    """Fold the remaining batches of every (job, accumulator, writer) of ``folds`` in one pass: per batch one
    policy forward and one per-sample backward per regime that still needs the batch
    (:meth:`PerSampleGrads.accumulate_many`, the same bytes per accumulator as its own pass), then each
    fold's bound scalars and, at its cadence, its checkpoint. Folds resumed from different checkpoints (a
    kill between two of them) each fold exactly the batches after their own."""
    spec = lead.spec
    order = max((w.todo for _, _, w in folds), key=len)
    since: list[list[int]] = [[] for _ in folds]
    folded = [w.done for _, _, w in folds]
    saved = [time.monotonic()] * len(folds)
    for b in order:
        batch, dev = lead._read(b), lead.device
        active = [k for k, (_, _, w) in enumerate(folds) if b in w.todo]
        fns = {k: folds[k][0]._logit_grad(b, batch) for k in active}
        half = (batch.group % 2).numpy()
        for k in active:
            folds[k][1].set_groups(batch.group)
        cotangents = [Cotangent(fns[k], folds[k][1], batch.advantages, half) for k in active]
        psg.accumulate_many(
            batch.input_ids.to(dev), batch.attention_mask.to(dev), cotangents, batch.position_ids.to(dev)
        )
        for k in active:
            w = folds[k][2]
            sums, counts = np.zeros(2), np.zeros(2)
            if fns[k].bound_sq is not None:
                np.add.at(sums, half, fns[k].bound_sq.detach().cpu().numpy())
                np.add.at(counts, half, 1.0)
            write_bound(w.g, b, sums, counts)
            since[k].append(b)
            folded[k] += 1
            final = b == w.todo[-1]
            if (
                final
                or len(since[k]) >= spec.checkpoint_batches
                or time.monotonic() - saved[k] >= spec.checkpoint_seconds
            ):
                w.checkpoint(folded[k], final, since[k])
                since[k], saved[k] = [], time.monotonic()
        bar.update(1)
