"""The stage specs: for each stage, exactly what its artifacts are computed from (config fields and the values
derived from the config that the stage needs), in DAG order (``StageSpec.__subclasses__()`` is the stage order
that ``tasks.specs.planner.Plan`` declares)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from covgrad.config import (
    Advantage,
    Blocks,
    DemoModel,
    Device,
    RegimeSection,
    SamplerSection,
    StateDtype,
    TaskSection,
    TeacherTraining,
    TokensSection,
    TrajectorySection,
    UpdateCheckSection,
)
from storage.artifacts import ArtifactRef
from tasks.specs.base import (
    PLACED_AS_BEFORE,
    Centering,
    Inputs,
    Later,
    PlacementSpec,
    PolicySpec,
    Spec,
    StageSpec,
    machines_recorded,
)

TRUST = "task.trust_reward_code"
"""The permission to import a task's reward code: a spec that holds a task records it and its key leaves it out
(a permission changes no byte; off, the task's dump leaves it out too: ``covgrad.config.TaskSection``)."""


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


ADVANTAGES_AS_TRL = "advantages_as_trl"
"""The revision of the advantages: ``group_zscore`` became TRL's ``scale_rewards="group"`` (the sample std, eps 1e-4
added to it; it was the population std + 1e-6), and ``batch_zscore`` and ``rloo`` arrived
(:func:`covgrad.rollouts.sampling.compute_advantages`); the kinds it left as they were keep their keys."""
TRL_TOKEN_ADVANTAGES = "trl_token_advantages"
"""The revision of ``format: trl`` imports: TRL's sequence advantage is also stored per token (``token_advantage``,
what ``advantages: imported`` reads)."""
UNREVISED_ADVANTAGES = ("group_mean", "global_mean", "none")  # the advantage kinds whose values stayed as they were


def _advantage_revisions(data: dict[str, Any]) -> list[str]:
    """The revisions since keys existed that change the artifact of a spec with the validated fields ``data``
    (its ``advantage``): [ADVANTAGES_AS_TRL] for a revised advantage kind, else none."""
    kind = data.get("advantage")
    return [] if kind is None or kind in UNREVISED_ADVANTAGES else [ADVANTAGES_AS_TRL]


def _rollouts_revisions(data: dict[str, Any]) -> list[str]:
    """:func:`_advantage_revisions`, and TRL_TOKEN_ADVANTAGES for the rollouts of a ``format: trl`` import (the
    validated ``settings``)."""
    settings = data.get("settings")
    trl = settings is not None and settings.import_path is not None and settings.format == "trl"
    return _advantage_revisions(data) + ([TRL_TOKEN_ADVANTAGES] if trl else [])


class RolloutsSpec(StageSpec):
    """rollouts: responses of sampler ``sampler`` (settings ``settings``) to the prompts of ``task``, rewards
    and ``advantage``-kind advantages; ``revisions``: the code revisions since keys existed that change this
    artifact (derived from the other fields)."""

    STAGE: ClassVar[str] = "rollouts"
    VERSION: ClassVar[str] = "1"
    PLACEMENT: ClassVar[frozenset[str]] = frozenset({TRUST})
    sampler: str
    settings: SamplerSection
    task: TaskSection
    advantage: Advantage
    policy: PolicySpec
    inputs: Inputs = Field(default_factory=dict)  # the task, reward source and sampler files
    # left out while none applies, so the keys of the artifacts they leave as they were stay what they were
    revisions: Annotated[list[str], Later([], recorded=True)] = Field(default_factory=_rollouts_revisions)


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
            "placement.launcher",
            "placement.nnodes",
            "placement.node_rank",
            "placement.rdzv_endpoint",
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
    inputs: Inputs = Field(default_factory=dict)  # the sampler's model and μ files
    checkpoint_batches: int
    checkpoint_seconds: float
    cut_tensors: Annotated[bool, Later(False)] = False  # blocks cut tensors at rows (last bits of the cut tensors)
    # the model sharded over ranks (tasks.jobs.scores_ranks), the machines' fields recorded for a torchrun group;
    # R is hashed with aligned rank chunks (last bits)
    placement: Annotated[
        PlacementSpec,
        *PLACED_AS_BEFORE,
        *machines_recorded("in-process", "local", when="placement.launcher"),
        Later("unsharded", at="ranks", when="rank_chunks"),
    ] = PlacementSpec()
    # ranks' row chunks on their own grids (covgrad.distributed.fsdp.ShardAccumulator)
    rank_chunks: Annotated[Literal["unsharded", "aligned"], Later("unsharded", recorded=True)] = "unsharded"


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
    PLACEMENT: ClassVar[frozenset[str]] = frozenset({"device", "self_check", "placement"})
    settings: TokensSection
    params: list[str] | None
    sampler: str
    on_policy: bool
    policy: PolicySpec
    device: Device
    self_check: bool
    # the model sharded over the scores stage's ranks (tasks.jobs.tokens_ranks), the machines' fields recorded for
    # several machines
    placement: Annotated[PlacementSpec, *PLACED_AS_BEFORE, *machines_recorded(1, when="placement.nnodes")] = (
        PlacementSpec()
    )


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
        {"device", "self_check", "checkpoint_batches", "checkpoint_seconds", "pass_with", TRUST}
    )
    name: str
    # the settings of context distillation, the teacher's samples and the trained teacher arrived later
    settings: Annotated[
        RegimeSection,
        Later(None, at="teacher_prompt"),
        Later("sampler", at="responses"),
        Later(TeacherTraining().model_dump(mode="json"), at="trained_teacher"),
    ]
    sampler: str
    policy: PolicySpec
    params: list[str] | None
    groups_per_batch: int
    state_dtype: StateDtype
    device: Device
    self_check: bool
    inputs: Inputs = Field(default_factory=dict)
    checkpoint_batches: int
    checkpoint_seconds: float
    # the prompts of teacher_prompt and responses: teacher (their rewards)
    task: Annotated[TaskSection | None, Later(None)] = None
    pass_with: list[PassMember] = Field(default_factory=list)


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
    # the regime fields arrived with the update check's regimes: out of the key of a run without regimes
    analysed: Annotated[str | None, Later({}, when="regimes")] = None  # whose rollouts the rl cells step on
    regimes: Annotated[dict[str, RegimeSection], Later({})] = Field(default_factory=dict)
    inputs: Inputs = Field(default_factory=dict)  # the regimes' teacher and reference directories


class TrajectorySpec(StageSpec):
    """trajectory: ``settings.steps`` optimizer steps of one regime from the policy over the parameters
    ``params``: rl (``regime`` None) or the configured regime ``settings.regime`` (``regime``: its
    settings; ``data_sampler``: whose rollouts its fixed data are), on fresh samples of the analysed
    sampler's ``sampler`` settings rewarded by ``task`` with ``advantage`` advantages, or on minibatches of
    ``groups_per_batch`` prompt groups of fixed rollouts (``settings.data = "fixed"``, the sft regimes);
    ``revisions``: the code revisions since keys existed that change its fresh samples' advantages (derived)."""

    STAGE: ClassVar[str] = "trajectory"
    # 2: the change trace (deltas/), the k-step arrays, the Adam drift predictor and rule, the trainer's step options;
    # 3: the drift rule's records as {step,cum}_drift_rule_* (the ranked drift predictor's had been overwritten)
    VERSION: ClassVar[str] = "3"
    PLACEMENT: ClassVar[frozenset[str]] = frozenset({"placement", TRUST})
    # the grid (its cells are planned one by one), the external run (checkpoints, then delta traces, then its
    # tracker history, then its in-run series) and the regime arrived later; an rl trajectory's key is the one it
    # had before trajectories stepped other regimes
    settings: Annotated[
        TrajectorySection,
        Later({}, at="grid"),
        Later(None, at="checkpoints"),
        Later(None, at="deltas"),
        Later(None, at="history"),
        Later(None, at="inrun"),
        Later(None, at="regime", when="regime"),
    ]
    params: list[str] | None
    groups_per_batch: int
    sampler: SamplerSection
    task: TaskSection
    advantage: Advantage
    policy: PolicySpec
    inputs: Inputs = Field(default_factory=dict)  # the task files and teacher directories
    regime: Annotated[RegimeSection | None, Later(None)] = None
    data_sampler: Annotated[str | None, Later(None, when="regime")] = None
    # the revisions of fresh samples' advantages (left out while none applies, so other keys stay)
    revisions: Annotated[list[str], Later([], recorded=True)] = Field(default_factory=_advantage_revisions)
    # the model sharded over the scores stage's local ranks (tasks.jobs.trajectory_ranks)
    placement: Annotated[PlacementSpec, *PLACED_AS_BEFORE, *machines_recorded(1, when="placement.nnodes")] = (
        PlacementSpec()
    )


class ReportSpec(StageSpec):
    """report: the run ``name`` rendered from its artifacts and its config (JSON without ``root``, in
    ``covgrad.config.report_layout``)."""

    STAGE: ClassVar[str] = "report"
    VERSION: ClassVar[str] = "12"  # 12: the zero-mean test, a one-sided cross-fit z between the halves
    name: str
    config: dict[str, Any]
