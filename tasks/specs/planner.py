"""The plan: every artifact of one pipeline run, its spec built from the config and its key, before anything runs.

``plan(cfg)`` builds every spec from ``PipelineConfig`` here and nowhere else; a stage task receives its spec and its
upstream refs, never the config, so a stage cannot read a setting that its key leaves out. Keys chain, so a changed
setting changes the key of exactly the stages whose spec holds it and of everything below them
(tests/caching/test_specs.py walks every config field). The artifact directory is ``{root}/{stage}/{key}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from covgrad.config import PipelineConfig, RegimeSection, SamplerSection, TaskSection, report_layout
from covgrad.rollouts import check_unrewarded
from storage.artifacts import ArtifactRef, ArtifactStore, stage_key
from storage.digests import input_digest
from storage.readers import unrewarded
from tasks.specs.base import Centering, Instance, Later, PlacementSpec, PolicySpec, StageSpec, leave_out_later
from tasks.specs.inputs import regime_inputs, sampler_inputs, series_digest, task_inputs
from tasks.specs.stages import (
    BaseModelSpec,
    MasksSpec,
    OffPolicySpec,
    PassMember,
    RegimeSpec,
    RegimeStatsSpec,
    ReportSpec,
    RolloutsSpec,
    ScoresSpec,
    StatsSpec,
    TeacherSpec,
    TokensSpec,
    TrajectorySpec,
    UpdateCheckSpec,
)


def on_policy(s: SamplerSection) -> bool:
    """True when the sampler is the policy itself (not a copy in a ``dtype`` of its own), untruncated at
    temperature 1 (μ = p); imported rollouts say so with ``on_policy: true``."""
    if s.import_path is not None:
        return s.on_policy
    return s.model == "policy" and s.dtype is None and s.temperature == 1.0 and s.top_p == 1.0 and s.top_k == 0


def centerings(s: SamplerSection) -> list[Centering]:
    """Score centerings computed for a sampler: both when μ ≠ p (the off-policy comparison) and μ is known;
    a dataset of responses (μ unknown) has policy centering only."""
    return ["policy"] if on_policy(s) or not s.mu_known else ["policy", "sampler"]


def main_stats(cfg: PipelineConfig) -> Instance:
    """The main statistics: the analysed sampler's, sampler-centred when its μ differs from p."""
    analysed = cfg.rollouts.analyse
    return Instance("stats", analysed, centerings(cfg.rollouts.samplers[analysed])[-1])


@dataclass(frozen=True)
class Step:
    """One planned artifact: its instance, spec, ref, and its upstream artifacts by role (the task's
    ``upstream`` keys: ``base_model``, ``rollouts``, ``scores``, ``stats``; offpolicy's and the report's are
    instance names)."""

    instance: Instance
    spec: StageSpec
    ref: ArtifactRef
    upstream: dict[str, ArtifactRef]


@dataclass(frozen=True)
class Plan(Mapping[str, Step]):
    """Every artifact of one pipeline run, each with its spec and key, by stage. The stage fields, in DAG
    order (upstream first), are the one declaration of the stage order (``STAGES``); as a mapping, every
    step by instance name in that order (per-sampler stages sampler by sampler, disabled stages left out)."""

    base_model: Step
    teacher: Step | None
    rollouts: dict[str, Step]
    scores: dict[Instance, Step]
    stats: dict[Instance, Step]
    offpolicy: Step
    masks: Step
    tokens: Step | None
    regime: dict[Instance, Step]
    regimes: Step | None
    update_check: Step | None
    trajectory: dict[Instance, Step]
    report: Step
    main: Step  # not a stage: the main statistics (one of ``stats``), sampler-centred whenever μ ≠ p

    def _steps(self) -> list[Step]:
        out: list[Step] = []
        for stage in STAGES:
            value = getattr(self, stage)
            out += list(value.values()) if isinstance(value, dict) else [] if value is None else [value]
        return out

    def __getitem__(self, name: str) -> Step:
        for s in self._steps():
            if str(s.instance) == name:
                return s
        raise KeyError(f"{name!r} is not planned; planned: {list(self)}")

    def __iter__(self) -> Iterator[str]:
        return (str(s.instance) for s in self._steps())

    def __len__(self) -> int:
        return len(self._steps())

    @property
    def run_key(self) -> str:
        """The pipeline run's key, which covers every artifact key."""
        return stage_key("run", "1", {}, [s.ref.key for s in self._steps()])

    def downstream(self, name: str) -> set[str]:
        """``name`` and every planned instance that reads it, directly or transitively."""
        out = {name}
        for s in self._steps():  # DAG order: upstreams come first
            if any(self._name(r) in out for r in s.upstream.values()):
                out.add(str(s.instance))
        return out

    def _name(self, ref: ArtifactRef) -> str:
        return next(str(s.instance) for s in self._steps() if s.ref == ref)


STAGES = tuple(f.name for f in fields(Plan) if f.name != "main")  # the stage names, in DAG order


def _step(store: ArtifactStore, instance: Instance, spec: StageSpec, upstream: dict[str, Step]) -> Step:
    keys = [u.ref.key for u in upstream.values()]
    ref = store.ref(spec.STAGE, spec.key(keys), spec.VERSION, keys)
    return Step(instance, spec, ref, {role: u.ref for role, u in upstream.items()})


def policy_spec(cfg: PipelineConfig) -> PolicySpec:
    """How every stage loads the policy of ``cfg``."""
    path = None if cfg.model.path is None else str(Path(cfg.model.path).resolve())
    m = cfg.model
    return PolicySpec(path=path, dtype=m.dtype, trust_remote_code=m.trust_remote_code, max_length=m.max_length)


def base_model_spec(cfg: PipelineConfig) -> BaseModelSpec:
    """The base_model spec: the demo's settings, or the user model's fingerprint."""
    demo = cfg.model.path is None
    return BaseModelSpec(
        policy=policy_spec(cfg),
        demo=cfg.model.demo.model_copy(deep=True) if demo else None,
        digits=cfg.task.digits if demo else None,
        fingerprint=None if demo else input_digest(cfg.model.path, model=True),
    )


REPORT_LATER = {
    "trajectory": Later(False, when="trajectory.enabled"),
    "regimes": Later({}),
    "scores.cut_tensors": Later(False),
    "scores.rank_chunks": Later("unsharded"),
    "trajectory.schedule": Later("constant"),
    "trajectory.max_grad_norm": Later(None),
    "trajectory.minibatches": Later(1),
    "trajectory.history": Later(None),
    "trajectory.inrun": Later(None),
    "model.max_length": Later(None),
}
"""Config fields that arrived after report keys existed, as the report's config leaves them out: a disabled section
the report does not render, uncut blocks, unsharded rank chunks, a trajectory without the trainer's step options or
an external run's history or in-run series, an unset ``model.max_length``."""


def report_config(cfg: PipelineConfig) -> dict[str, Any]:
    """The config the report renders and its key hashes: ``cfg`` as JSON without ``root`` and ``trackers``
    (locations: where the artifacts are stored and where ``covgrad run`` logs their scalars), without the
    :data:`REPORT_LATER` fields whose conditions hold, in ``covgrad.config.report_layout``."""
    dumped = cfg.model_dump(mode="json", exclude={"root", "trackers"})
    return report_layout(leave_out_later(dumped, REPORT_LATER.items()))


def plan(cfg: PipelineConfig) -> Plan:
    """Every artifact of ``cfg``'s pipeline run: specs built from the config, keys chained in DAG order. A dataset
    of responses without rewards (``storage.readers.unrewarded``) gets rollouts and no scores or stats;
    ValueError (``covgrad.rollouts.inputs.check_unrewarded``) when the config needs its rewards."""
    store = ArtifactStore(cfg.root)
    base = _step(store, Instance("base_model"), base_model_spec(cfg), {})
    rollouts, scores, stats = plan_samplers(cfg, store, base)
    compared = sorted(stats)  # by sampler, then centering
    offpolicy_spec = OffPolicySpec(stats=[(i.sampler, i.centering) for i in compared])
    offpolicy = _step(store, Instance("offpolicy"), offpolicy_spec, {str(i): stats[i] for i in compared})
    main = stats[main_stats(cfg)]
    masks = _step(store, Instance("masks"), MasksSpec(qs=list(cfg.masks.qs)), {"stats": main})
    tokens = plan_tokens(cfg, store, base, rollouts) if cfg.tokens.enabled else None
    teacher = plan_teacher(cfg, store, base)
    main_scores = scores[Instance("scores", *main.instance[1:])]
    regime, regimes = plan_regimes(cfg, store, base, teacher, rollouts, main_scores)
    update = None
    if cfg.update_check.enabled:
        update = plan_update_check(cfg, store, base, rollouts, main, regimes, teacher)
    trajectory = plan_trajectories(cfg, store, base, rollouts, main, regimes, teacher)
    everything = [base, *rollouts.values(), *scores.values(), *stats.values(), offpolicy, masks]
    everything += [x for x in (tokens, update) if x is not None]
    everything += [x for x in (teacher,) if x is not None]
    everything += [*regime.values(), *([regimes] if regimes is not None else []), *trajectory.values()]
    report_spec = ReportSpec(name=cfg.name, config=report_config(cfg))
    report = _step(store, Instance("report"), report_spec, {str(x.instance): x for x in everything})
    return Plan(
        base,
        teacher,
        rollouts,
        scores,
        stats,
        offpolicy,
        masks,
        tokens,
        regime,
        regimes,
        update_check=update,
        trajectory=trajectory,
        report=report,
        main=main,
    )


def plan_samplers(
    cfg: PipelineConfig, store: ArtifactStore, base: Step
) -> tuple[dict[str, Step], dict[Instance, Step], dict[Instance, Step]]:
    """The per-sampler stages: each sampler's rollouts (by sampler name), and the scores and stats of each of its
    centerings (by instance); a sampler whose rollouts carry no rewards has rollouts only."""
    policy = policy_spec(cfg)
    rollouts: dict[str, Step] = {}
    scores: dict[Instance, Step] = {}
    stats: dict[Instance, Step] = {}
    no_rewards = unrewarded(cfg)
    check_unrewarded(cfg, no_rewards)
    for name, s in cfg.rollouts.samplers.items():
        settings = s.model_copy(deep=True)
        spec = RolloutsSpec(
            sampler=name,
            settings=settings,
            task=cfg.task.model_copy(deep=True),
            advantage=cfg.rollouts.advantage,
            policy=policy,
            inputs={**task_inputs(cfg.task), **sampler_inputs(s, mu=False)},
        )
        rollouts[name] = _step(store, Instance("rollouts", name), spec, {"base_model": base})
        for c in [] if name in no_rewards else centerings(s):
            upstream = {"base_model": base, "rollouts": rollouts[name]}
            score_spec = scores_spec(cfg, name, settings, c, policy)
            scores[Instance("scores", name, c)] = _step(store, Instance("scores", name, c), score_spec, upstream)
            stats_spec = StatsSpec(sampler=name, centering=c, dask_address=cfg.dask.address)
            up = {"scores": scores[Instance("scores", name, c)]}
            stats[Instance("stats", name, c)] = _step(store, Instance("stats", name, c), stats_spec, up)
    return rollouts, scores, stats


def scores_spec(
    cfg: PipelineConfig, name: str, settings: SamplerSection, centering: Centering, policy: PolicySpec
) -> ScoresSpec:
    """The spec of the scores of sampler ``name`` (settings ``settings``) under ``centering``."""
    sc, m = cfg.scores, cfg.model
    return ScoresSpec(
        sampler=name,
        centering=centering,
        settings=settings,
        policy=policy,
        params=m.params,
        groups_per_batch=sc.groups_per_batch,
        byte_budget=sc.byte_budget,
        state_dtype=sc.state_dtype,
        sample_shards=sc.shards[0],
        blocks=sc.shards[1],
        device=m.device,
        self_check=m.self_check,
        checkpoint_batches=sc.checkpoint_batches,
        checkpoint_seconds=sc.checkpoint_seconds,
        inputs=sampler_inputs(cfg.rollouts.samplers[name], mu=True) if centering == "sampler" else {},
        cut_tensors=sc.cut_tensors,
        placement=scores_placement(cfg),
        rank_chunks=sc.rank_chunks if sc.placement[1] > 1 else "unsharded",
    )


def scores_placement(cfg: PipelineConfig) -> PlacementSpec:
    """Where the scores stage's ranks run: ``scores.launcher`` resolved (``ScoresSection.placement``), every
    machine's ``scores.ranks`` and a torchrun group's machines; the tokens and trajectory stages run on these
    ranks too when there are several (the trajectory on local ones only)."""
    launcher, ranks = cfg.scores.placement
    sc = cfg.scores
    return PlacementSpec(
        launcher=launcher, ranks=ranks, nnodes=sc.nnodes, node_rank=sc.node_rank, rdzv_endpoint=sc.rdzv_endpoint
    )


def plan_tokens(cfg: PipelineConfig, store: ArtifactStore, base: Step, rollouts: dict[str, Step]) -> Step:
    """The token Fisher of the analysed sampler's rollouts, on the scores stage's ranks when it has more than one
    (local processes, or a torchrun group of ``scores.nnodes`` machines)."""
    analysed = cfg.rollouts.analyse
    placed = scores_placement(cfg)
    spec = TokensSpec(
        settings=cfg.tokens.model_copy(deep=True),
        params=cfg.model.params,
        sampler=analysed,
        on_policy=on_policy(cfg.rollouts.samplers[analysed]),
        policy=policy_spec(cfg),
        device=cfg.model.device,
        self_check=cfg.model.self_check,
        placement=placed if placed.ranks > 1 else PlacementSpec(),
    )
    return _step(store, Instance("tokens"), spec, {"base_model": base, "rollouts": rollouts[analysed]})


def plan_update_check(
    cfg: PipelineConfig,
    store: ArtifactStore,
    base: Step,
    rollouts: dict[str, Step],
    main: Step,
    regimes: Step | None,
    teacher: Step | None = None,
) -> Step:
    """The update check: rl cells on the analysed rollouts with the main statistics and, with regimes,
    each regime's cells on its sampler's rollouts (upstream ``rollouts.<sampler>``) with the ``regimes``
    statistics (and the ``teacher`` stage when a regime steps towards ``teacher: trained``)."""
    analysed = cfg.rollouts.analyse
    spec = UpdateCheckSpec(
        settings=cfg.update_check.model_copy(deep=True),
        params=cfg.model.params,
        groups_per_batch=cfg.scores.groups_per_batch,
        policy=policy_spec(cfg),
        analysed=analysed,
        regimes={n: r.model_copy(deep=True) for n, r in cfg.regimes.items()},
        inputs={f"{n}.{k}": v for n, r in cfg.regimes.items() for k, v in regime_inputs(r).items()},
    )
    upstream = {"base_model": base, "rollouts": rollouts[analysed], "stats": main}
    if regimes is not None:
        upstream["regimes"] = regimes
        for r in cfg.regimes.values():
            sampler = r.sampler or analysed
            upstream.setdefault(f"rollouts.{sampler}", rollouts[sampler])
        if teacher is not None and any(r.teacher == "trained" for r in cfg.regimes.values()):
            upstream["teacher"] = teacher
    return _step(store, Instance("update_check"), spec, upstream)


def plan_trajectories(
    cfg: PipelineConfig,
    store: ArtifactStore,
    base: Step,
    rollouts: dict[str, Step],
    main: Step,
    regimes: Step | None,
    teacher: Step | None = None,
) -> dict[Instance, Step]:
    """One trajectory per cell of ``trajectory.grid`` (``trajectory.<cell>``), or the one ``trajectory``;
    none when the stage is disabled. A cell of a configured regime reads the ``regimes`` statistics (and the
    ``teacher`` stage when the regime's teacher is ``trained``)."""
    out: dict[Instance, Step] = {}
    if not cfg.trajectory.enabled:
        return out
    analysed = cfg.rollouts.analyse
    placed = scores_placement(cfg)
    sharded = placed.ranks > 1 and placed.launcher == "local"  # the scores stage's local processes
    for cell, t in cfg.trajectory.cells().items():
        r = cfg.regimes.get(t.regime) if t.regime != "rl" or "rl" in cfg.regimes else None
        data_sampler = analysed if r is None else (r.sampler or analysed)
        spec = TrajectorySpec(
            settings=t.model_copy(deep=True, update={"grid": {}}),
            params=cfg.model.params,
            groups_per_batch=cfg.scores.groups_per_batch,
            sampler=cfg.rollouts.samplers[analysed].model_copy(deep=True),
            task=cfg.task.model_copy(deep=True),
            advantage=cfg.rollouts.advantage,
            policy=policy_spec(cfg),
            inputs={
                **task_inputs(cfg.task),
                **({} if r is None else regime_inputs(r)),
                **({} if t.checkpoints is None else {"checkpoints": series_digest(t.checkpoints)}),
                **({} if t.deltas is None else {"deltas": input_digest(t.deltas)}),
                **({} if t.history is None else {"history": input_digest(t.history)}),
                **({} if t.inrun is None else {"inrun": input_digest(t.inrun)}),
            },
            regime=None if r is None else r.model_copy(deep=True),
            data_sampler=None if r is None else data_sampler,
            placement=placed if sharded else PlacementSpec(),
        )
        upstream = {"base_model": base, "rollouts": rollouts[data_sampler], "stats": main}
        if r is not None:
            assert regimes is not None
            upstream["regimes"] = regimes
            if r.teacher == "trained" and teacher is not None:
                upstream["teacher"] = teacher
        out[Instance("trajectory", cell)] = _step(store, Instance("trajectory", cell), spec, upstream)
    return out


def plan_teacher(cfg: PipelineConfig, store: ArtifactStore, base: Step) -> Step | None:
    """The demo's trained teacher, when a regime names ``teacher: trained`` (None otherwise)."""
    trained = [r.trained_teacher for r in cfg.regimes.values() if r.teacher == "trained"]
    if not trained:
        return None
    spec = TeacherSpec(
        policy=policy_spec(cfg),
        demo=cfg.model.demo.model_copy(deep=True),
        digits=cfg.task.digits,
        training=trained[0].model_copy(deep=True),
    )
    return _step(store, Instance("teacher"), spec, {"base_model": base})


def regime_task_section(cfg: PipelineConfig, r: RegimeSection) -> TaskSection | None:
    """The task a regime reads itself: its prompts for ``teacher_prompt``, its prompts and reward for
    ``responses: teacher``; None otherwise."""
    return cfg.task.model_copy(deep=True) if r.teacher_prompt is not None or r.responses == "teacher" else None


def regime_pass_group(spec: RegimeSpec) -> tuple[str, ...]:
    """The pass a regime fold shares: folds over the same sampler's rollouts share one (one forward per batch,
    one backward per regime); a fold over the teacher's own samples (``responses: teacher``) has its own."""
    if spec.settings.responses == "teacher":
        return ("teacher", spec.name)
    return ("sampler", spec.sampler)


def plan_regimes(
    cfg: PipelineConfig,
    store: ArtifactStore,
    base: Step,
    teacher: Step | None,
    rollouts: dict[str, Step],
    main_scores: Step,
) -> tuple[dict[Instance, Step], Step | None]:
    """The ``regime.<name>`` folds of ``cfg.regimes`` and their ``regimes`` statistics (None without regimes).
    Instances name the regime in the sampler slot: ``regime.distill``."""
    sc, m = cfg.scores, cfg.model
    out: dict[Instance, Step] = {}
    for name, r in cfg.regimes.items():
        sampler = r.sampler or cfg.rollouts.analyse
        spec = RegimeSpec(
            name=name,
            settings=r.model_copy(deep=True),
            sampler=sampler,
            policy=policy_spec(cfg),
            params=m.params,
            groups_per_batch=sc.groups_per_batch,
            state_dtype=sc.state_dtype,
            device=m.device,
            self_check=m.self_check,
            inputs={**regime_inputs(r), **(task_inputs(cfg.task) if (task := regime_task_section(cfg, r)) else {})},
            checkpoint_batches=sc.checkpoint_batches,
            checkpoint_seconds=sc.checkpoint_seconds,
            task=task,
        )
        up = {"base_model": base, "rollouts": rollouts[sampler]}
        if r.teacher == "trained":
            assert teacher is not None
            up["teacher"] = teacher
        out[Instance("regime", name)] = _step(store, Instance("regime", name), spec, up)
    groups: dict[tuple[str, ...], list[Instance]] = {}
    for i, s in out.items():
        groups.setdefault(regime_pass_group(s.spec), []).append(i)
    alone = dict(out)
    for members in groups.values():
        for i in members:
            others = [
                PassMember(name=str(o.sampler), ref=s.ref, spec=s.spec.model_dump(mode="json"), upstream=s.upstream)
                for o in members
                if o != i and (s := alone[o])
            ]
            s = alone[i]
            out[i] = Step(s.instance, s.spec.model_copy(update={"pass_with": others}), s.ref, s.upstream)
    if not out:
        return out, None
    stats_spec = RegimeStatsSpec(names=list(cfg.regimes), qs=list(cfg.masks.qs))
    up = {"scores": main_scores, **{str(i): s for i, s in out.items()}}
    return out, _step(store, Instance("regimes"), stats_spec, up)
