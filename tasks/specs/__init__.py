"""Stage specs and the plan: what each artifact is computed from, and every artifact's key, before anything runs.

A stage's **spec** is a frozen pydantic object holding exactly what the stage computes from: its config fields and
the values derived from the config that it needs (the sampler of a scores artifact, whether that sampler is the
policy, the fingerprint of a user model). ``base`` holds the machinery (the key of a spec, the :class:`Later` mark
of fields that arrived after keys existed), ``stages`` the stage specs, ``inputs`` the content digests of the user
files they read, ``planner`` the plan that builds every spec from the config.

Instances tell several artifacts of one stage apart: ``rollouts.<sampler>``, ``scores.<sampler>.<centering>``,
``stats.<sampler>.<centering>``; an :class:`Instance` is the typed name, its string form the name that run indexes
and notebooks use.
"""

from tasks.specs.base import (
    Centering,
    Instance,
    Later,
    PlacementSpec,
    PolicySpec,
    Spec,
    StageSpec,
    leave_out_later,
)
from tasks.specs.inputs import regime_inputs, sampler_inputs, series_digest, task_inputs
from tasks.specs.planner import (
    REPORT_LATER,
    STAGES,
    Plan,
    Step,
    base_model_spec,
    centerings,
    main_stats,
    on_policy,
    plan,
    plan_regimes,
    plan_teacher,
    plan_trajectories,
    plan_update_check,
    policy_spec,
    regime_pass_group,
    regime_task_section,
    report_config,
)
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

__all__ = [
    "REPORT_LATER",
    "STAGES",
    "BaseModelSpec",
    "Centering",
    "Instance",
    "Later",
    "MasksSpec",
    "OffPolicySpec",
    "PassMember",
    "PlacementSpec",
    "Plan",
    "PolicySpec",
    "RegimeSpec",
    "RegimeStatsSpec",
    "ReportSpec",
    "RolloutsSpec",
    "ScoresSpec",
    "Spec",
    "StageSpec",
    "StatsSpec",
    "Step",
    "TeacherSpec",
    "TokensSpec",
    "TrajectorySpec",
    "UpdateCheckSpec",
    "base_model_spec",
    "centerings",
    "leave_out_later",
    "main_stats",
    "on_policy",
    "plan",
    "plan_regimes",
    "plan_teacher",
    "plan_trajectories",
    "plan_update_check",
    "policy_spec",
    "regime_inputs",
    "regime_pass_group",
    "regime_task_section",
    "report_config",
    "sampler_inputs",
    "series_digest",
    "task_inputs",
]
