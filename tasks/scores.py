"""scores stage: exact per-sample scores of the policy, centered under the policy or the sampler.

Store ``scores.zarr`` (dims: sample, param, row, batch):
- moment rows, always: ``count, mean_a, m2_a (row,)`` and ``mean_s, m2_s, c_as (row, param)``
  float64, two rows per batch (row 2b + h holds the batch's samples of prompt groups with parity h,
  for the cross-fit); a half with no samples has count 0;
- per-sample rows ``scores (sample, param)`` float32 when N·P·4 bytes fit ``scores.byte_budget``;
- ``advantage``, ``group (sample,)``, ``batch_done (batch,)``; attrs: the tensor table, centering.
Batches hold whole prompt groups, so group-relative advantages and the parity split stay exact.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
from prefect import task

from covgrad.centering import align_full_mu, align_topk_mu, kl_sampler_policy, mask_unscored
from covgrad.config import PipelineConfig
from covgrad.layout import select_parameters
from covgrad.persample import PerSampleGrads, batch_moments, score_logit_grad
from covgrad.sampling import recompute_sampler_logp
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done, pending_batches
from tasks.base_model import load_models
from tasks.common import StageResult, progress_bar, run_stage
from tasks.rollouts import STORE as ROLLOUTS
from tasks.rollouts import sampler_spec

STORE = "scores.zarr"
PARAM_CHUNK = 65536


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("scores.device=cuda but no CUDA device is visible; use auto or cpu")
        return torch.device("cuda")
    return torch.device("cpu")


def group_batches(group: np.ndarray, groups_per_batch: int) -> list[tuple[int, int]]:
    """[lo, hi) sample ranges, each holding ``groups_per_batch`` whole consecutive groups."""
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    bounds = [*starts[::groups_per_batch].tolist(), len(group)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class MuSource:
    """How the sampler's μ is obtained for one rollouts store (full, top-k record, or the sampler model:
    ``mu_model`` for imported rollouts)."""

    def __init__(self, store: ArtifactStore, base: ArtifactRef, cfg: PipelineConfig, ro: Any, sampler: str) -> None:
        s = cfg.rollouts.samplers[sampler]
        self.ro = ro
        self.kind = "full" if "mu_logp" in ro else "topk" if "mu_topk_ids" in ro else "model"
        self.spec = sampler_spec(s)
        self.model = None
        self.kl: tuple[float, int] = (0.0, 0)
        if self.kind == "model":
            if s.import_path is not None and s.mu_model is None:
                raise ValueError(
                    f"sampler centering for imported rollouts {sampler!r} needs a μ source: "
                    f"rollouts.samplers.{sampler}.on_policy: true, a mu_model checkpoint, or top_logprobs in the file"
                )
            self.model = load_models(store, base, s.mu_model or s.model, cfg)[0]

    def dlogits_fn(self, lo: int, hi: int, tokens: torch.Tensor, pl: torch.Tensor, rl: torch.Tensor, target):
        """The logit-gradient function of batch [lo, hi) under sampler centering. Each call also
        records the batch's Σ KL(μ‖p) over scored tokens and their count in ``self.kl``."""
        L = tokens.shape[1]
        if self.kind == "full":
            fixed = align_full_mu(torch.from_numpy(self.ro["mu_logp"][lo:hi]), pl, rl, L)
        elif self.kind == "model":
            fixed = mask_unscored(recompute_sampler_logp(self.model, tokens, pl, rl, self.spec), target.bool())
        else:
            ids = torch.from_numpy(self.ro["mu_topk_ids"][lo:hi])
            logp = torch.from_numpy(self.ro["mu_topk_logp"][lo:hi])
            tail = torch.from_numpy(self.ro["mu_tail"][lo:hi])

        def fn(logits: torch.Tensor) -> torch.Tensor:
            if self.kind == "topk":
                mu = align_topk_mu(logits.detach().float().cpu(), ids, logp, tail, pl, rl)
            else:
                mu = fixed
            self.kl = kl_sampler_policy(mu, logits.detach().cpu(), target)
            dev = logits.device
            return score_logit_grad(logits, tokens.to(dev), target.to(dev), mu=mu.to(dev))

        return fn


class ScoresJob:
    """One scores artifact as three explicit steps, so that shards can share a store:
    ``prepare`` creates every array (once, before any shard runs), ``run(shard)`` computes the
    pending batches b with b % n == i for ``shard = (i, n)``, and ``finalize`` writes the attributes
    and consolidated metadata once every batch is done."""

    def __init__(
        self, store: ArtifactStore, ref: ArtifactRef, cfg: PipelineConfig, instance: str, up: dict[str, ArtifactRef]
    ) -> None:
        _, self.sampler, self.centering = instance.split(".")
        self.store, self.ref, self.cfg = store, ref, cfg
        self.ro = store.open_group(up[f"rollouts.{self.sampler}"], ROLLOUTS, mode="r")
        self.model, _ = load_models(store, up["base_model"], "policy", cfg)
        self.device = pick_device(cfg.scores.device)
        self.model.to(self.device).eval()
        self.layout = select_parameters(self.model, cfg.scores.params)
        self.group = self.ro["group"][:]
        self.adv = self.ro["advantage"][:]
        self.N, self.P = len(self.group), self.layout.P
        self.batches = group_batches(self.group, cfg.scores.groups_per_batch)
        self.B = max(hi - lo for lo, hi in self.batches)
        self.keep_rows = cfg.scores.byte_budget >= self.N * self.P * 4 and all(
            hi - lo == self.B for lo, hi in self.batches[:-1]
        )
        sampler_centered = self.centering == "sampler"
        self.mu_source = MuSource(store, up["base_model"], cfg, self.ro, self.sampler) if sampler_centered else None

    def prepare(self) -> None:
        """Create the store's arrays (idempotent: existing arrays and finished batches are kept)."""
        g = self.store.open_group(self.ref, STORE, mode="a")
        N, P, nb = self.N, self.P, len(self.batches)
        chunk_p = min(P, PARAM_CHUNK)

        def arr(name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, dims: list[str]) -> None:
            if name not in g:
                g.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0, dimension_names=dims)

        for name in ("count", "mean_a", "m2_a"):
            arr(name, (2 * nb,), (2,), "float64", ["row"])
        for name in ("mean_s", "m2_s", "c_as"):
            arr(name, (2 * nb, P), (2, chunk_p), "float64", ["row", "param"])
        if self.keep_rows:
            arr("scores", (N, P), (self.B, chunk_p), "float32", ["sample", "param"])
        if self.mu_source is not None:
            arr("kl_sum", (nb,), (1,), "float64", ["batch"])
            arr("kl_tokens", (nb,), (1,), "float64", ["batch"])
        arr("advantage", (N,), (N,), "float64", ["sample"])
        arr("group", (N,), (N,), "int64", ["sample"])
        g["advantage"][:] = self.adv
        g["group"][:] = self.group
        create_progress(g, nb)

    def run(self, shard: tuple[int, int] = (0, 1)) -> None:
        """Compute and write the pending batches of ``shard``; each batch is marked done after its data."""
        g = self.store.open_group(self.ref, STORE, mode="a")
        ro, device, mu_source = self.ro, self.device, self.mu_source
        psg = PerSampleGrads(self.model, self.layout, check=self.cfg.scores.self_check)
        buffer = torch.empty((self.B, self.P), dtype=torch.float32, device=device)  # reused: fresh pages are slow
        todo = [b for b in pending_batches(g) if b % shard[1] == shard[0]]
        with progress_bar(f"scores {self.sampler}/{self.centering}", len(self.batches)) as bar:
            bar.update(len(self.batches) - len(todo))
            for b in todo:
                lo, hi = self.batches[b]
                tokens = torch.from_numpy(ro["tokens"][lo:hi]).long()
                pl = torch.from_numpy(ro["prompt_len"][lo:hi]).long()
                rl = torch.from_numpy(ro["response_len"][lo:hi]).long()
                target = torch.from_numpy(ro["response_mask"][lo:hi]).float()
                attn = (torch.arange(tokens.shape[1]).unsqueeze(0) < (pl + rl).unsqueeze(1)).long()
                if mu_source is None:
                    fn = partial(score_logit_grad, input_ids=tokens.to(device), target_mask=target.to(device))
                else:
                    fn = mu_source.dlogits_fn(lo, hi, tokens, pl, rl, target)
                pos = torch.arange(tokens.shape[1]).expand_as(tokens)  # right-padded rows: positions 0..L-1
                S = psg(tokens.to(device), attn.to(device), fn, position_ids=pos.to(device), out=buffer[: hi - lo])
                S = S.cpu()  # (b, P) float32
                a = torch.from_numpy(self.adv[lo:hi])
                half = torch.from_numpy(self.group[lo:hi] % 2)
                for h in (0, 1):
                    sel = half == h
                    if bool(sel.any()):
                        for name, value in batch_moments(S[sel], a[sel]).items():
                            g[name][2 * b + h] = value
                if self.keep_rows:
                    g["scores"][lo:hi] = S.numpy()
                if mu_source is not None:
                    g["kl_sum"][b], g["kl_tokens"][b] = mu_source.kl
                mark_batch_done(g, b)
                bar.update(1)

    def finalize(self) -> dict[str, Any] | None:
        """Write attrs and consolidated metadata when every batch is done; return the provenance
        (None while batches are pending)."""
        g = self.store.open_group(self.ref, STORE, mode="a")
        if pending_batches(g):
            return None
        g.attrs.update(
            {
                "tensors": self.layout.to_records(),
                "centering": self.centering,
                "sampler": self.sampler,
                "n_samples": self.N,
                "n_params": self.P,
                "per_sample_rows": self.keep_rows,
                "device": str(self.device),
                "dtype": self.cfg.model.dtype,
            }
        )
        if self.mu_source is not None:
            kl = float(g["kl_sum"][:].sum() / max(g["kl_tokens"][:].sum(), 1.0))
            g.attrs["kl_sampler_policy_per_token"] = kl
        self.store.consolidate(self.ref, STORE)
        return {"n_samples": self.N, "n_params": self.P, "per_sample_rows": self.keep_rows}


def _compute(
    store: ArtifactStore, ref: ArtifactRef, cfg: PipelineConfig, instance: str, up: dict[str, ArtifactRef]
) -> dict[str, Any] | None:
    job = ScoresJob(store, ref, cfg, instance, up)
    job.prepare()
    job.run()
    return job.finalize()


@task(name="scores")
def scores_task(ref: ArtifactRef, cfg: PipelineConfig, instance: str, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Per-sample scores of ``scores.<sampler>.<centering>``."""
    return run_stage(
        ref,
        {"instance": instance, "params": cfg.scores.params},
        lambda store, r: _compute(store, r, cfg, instance, upstream),
        resumable=True,
    )
