"""A TRL ``GRPOTrainer`` callback that records what covgrad needs to analyse the run: every generation's
rollouts as covgrad's rollout JSONL and Hugging Face checkpoints at chosen steps (optional extra ``trl``).

Use::

    recorder = CovgradRecorder("run/covgrad", checkpoint_steps=[0, 1, 2, 4, 8])
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=..., callbacks=[recorder])
    recorder.attach(trainer)
    trainer.train()

Files under ``out_dir``:

- ``rollouts.jsonl``: one record per completion, covgrad's own format (``docs/formats.md``): ``prompt_ids``
  (the prompt without its left padding), ``response_ids`` (the completion up to and including its EOS, as
  TRL's ``completion_mask`` marks it), ``logprobs`` (the sampler's log-probability of each response token:
  TRL's ``sampling_per_token_logps`` when it has them (vLLM), else recomputed from the model that generated,
  at the generation's temperature / top-k / top-p, ``covgrad.rollouts.sampling.sampler_log_probs``), ``reward`` (the
  weighted sum over reward functions that TRL logs; reward functions returning None count 0), ``group``
  (``"{generation}-{prompt}"``: the completions of one prompt in one generation batch), ``advantage`` (TRL's
  sequence advantage) and ``advantages`` (it, once per response token), ``policy_version`` (the optimizer
  steps taken before the generation) and ``sampling_params``. With ``mask_truncated_completions`` a truncated
  completion, which TRL leaves out of the loss, is recorded whole with ``advantage`` 0 (what TRL trains it on;
  its reward still counts in its group's statistics, as in TRL): regime ``rl_token`` with ``advantages:
  imported`` steps on exactly what TRL trained on.
- ``checkpoints/step_{t:06d}``: ``save_pretrained`` of the model and its tokenizer after t optimizer steps
  (t = 0: before the first step), for the steps in ``checkpoint_steps`` (every step when None);
- ``manifest.json``: ``{"checkpoints": [{"step": t, "path": "checkpoints/step_..."}, ...], "rollouts":
  "rollouts.jsonl", "trl_version": ..., "sampling_params": ...}``, rewritten after every checkpoint.

``storage.stores.trajectory.checkpoint_series`` reads the manifest; the rollouts import as any covgrad JSONL
(``rollouts.samplers.<name>.import_path``). One process only (no distributed gather of the records).

``CovgradInRun`` computes the statistics inside the run instead (:mod:`covgrad.integrations.inrun`)::

    inrun = CovgradInRun("run/inrun", every_n=10)
    trainer = GRPOTrainer(..., callbacks=[inrun])
    inrun.attach(trainer)

Every ``every_n`` steps it folds the generation batch the trainer is about to train on, at the weights that
generated it (the step's θ_t): rows prompt + completion as TRL forms them, TRL's loss mask (``completion_mask``,
times ``tool_mask`` when present: a completion ``mask_truncated_completions`` left out scores 0), TRL's sequence
advantages, its prompt groups of ``num_generations`` and its temperature.

On a trainer of several processes (``accelerate launch`` / ``torchrun``: the policy replicated by DDP or sharded by
FSDP2) every process attaches its own ``CovgradInRun``: :meth:`CovgradInRun.attach` takes the engine's trace on
the unsharded policy (:func:`covgrad.integrations.ranks.prepare_ranks`, collective), and at the first generation
of the training loop, after accelerate has wrapped or sharded the model, each process builds a
:class:`covgrad.integrations.ranks.RankInRunFolder`: a due step folds every process's rows (its slice of the
global batch, groups numbered across the processes as TRL's advantages group them) into the columns each rank
owns, and process 0 writes the files.

Attached to TRL's on-policy ``DistillationTrainer`` it folds the student's generation batch the same way with
:class:`covgrad.integrations.inrun.InRunRegimeFolder`: F of the student's scores, and the G of TRL's divergence
(``beta=1``: ``distill_reverse_kl``, ``beta=0``: ``distill_forward_kl``; a generalized JSD, 0 < β < 1, has no
covgrad regime and is refused) from the teacher's logits of the same rows, both at TRL's temperature. TRL's loss
is a token mean over the batch, so its step's −∇ is (N/T)·G, T the batch's loss tokens (docs/regimes.md,
"Matching TRL's DistillationTrainer").
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from covgrad.integrations.blocks import BLOCK
from covgrad.integrations.inrun import VECTORS, InRunFolder, InRunRegimeFolder
from covgrad.integrations.ranks import RankInRunFolder, prepare_ranks
from covgrad.regimes.cotangents import Regime
from covgrad.rollouts.sampling import SamplerSpec, sampler_log_probs

MANIFEST = "manifest.json"
ROLLOUTS = "rollouts.jsonl"
DISTILL_REGIMES = {1.0: "distill_reverse_kl", 0.0: "distill_forward_kl"}  # DistillationTrainer's beta -> regime


def _sampling(args: Any) -> dict[str, Any]:
    """The sampling parameters of TRL's generation; ValueError for the ones covgrad cannot reproduce."""
    top_k = int(args.top_k or 0)
    params = {"temperature": float(args.temperature), "top_p": float(args.top_p), "top_k": top_k}
    unsupported = {
        "min_p": args.min_p,
        "repetition_penalty": None if args.repetition_penalty == 1.0 else args.repetition_penalty,
        "generation_kwargs": args.generation_kwargs or None,
    }
    bad = {k: v for k, v in unsupported.items() if v is not None}
    if bad:
        raise ValueError(
            f"CovgradRecorder: the sampler's log-probs cannot be recomputed with {bad}; "
            "use temperature, top_p and top_k only"
        )
    return params


def _before_padding(completion_ids: torch.Tensor, processing_class: Any) -> torch.Tensor:
    """(N, C) bool: the positions of right-padded completion rows ``completion_ids`` (N, C) up to their last
    non-pad token. A truncated completion ends in a token that is neither EOS nor pad (TRL's test for
    ``mask_truncated_completions``), so this is exactly its tokens."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor holds its tokenizer
    real = completion_ids != tokenizer.pad_token_id  # (N, C)
    last = torch.where(real, torch.arange(completion_ids.shape[1]), -1).amax(1)  # (N,)
    return torch.arange(completion_ids.shape[1])[None, :] <= last[:, None]


class CovgradRecorder(TrainerCallback):
    """Records a ``GRPOTrainer`` run for covgrad (see the module docstring).

    Args:
        out_dir: where the rollouts, checkpoints and manifest go (created).
        checkpoint_steps: the optimizer steps after which a checkpoint is saved (0: the start); None: all.
    """

    def __init__(self, out_dir: str | Path, checkpoint_steps: Iterable[int] | None = None) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.steps = None if checkpoint_steps is None else {int(s) for s in checkpoint_steps}
        self.checkpoints: list[dict[str, Any]] = []
        self.generations = 0
        self.trainer: Any = None
        self.sampling: dict[str, Any] = {}
        self._rewards: torch.Tensor | None = None
        (self.out / ROLLOUTS).write_text("")

    def attach(self, trainer: Any) -> CovgradRecorder:
        """Wrap ``trainer``'s generation and reward computation so every generation batch is recorded."""
        if getattr(trainer.accelerator, "num_processes", 1) != 1:
            raise ValueError("CovgradRecorder records one process; run the trainer on one process")
        self.trainer, self.sampling = trainer, _sampling(trainer.args)
        rewards_fn, generate_fn = trainer._calculate_rewards, trainer._generate_and_score_completions

        def calculate_rewards(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = rewards_fn(*args, **kwargs)
            self._rewards = out.detach().clone()
            return out

        def generate_and_score(inputs: Any) -> dict[str, Any]:
            out = generate_fn(inputs)
            if trainer.model.training:  # evaluation generations are not the run's samples
                self._record(out)
            return out

        trainer._calculate_rewards = calculate_rewards
        trainer._generate_and_score_completions = generate_and_score
        return self

    def _record(self, out: dict[str, Any]) -> None:
        """Append one generation batch's records to the rollouts file."""
        trainer = self.trainer
        if self._rewards is None:
            raise RuntimeError("CovgradRecorder: the generation computed no rewards")
        weights = trainer.reward_weights.to(self._rewards.device)
        rewards = (self._rewards * weights[None]).nansum(1).double().cpu()  # (N,)
        prompt_ids, prompt_mask = out["prompt_ids"].cpu(), out["prompt_mask"].cpu().bool()
        comp_ids, comp_mask = out["completion_ids"].cpu(), out["completion_mask"].cpu().bool()
        advantages = out["advantages"].detach().double().cpu()
        if trainer.mask_truncated_completions:
            masked = ~comp_mask.any(1)  # (N,) truncated completions whose loss mask TRL zeroed
            comp_mask = comp_mask | (masked[:, None] & _before_padding(comp_ids, trainer.processing_class))
            advantages = advantages.masked_fill(masked, 0.0)  # what TRL trains them on: nothing
        prompts = [p[m].tolist() for p, m in zip(prompt_ids, prompt_mask, strict=True)]
        responses = [c[m].tolist() for c, m in zip(comp_ids, comp_mask, strict=True)]
        if "sampling_per_token_logps" in out:
            lp = out["sampling_per_token_logps"].detach().float().cpu()
            logprobs = [row[m].tolist() for row, m in zip(lp, comp_mask, strict=True)]
        else:
            logprobs = self._sampler_logprobs(prompts, responses)
        G = int(trainer.num_generations)
        step = int(trainer.state.global_step)
        with (self.out / ROLLOUTS).open("a") as f:
            for n, (p, r, lp_n) in enumerate(zip(prompts, responses, logprobs, strict=True)):
                if not r:
                    raise ValueError(f"CovgradRecorder: completion {n} of generation {self.generations} is empty")
                a = float(advantages[n])
                rec = {
                    "prompt_ids": p,
                    "response_ids": r,
                    "logprobs": lp_n,
                    "reward": float(rewards[n]),
                    "group": f"{self.generations}-{n // G}",
                    "advantage": a,
                    "advantages": [a] * len(r),
                    "policy_version": step,
                    "sampling_params": self.sampling,
                }
                f.write(json.dumps(rec) + "\n")
        self.generations += 1
        self._rewards = None

    @torch.no_grad()
    def _sampler_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """log μ(y_t) of every response token under the model that just generated, at the generation's
        sampling parameters: rows prompt + response, right-padded, positions from 0 (covgrad's layout)."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        spec = SamplerSpec(
            temperature=self.sampling["temperature"], top_p=self.sampling["top_p"], top_k=self.sampling["top_k"]
        )
        rows = [p + r for p, r in zip(prompts, responses, strict=True)]
        L = max(len(x) for x in rows)
        device = next(model.parameters()).device
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        attn = torch.zeros(len(rows), L, dtype=torch.long)
        for i, x in enumerate(rows):
            ids[i, : len(x)] = torch.tensor(x)
            attn[i, : len(x)] = 1
        was_training = model.training
        model.eval()
        try:
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits.float().cpu()
        finally:
            model.train(was_training)
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            z = logits[i, len(p) - 1 : len(p) + len(r) - 1]  # (T, V): position t predicts token t + 1
            logmu = sampler_log_probs(z, spec)
            out.append(logmu.gather(-1, torch.tensor(r)[:, None]).squeeze(-1).tolist())
        return out

    def _save(self, step: int, model: Any, tokenizer: Any) -> None:
        if self.steps is not None and step not in self.steps:
            return
        if any(c["step"] == step for c in self.checkpoints):
            return
        rel = f"checkpoints/step_{step:06d}"
        model = self.trainer.accelerator.unwrap_model(model) if self.trainer is not None else model
        model.save_pretrained(self.out / rel)
        if tokenizer is not None:
            tokenizer.save_pretrained(self.out / rel)
        self.checkpoints.append({"step": step, "path": rel})
        manifest = {
            "checkpoints": sorted(self.checkpoints, key=lambda c: c["step"]),
            "rollouts": ROLLOUTS,
            "trl_version": importlib.metadata.version("trl"),
            "sampling_params": self.sampling,
        }
        (self.out / MANIFEST).write_text(json.dumps(manifest, indent=1))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Checkpoint the start (step 0)."""
        if self.trainer is None:
            raise RuntimeError("CovgradRecorder: call recorder.attach(trainer) before trainer.train()")
        self._save(int(state.global_step), kwargs["model"], kwargs.get("processing_class"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Checkpoint after optimizer step ``state.global_step`` when it is one of the chosen steps."""
        self._save(int(state.global_step), kwargs["model"], kwargs.get("processing_class"))


def distillation_regime(trainer: Any) -> Regime | None:
    """The covgrad regime of a TRL ``DistillationTrainer``'s loss (its ``beta``, student and teacher at its
    ``temperature``); None for any other trainer.

    Raises:
        ValueError: a generalized JSD (0 < beta < 1), or a trainer without a local ``teacher_model``.
    """
    try:
        from trl import DistillationTrainer
    except ImportError:  # a TRL without it
        return None
    if not isinstance(trainer, DistillationTrainer):
        return None
    kind = DISTILL_REGIMES.get(float(trainer.beta))
    if kind is None:
        raise ValueError(f"CovgradInRun: covgrad has no regime for TRL's generalized JSD (beta={trainer.beta})")
    if trainer.teacher_model is None:
        raise ValueError("CovgradInRun: the DistillationTrainer has no local teacher_model to take logits from")
    tau = float(trainer.temperature)
    return Regime(kind, temperature=tau, teacher_temperature=tau)


def _rows(out: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TRL generation batch's rows prompt + completion (B, L): ids, attention mask and the loss mask
    (``completion_mask``, times ``tool_mask`` when present) aligned with the tokens."""
    prompt_mask, comp_mask = out["prompt_mask"], out["completion_mask"]
    loss_mask = comp_mask if "tool_mask" not in out else comp_mask * out["tool_mask"]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    return ids, torch.cat([prompt_mask, comp_mask], 1), torch.cat([torch.zeros_like(prompt_mask), loss_mask], 1)


@torch.no_grad()
def teacher_logits(trainer: Any, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The ``DistillationTrainer``'s teacher's logits (B, L, V) of rows ``ids`` (B, L), at the positions the
    in-run fold gives the student (cumsum(mask) − 1, :meth:`InRunFolder.fold`); the teacher in eval mode, as
    TRL's loss puts it."""
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    teacher.eval()
    device = next(teacher.parameters()).device
    mask = attention_mask.to(device)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    return teacher(input_ids=ids.to(device), attention_mask=mask, position_ids=pos, use_cache=False).logits


class CovgradInRun(TrainerCallback):
    """In-run statistics of a ``GRPOTrainer`` or ``DistillationTrainer`` run (see the module docstring,
    :class:`InRunFolder` and :class:`InRunRegimeFolder`).

    Args:
        out_dir: where the per-step files go (created).
        every_n: fold the generation batch of the first step, then of the first step ``every_n`` after the last.
        params: globs of the parameters to analyse; None: every trainable one.
        q: the fraction of the top sets.
        vectors: the (P,) statistics written per step.
        keep: the (P,) statistics each fold's :class:`covgrad.integrations.inrun.InRunStep` holds (the callback
            drops it: the results are the files); (): none, so a fold's host memory is one block's statistics and
            the top sets' candidates, O(block + k). None: every one (a written one a read-only view of its npz
            member, one not written 8 B per parameter).
        block: columns of the state read and reduced at a time (≥ 1), a few hundred bytes per column on the host.

    Raises:
        ValueError (on :meth:`attach`): block < 1, or a vector or kept statistic the trainer's folder does not
            compute.
    """

    def __init__(
        self,
        out_dir: str | Path,
        every_n: int = 10,
        params: Iterable[str] | None = None,
        q: float = 0.01,
        vectors: Iterable[str] = VECTORS,
        *,
        keep: Iterable[str] | None = (),
        block: int = BLOCK,
    ) -> None:
        self.out, self.every_n, self.q = Path(out_dir), every_n, q
        self.params = None if params is None else list(params)
        self.vectors = tuple(vectors)
        self.keep = None if keep is None else tuple(keep)
        self.block = block
        self.folder: InRunFolder | None = None  # on several processes: built at the first training generation
        self._make: Callable[[], InRunFolder] | None = None
        self._attached = False

    def attach(self, trainer: Any) -> CovgradInRun:
        """Wrap ``trainer``'s generation so that every due training generation batch is folded (a
        ``DistillationTrainer``'s with its regime, :func:`distillation_regime`). On a trainer of several
        processes, call it in every process (collective: see the module docstring).

        Raises:
            ValueError: a ``DistillationTrainer`` of several processes (its folder runs in one process).
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        regime = distillation_regime(trainer)
        ranks = int(getattr(trainer.accelerator, "num_processes", 1))
        common: dict[str, Any] = {"q": self.q, "vectors": self.vectors, "keep": self.keep, "block": self.block}
        if ranks > 1:
            if regime is not None:
                raise ValueError("CovgradInRun folds a DistillationTrainer in one process; run it on one process")
            plan = prepare_ranks(model, self.params)

            def rank_folder() -> InRunFolder:  # the model as the training loop holds it (wrapped or sharded)
                model = trainer.accelerator.unwrap_model(trainer.model)
                return RankInRunFolder(model, plan, self.every_n, self.out, temperature=trainer.temperature, **common)

            self._make = rank_folder
        elif regime is None:
            self.folder = InRunFolder(
                model, self.params, self.every_n, self.out, temperature=trainer.temperature, **common
            )
        else:
            self.folder = InRunRegimeFolder(model, regime, self.params, self.every_n, self.out, **common)
        generate_fn = trainer._generate_and_score_completions
        offset = int(getattr(trainer.accelerator, "process_index", 0))

        def generate_and_score(inputs: Any) -> dict[str, Any]:
            out = generate_fn(inputs)
            step = int(trainer.state.global_step)
            if not trainer.model.training:  # evaluation generations are not the run's samples
                return out
            if self.folder is None:
                self.folder = self._make()
            folder = self.folder
            if folder.due(step):
                ids, attention_mask, loss_mask = _rows(out)
                if isinstance(folder, InRunRegimeFolder):  # one completion per prompt: each its own group
                    folder.fold(step, ids, attention_mask, loss_mask, teacher_logits(trainer, ids, attention_mask))
                else:  # rows of the global batch: process p holds rows [p·B, (p + 1)·B)
                    B = ids.shape[0]
                    group = (offset * B + torch.arange(B)) // int(trainer.num_generations)
                    folder.fold(step, ids, attention_mask, loss_mask, out["advantages"], group=group)
            return out

        trainer._generate_and_score_completions = generate_and_score
        self._attached = True
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a run whose trainer was not attached."""
        if not self._attached:
            raise RuntimeError("CovgradInRun: call inrun.attach(trainer) before trainer.train()")
