"""Stage specs and the plan: what each artifact is computed from, and every artifact's key, before anything runs.

A stage's **spec** is a frozen pydantic object holding exactly what the stage computes from: its config
fields and the values derived from the config that it needs (the sampler of a scores artifact, whether
that sampler is the policy, the fingerprint of a user model). ``plan(cfg)`` builds every spec from
``PipelineConfig`` here and nowhere else; a stage task receives its spec and its upstream refs, never the
config, so a stage cannot read a setting that its key leaves out.

Key = sha256(stage name, stage code version, spec, upstream keys) (``storage.artifacts.stage_key``).
Fields listed in a spec's ``PLACEMENT`` say where or how the work runs and never change a byte (device,
checkpoint cadence, parameter blocks, the dask scheduler): the task reads them, the completion marker
records them, the key leaves them out. Keys chain, so a changed setting changes the key of exactly the
stages whose spec holds it and of everything below them (tests/caching/test_specs.py walks every config field).

Instances tell several artifacts of one stage apart: ``rollouts.<sampler>``, ``scores.<sampler>.<centering>``,
``stats.<sampler>.<centering>``; an :class:`Instance` is the typed name, its string form the name that run
indexes and notebooks use. The artifact directory is ``{root}/{stage}/{key}``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from covgrad.config import (
    Advantage,
    Blocks,
    DemoModel,
    Device,
    Dtype,
    PipelineConfig,
    RegimeSection,
    SamplerSection,
    StateDtype,
    TaskSection,
    TeacherTraining,
    TokensSection,
    TrajectorySection,
    UpdateCheckSection,
    report_layout,
)
from covgrad.rollouts import check_unrewarded
from storage.artifacts import ArtifactRef, ArtifactStore, stage_key
from storage.digests import input_digest
from storage.readers import unrewarded

Centering = Literal["policy", "sampler"]


class Instance(NamedTuple):
    """The typed name of one planned artifact: a stage, and for per-sampler stages the sampler (and the
    score centering). ``str()`` gives the dotted name of run indexes: ``scores.stale.sampler``."""

    stage: str
    sampler: str | None = None
    centering: Centering | None = None

    def __str__(self) -> str:
        return ".".join(p for p in self if p is not None)


class Spec(BaseModel):
    """Base of specs and their parts: frozen, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class StageSpec(Spec):
    """Base of the stage specs: ``STAGE`` and ``VERSION`` name the stage and its code version (bump it
    when the stage's code changes what it writes); ``PLACEMENT`` lists the fields the key leaves out."""

    STAGE: ClassVar[str]
    VERSION: ClassVar[str]
    PLACEMENT: ClassVar[frozenset[str]] = frozenset()

    def hashed(self) -> dict[str, Any]:
        """The spec as the key hashes it: every field except the placement fields, as JSON values; an empty
        ``inputs`` (the stage reads no user file) is hashed as if the field did not exist."""
        out = self.model_dump(mode="json", exclude=set(self.PLACEMENT))
        if out.get("inputs") == {}:
            del out["inputs"]
        return out

    def key(self, upstream: list[str]) -> str:
        """The artifact key of this spec computed from upstream artifacts with keys ``upstream``."""
        return stage_key(self.STAGE, self.VERSION, self.hashed(), upstream)


class PolicySpec(Spec):
    """How a stage loads the policy (and other model directories): a user model directory (resolved) or
    the demo model that the base_model artifact holds, in ``dtype``."""

    path: str | None
    dtype: Dtype
    trust_remote_code: bool


class BaseModelSpec(StageSpec):
    """base_model: train the demo model (``demo`` on the ``digits``-digit addition task) or register the
    user model at ``policy.path`` (``fingerprint``: the content digest of its config, weight, tokenizer and
    code files, :func:`storage.digests.input_digest`)."""

    STAGE: ClassVar[str] = "base_model"
    VERSION: ClassVar[str] = "1"
    policy: PolicySpec
    demo: DemoModel | None
    digits: int | None
    fingerprint: str | None


class TeacherSpec(StageSpec):
    """teacher: the demo policy of the base_model artifact (``demo``) trained on by SFT on the ``digits``-digit
    addition task as ``training`` says, until its sampled accuracy reaches ``training.accuracy``."""

    STAGE: ClassVar[str] = "teacher"
    VERSION: ClassVar[str] = "1"
    policy: PolicySpec
    demo: DemoModel
    digits: int
    training: TeacherTraining


class RolloutsSpec(StageSpec):
    """rollouts: responses of sampler ``sampler`` (settings ``settings``) to the prompts of ``task``, rewards
    and ``advantage``-kind advantages."""

    STAGE: ClassVar[str] = "rollouts"
    VERSION: ClassVar[str] = "1"
    sampler: str
    settings: SamplerSection
    task: TaskSection
    advantage: Advantage
    policy: PolicySpec
    inputs: dict[str, str] = {}  # content digests of the files it reads: task, reward source, sampler files


class ScoresSpec(StageSpec):
    """scores: per-sample scores of the rollouts of ``sampler`` under ``centering``, folded into moment state
    of ``state_dtype`` over ``groups_per_batch`` prompt groups per batch and ``sample_shards`` sample shards;
    per-sample rows kept when N·P·4 bytes fit ``byte_budget``."""

    STAGE: ClassVar[str] = "scores"
    # 6: generic-path parameters at the ops that use them (covgrad.scores.optaps: last bits)
    VERSION: ClassVar[str] = "6"
    PLACEMENT: ClassVar[frozenset[str]] = frozenset(
        {
            "blocks",
            "device",
            "self_check",
            "checkpoint_batches",
            "checkpoint_seconds",
            "launcher",
            "ranks",
            "nnodes",
            "node_rank",
            "rdzv_endpoint",
        }
    )
    sampler: str
    centering: Centering
    settings: SamplerSection
    policy: PolicySpec
    params: list[str] | None
    groups_per_batch: int
    byte_budget: int
    state_dtype: StateDtype
    # sample shards change the order of the merges; parameter blocks and placement change no byte
    sample_shards: int
    blocks: Blocks
    device: Device
    self_check: bool
    inputs: dict[str, str] = {}  # content digests of the sampler's model and μ files it reads
    checkpoint_batches: int
    checkpoint_seconds: float
    cut_tensors: bool = False  # blocks cut tensors at rows: hashed only when true (uncut keys stay as they were)
    # the model sharded over ranks (tasks.jobs.scores_ranks); absent from the dump when in-process
    launcher: Literal["in-process", "local", "torchrun"] = "in-process"
    ranks: int = 1
    # a torchrun group's machines, this machine's index and node 0's rendezvous (absent from the dump unless torchrun)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    # ranks' row chunks on their own grids (covgrad.distributed.fsdp.ShardAccumulator): absent from the dump when
    # unsharded
    rank_chunks: Literal["unsharded", "aligned"] = "unsharded"

    def hashed(self) -> dict[str, Any]:
        """As :meth:`StageSpec.hashed`; ``cut_tensors`` only when true; aligned rank chunks with the rank count
        (the state's last bits depend on both; unsharded chunks and R change no byte)."""
        out = super().hashed()
        if not out["cut_tensors"]:
            del out["cut_tensors"]
        if self.rank_chunks == "aligned":  # (the dump drops unsharded chunks)
            out["ranks"] = self.ranks
        return out

    @model_serializer(mode="wrap")
    def _in_process_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump without ``launcher`` and ``ranks`` when in-process, and without the torchrun fields unless
        torchrun: the spec recorded in claims and markers of earlier runs stays what it was before the fields
        existed."""
        out = handler(self)
        if self.launcher == "in-process":
            out.pop("launcher", None)
            out.pop("ranks", None)
        if self.launcher != "torchrun":
            for name in ("nnodes", "node_rank", "rdzv_endpoint"):
                out.pop(name, None)
        if self.rank_chunks == "unsharded":
            out.pop("rank_chunks", None)
        return out


class StatsSpec(StageSpec):
    """stats: the statistics of ``scores.<sampler>.<centering>``, reduced on the dask scheduler at
    ``dask_address`` (None: threads)."""

    STAGE: ClassVar[str] = "stats"
    VERSION: ClassVar[str] = "4"
    PLACEMENT: ClassVar[frozenset[str]] = frozenset({"dask_address"})
    sampler: str
    centering: Centering
    dask_address: str | None


class OffPolicySpec(StageSpec):
    """offpolicy: the off-policy table of the stats artifacts ``stats.<sampler>.<centering>`` of ``stats``, one
    row each in that order, and each sampler's ‖G_sampler − G_policy‖ / ‖G_sampler‖ across its two centerings."""

    STAGE: ClassVar[str] = "offpolicy"
    VERSION: ClassVar[str] = "4"  # 2: the verl-named mismatch columns; 3: rel_diff_stats; 4: sampler_weights
    stats: list[tuple[str, Centering]]  # (sampler, centering), sorted


class MasksSpec(StageSpec):
    """masks: top-q sets at the fractions ``qs`` of the main statistics."""

    STAGE: ClassVar[str] = "masks"
    VERSION: ClassVar[str] = "3"
    qs: list[float]


class TokensSpec(StageSpec):
    """tokens: token-level Fisher (``settings``) of the parameters ``params`` over the rollouts of
    ``sampler`` (``on_policy``: μ = p)."""

    STAGE: ClassVar[str] = "tokens"
    VERSION: ClassVar[str] = "6"  # 6: jackknife interval of the errors against F in the scalars
    PLACEMENT: ClassVar[frozenset[str]] = frozenset(
        {"device", "self_check", "launcher", "ranks", "nnodes", "node_rank", "rdzv_endpoint"}
    )
    settings: TokensSection
    params: list[str] | None
    sampler: str
    on_policy: bool
    policy: PolicySpec
    device: Device
    self_check: bool
    # the model sharded over ranks (tasks.jobs.tokens_ranks, scores.ranks); absent from the dump when in-process
    launcher: Literal["in-process", "local", "torchrun"] = "in-process"
    ranks: int = 1
    # a torchrun group's machines, this machine's index and node 0's rendezvous (absent from the dump unless several)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    @model_serializer(mode="wrap")
    def _in_process_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump without ``launcher`` and ``ranks`` when in-process, and without the machines' fields on one
        machine: the spec recorded in claims and markers of earlier runs stays what it was before the fields
        existed."""
        out = handler(self)
        if self.launcher == "in-process":
            out.pop("launcher", None)
            out.pop("ranks", None)
        if self.nnodes == 1:
            for name in ("nnodes", "node_rank", "rdzv_endpoint"):
                out.pop(name, None)
        return out


class PassMember(Spec):
    """Another regime fold that reads the same batches (:func:`regime_pass_group`): its name, artifact, spec
    (as JSON) and upstream refs, so that one pass over the batches folds it too."""

    name: str
    ref: ArtifactRef
    spec: dict[str, Any]
    upstream: dict[str, ArtifactRef]


class RegimeSpec(StageSpec):
    """regime: the per-sample gradients g_n of regime ``name`` (``settings``) over the rollouts of
    ``sampler``, folded into scores-layout moment state (g_n in place of s_n, A = 0) with its bound scalars;
    ``inputs``: content digests of the teacher and reference model directories it reads; ``pass_with``: the
    other folds of its pass group, which the same pass folds while their artifacts are incomplete (placement:
    each artifact's bytes are those of its own pass)."""

    STAGE: ClassVar[str] = "regime"
    VERSION: ClassVar[str] = "3"  # 2: the LM head token Fisher of full-distribution regimes; 3: prompt-group state
    PLACEMENT: ClassVar[frozenset[str]] = frozenset(
        {"device", "self_check", "checkpoint_batches", "checkpoint_seconds", "pass_with"}
    )
    name: str
    settings: RegimeSection
    sampler: str
    policy: PolicySpec
    params: list[str] | None
    groups_per_batch: int
    state_dtype: StateDtype
    device: Device
    self_check: bool
    inputs: dict[str, str] = {}
    checkpoint_batches: int
    checkpoint_seconds: float
    task: TaskSection | None = None  # the prompts of teacher_prompt and responses: teacher (their rewards)
    pass_with: list[PassMember] = []

    def hashed(self) -> dict[str, Any]:
        """As :meth:`StageSpec.hashed`, without the settings added for context distillation and the teacher's
        samples while they hold their defaults and without ``task`` while it is None: a regime that uses none of
        them keeps its key."""
        out = super().hashed()
        for name, default in NEW_REGIME_DEFAULTS.items():
            if out["settings"].get(name) == default:
                del out["settings"][name]
        if out.get("task") is None:
            out.pop("task", None)
        return out


NEW_REGIME_DEFAULTS = {
    "teacher_prompt": None,
    "responses": "sampler",
    "trained_teacher": TeacherTraining().model_dump(mode="json"),
}
"""RegimeSection fields that arrived after regime keys existed, with their defaults (left out of the key)."""


class RegimeStatsSpec(StageSpec):
    """regimes: per regime G, its bound a·√F with the main scores' F, ρ, violations, cross-fit and overlap
    tables at ``qs``; and the cross-regime comparison of the regimes ``names`` (in that order)."""

    STAGE: ClassVar[str] = "regimes"
    VERSION: ClassVar[str] = "3"  # 2: bounds on the LM head by its token Fisher at the regime's rows; 3: clustered se
    names: list[str]
    qs: list[float]
    allowance_z: float = 3.0


class UpdateCheckSpec(StageSpec):
    """update_check: optimizer steps (``settings``) on minibatches of ``groups_per_batch`` prompt groups,
    over the parameters ``params``: the rl loss on the analysed rollouts, and each regime of ``regimes``
    (the configured ones, by name) stepping its own loss on its sampler's rollouts."""

    STAGE: ClassVar[str] = "update_check"
    VERSION: ClassVar[str] = "3"  # 3: the rl cells skip minibatches with A ≡ 0
    settings: UpdateCheckSection
    params: list[str] | None
    groups_per_batch: int
    policy: PolicySpec
    analysed: str | None = None  # the analysed sampler, whose rollouts the rl cells step on (with regimes)
    regimes: dict[str, RegimeSection] = {}
    inputs: dict[str, str] = {}  # content digests of the regimes' teacher and reference directories

    def hashed(self) -> dict[str, Any]:
        """As :meth:`StageSpec.hashed`, without the regime fields when no regime is configured (the key
        of a run without regimes is the one it had before the update check stepped regimes)."""
        out = super().hashed()
        if not self.regimes:
            del out["regimes"], out["analysed"]
        return out


class TrajectorySpec(StageSpec):
    """trajectory: ``settings.steps`` optimizer steps of one regime from the policy over the parameters
    ``params``: rl (``regime`` None) or the configured regime ``settings.regime`` (``regime``: its
    settings; ``data_sampler``: whose rollouts its fixed data are), on fresh samples of the analysed
    sampler's ``sampler`` settings rewarded by ``task`` with ``advantage`` advantages, or on minibatches of
    ``groups_per_batch`` prompt groups of fixed rollouts (``settings.data = "fixed"``, the sft regimes)."""

    STAGE: ClassVar[str] = "trajectory"
    VERSION: ClassVar[str] = "1"
    PLACEMENT: ClassVar[frozenset[str]] = frozenset({"launcher", "ranks"})
    settings: TrajectorySection
    params: list[str] | None
    groups_per_batch: int
    sampler: SamplerSection
    task: TaskSection
    advantage: Advantage
    policy: PolicySpec
    inputs: dict[str, str] = {}  # content digests of the task files and teacher directories it reads
    regime: RegimeSection | None = None
    data_sampler: str | None = None
    # the model sharded over the scores stage's local ranks (tasks.jobs.trajectory_ranks); absent from the dump when
    # in-process
    launcher: Literal["in-process", "local"] = "in-process"
    ranks: int = 1

    @model_serializer(mode="wrap")
    def _in_process_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump without ``launcher`` and ``ranks`` when in-process (as recorded before the fields existed)."""
        out = handler(self)
        if self.launcher == "in-process":
            out.pop("launcher", None)
            out.pop("ranks", None)
        return out

    def hashed(self) -> dict[str, Any]:
        """As :meth:`StageSpec.hashed`, without the regime fields of an rl trajectory (its key is the one
        it had before trajectories stepped other regimes)."""
        out = super().hashed()
        del out["settings"]["grid"]
        if out["settings"]["checkpoints"] is None:
            del out["settings"]["checkpoints"]
        if self.regime is None:
            del out["settings"]["regime"], out["regime"], out["data_sampler"]
        return out


class ReportSpec(StageSpec):
    """report: the run ``name`` rendered from its artifacts and its config (JSON without ``root``, in
    ``covgrad.config.report_layout``)."""

    STAGE: ClassVar[str] = "report"
    VERSION: ClassVar[str] = "9"
    name: str
    config: dict[str, Any]


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
    return PolicySpec(path=path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)


def base_model_spec(cfg: PipelineConfig) -> BaseModelSpec:
    """The base_model spec: the demo's settings, or the user model's fingerprint."""
    demo = cfg.model.path is None
    return BaseModelSpec(
        policy=policy_spec(cfg),
        demo=cfg.model.demo.model_copy(deep=True) if demo else None,
        digits=cfg.task.digits if demo else None,
        fingerprint=None if demo else input_digest(cfg.model.path, model=True),
    )


def sampler_inputs(s: SamplerSection, mu: bool) -> dict[str, str]:
    """Content digests of the files sampler ``s``'s rollouts read (another model directory, imported rollouts)
    and, with ``mu`` (sampler-centred scores), μ's model directory."""
    out = {}
    if s.model not in ("policy", "stale"):
        out["model"] = input_digest(s.model, model=True)
    if s.import_path is not None:
        out["import_path"] = input_digest(s.import_path)
    if mu and s.mu_model is not None:
        out["mu_model"] = input_digest(s.mu_model, model=True)
    return out


def task_inputs(t: TaskSection) -> dict[str, str]:
    """Content digests of a JSONL task's prompt file and of its reward function's source file."""
    if t.kind != "jsonl":
        return {}
    out = {"task": input_digest(t.path) if t.path else "absent"}
    module = (t.reward or "").partition(":")[0]
    try:
        found = importlib.util.find_spec(module) if module else None
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    out["reward"] = input_digest(origin) if origin and Path(origin).is_file() else "absent"
    return out


def plan(cfg: PipelineConfig) -> Plan:
    """Every artifact of ``cfg``'s pipeline run: specs built from the config, keys chained in DAG order. A dataset
    of responses without rewards (``storage.readers.unrewarded``) gets rollouts and no scores or stats;
    ValueError (``covgrad.rollouts.inputs.check_unrewarded``) when the config needs its rewards."""
    store = ArtifactStore(cfg.root)
    policy = policy_spec(cfg)
    sc, m = cfg.scores, cfg.model
    base = _step(store, Instance("base_model"), base_model_spec(cfg), {})
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
            score_spec = ScoresSpec(
                sampler=name,
                centering=c,
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
                inputs=sampler_inputs(s, mu=True) if c == "sampler" else {},
                cut_tensors=sc.cut_tensors,
                launcher=sc.placement[0],
                ranks=sc.placement[1],
                nnodes=sc.nnodes,
                node_rank=sc.node_rank,
                rdzv_endpoint=sc.rdzv_endpoint,
                rank_chunks=sc.rank_chunks if sc.placement[1] > 1 else "unsharded",
            )
            upstream = {"base_model": base, "rollouts": rollouts[name]}
            scores[Instance("scores", name, c)] = _step(store, Instance("scores", name, c), score_spec, upstream)
            stats_spec = StatsSpec(sampler=name, centering=c, dask_address=cfg.dask.address)
            up = {"scores": scores[Instance("scores", name, c)]}
            stats[Instance("stats", name, c)] = _step(store, Instance("stats", name, c), stats_spec, up)
    compared = sorted(stats)  # by sampler, then centering
    offpolicy_spec = OffPolicySpec(stats=[(i.sampler, i.centering) for i in compared])
    offpolicy = _step(store, Instance("offpolicy"), offpolicy_spec, {str(i): stats[i] for i in compared})
    analysed = cfg.rollouts.analyse
    s = cfg.rollouts.samplers[analysed]
    main = stats[main_stats(cfg)]
    masks = _step(store, Instance("masks"), MasksSpec(qs=list(cfg.masks.qs)), {"stats": main})
    tokens = update = None
    if cfg.tokens.enabled:
        launcher, ranks = cfg.scores.placement
        sharded = ranks > 1  # the scores stage's ranks (local processes, or a torchrun group of scores.nnodes machines)
        torchrun = sharded and launcher == "torchrun"
        spec = TokensSpec(
            settings=cfg.tokens.model_copy(deep=True),
            params=m.params,
            sampler=analysed,
            on_policy=on_policy(s),
            policy=policy,
            device=m.device,
            self_check=m.self_check,
            launcher=launcher if sharded else "in-process",
            ranks=ranks if sharded else 1,
            nnodes=cfg.scores.nnodes if torchrun else 1,
            node_rank=cfg.scores.node_rank if torchrun else 0,
            rdzv_endpoint=cfg.scores.rdzv_endpoint if torchrun else None,
        )
        tokens = _step(store, Instance("tokens"), spec, {"base_model": base, "rollouts": rollouts[analysed]})
    teacher = plan_teacher(cfg, store, base)
    main_scores = scores[Instance("scores", *main.instance[1:])]
    regime, regimes = plan_regimes(cfg, store, base, teacher, rollouts, main_scores)
    if cfg.update_check.enabled:
        update = plan_update_check(cfg, store, base, rollouts, main, regimes, teacher)
    trajectory = plan_trajectories(cfg, store, base, rollouts, main, regimes, teacher)
    everything = [base, *rollouts.values(), *scores.values(), *stats.values(), offpolicy, masks]
    everything += [x for x in (tokens, update) if x is not None]
    everything += [x for x in (teacher,) if x is not None]
    everything += [*regime.values(), *([regimes] if regimes is not None else []), *trajectory.values()]
    # disabled sections the report does not render leave the report's key as it was
    exclude = {"root"} | (set() if cfg.trajectory.enabled else {"trajectory"}) | (set() if cfg.regimes else {"regimes"})
    dumped = cfg.model_dump(mode="json", exclude=exclude)
    if not dumped["scores"]["cut_tensors"]:  # uncut blocks leave the report's key as it was
        del dumped["scores"]["cut_tensors"]
    if dumped["scores"]["rank_chunks"] == "unsharded":  # so do unsharded rank chunks
        del dumped["scores"]["rank_chunks"]
    report_spec = ReportSpec(name=cfg.name, config=report_layout(dumped))
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


def series_digest(path: str) -> str:
    """The digest of an external run's checkpoint series: its steps and each checkpoint's content digest
    (``"invalid"`` when ``path`` is no series: the stage names the problem)."""
    from storage.stores.trajectory import checkpoint_series  # torch: imported only for an external run

    try:
        series = checkpoint_series(path)
    except ValueError:
        return "invalid"
    listing = json.dumps([[t, input_digest(d, model=True)] for t, d in series])
    return hashlib.sha256(listing.encode()).hexdigest()


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
    launcher, ranks = cfg.scores.placement
    sharded = ranks > 1 and launcher == "local"  # the scores stage's local processes
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
            },
            regime=None if r is None else r.model_copy(deep=True),
            data_sampler=None if r is None else data_sampler,
            launcher=launcher if sharded else "in-process",
            ranks=ranks if sharded else 1,
        )
        upstream = {"base_model": base, "rollouts": rollouts[data_sampler], "stats": main}
        if r is not None:
            assert regimes is not None
            upstream["regimes"] = regimes
            if r.teacher == "trained" and teacher is not None:
                upstream["teacher"] = teacher
        out[Instance("trajectory", cell)] = _step(store, Instance("trajectory", cell), spec, upstream)
    return out


def regime_inputs(r: RegimeSection) -> dict[str, str]:
    """Content digests of the teacher and reference model directories a regime reads."""
    return {
        role: input_digest(path, model=True)
        for role, path in (("teacher", r.teacher), ("reference", r.reference))
        if path is not None and path not in ("policy", "stale", "trained")
    }


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
