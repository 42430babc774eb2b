"""The pipeline's one typed configuration, validated once at the boundary.

``PipelineConfig`` is the parameter of the ``covgrad-pipeline`` flow and of ``covgrad run``. Every
section forbids unknown keys, so a typo is an error naming the key rather than a silently ignored
setting. ``configs/demo.yaml`` holds the embedded defaults for the built-in demo.
"""

import re
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    """Base for config sections: unknown keys are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DemoModel(Section):
    """The built-in demo: a tiny Llama trained by SFT on integer addition."""

    hidden_size: int = Field(96, ge=8, le=1024)
    num_layers: int = Field(2, ge=1, le=16)
    num_heads: int = Field(4, ge=1, le=32)
    intermediate_size: int = Field(256, ge=8, le=8192)
    tie_embeddings: bool = False
    seed: int = 0
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0, le=1.0)
    max_steps: int = Field(3000, ge=1)
    eval_every: int = Field(25, ge=1)
    eval_prompts: int = Field(256, ge=16)
    target_accuracy: tuple[float, float] = (0.4, 0.8)
    stale_max_accuracy: float = Field(0.25, ge=0.0, le=1.0)

    @field_validator("target_accuracy")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] < v[1] <= 1.0:
            raise ValueError(f"target_accuracy {v} must satisfy 0 <= low < high <= 1")
        return v


class ModelSection(Section):
    """The policy: the demo model (``path`` unset) or a local Hugging Face causal-LM directory."""

    path: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    demo: DemoModel = DemoModel()


class TaskSection(Section):
    """Prompts and a reward: the built-in ``addition`` task or a JSONL file with an import-path reward."""

    kind: Literal["addition", "jsonl"] = "addition"
    digits: int = Field(2, ge=1, le=6)
    n_prompts: int = Field(32, ge=1)
    seed: int = 1234
    path: str | None = None
    reward: str | None = None

    @model_validator(mode="after")
    def _jsonl_needs_path_and_reward(self) -> Self:
        if self.kind == "jsonl":
            if not self.path:
                raise ValueError("task.kind=jsonl needs task.path (a JSONL file of prompt/answer lines)")
            if not self.reward or not re.fullmatch(r"[\w.]+:[\w]+", self.reward):
                raise ValueError(f"task.reward {self.reward!r} must be an import path 'module:function'")
        return self


class SamplerSection(Section):
    """Who draws the responses and how: the policy, the demo's stale checkpoint, another model
    directory, or a file of rollouts imported from elsewhere (``import_path``). Imported rollouts need
    a source for the sampler's μ: ``on_policy: true`` when they were sampled from the policy itself at
    temperature 1, untruncated (μ = p: policy centering only), ``mu_model`` (the sampler's checkpoint
    directory, μ recomputed with this section's temperature/top_p/top_k), or top_logprobs in the file."""

    model: str = "policy"
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(8, ge=1, le=4096)
    group_size: int = Field(8, ge=2, le=1024)
    seed: int = 0
    batch_size: int = Field(64, ge=1)
    store_mu: Literal["none", "full", "topk"] = "none"
    mu_topk: int = Field(8, ge=1)
    import_path: str | None = None
    on_policy: bool = False
    mu_model: str | None = None

    @model_validator(mode="after")
    def _import_options(self) -> Self:
        if (self.on_policy or self.mu_model is not None) and self.import_path is None:
            raise ValueError("on_policy and mu_model describe imported rollouts; set import_path or drop them")
        if self.on_policy and self.mu_model is not None:
            raise ValueError("on_policy: true says μ = p, so there is no μ to recompute; drop mu_model")
        return self


class RolloutsSection(Section):
    """Samplers by name; ``analyse`` names the one whose rollouts feed masks, tokens and update check."""

    advantage: Literal["group_mean", "group_zscore", "global_mean", "none"] = "group_mean"
    samplers: dict[str, SamplerSection] = Field(default_factory=lambda: {"policy": SamplerSection()})
    analyse: str = "policy"

    @model_validator(mode="after")
    def _analyse_exists(self) -> Self:
        if self.analyse not in self.samplers:
            raise ValueError(f"rollouts.analyse {self.analyse!r} is not one of the samplers {list(self.samplers)}")
        for name in self.samplers:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
                raise ValueError(f"sampler name {name!r}: use lowercase letters, digits, '-' and '_'")
        return self


class ScoresSection(Section):
    """Per-sample score extraction."""

    groups_per_batch: int = Field(4, ge=1)
    params: list[str] | None = None
    byte_budget: int = Field(2 * 1024**3, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    self_check: bool = True
    # Moment state on the device and in the store: float64 (48 bytes per parameter for the two halves) or
    # float32 (32 bytes: mean as a float32 pair, sums in float32; relative error ≲ batches × 6e-8).
    state_dtype: Literal["float64", "float32"] = "float64"
    # Checkpoint the state every this many batches or seconds, whichever comes first (never affects results).
    checkpoint_batches: int = Field(64, ge=1)
    checkpoint_seconds: float = Field(1800.0, gt=0)
    # The partition of the work: [sample shards, parameter blocks]. Sample shard i folds the batches b with
    # b % samples == i into its own state rows; their Chan merges run in another order than one shard's, so
    # the sample count is part of the artifact's key (results differ in the last bits). Blocks split the
    # parameter axis into runs of whole tensors (covgrad.layout.split_blocks) and never change a byte, so
    # they are placement, not key: "auto" blocks are the fewest whose job fits one device by the README's
    # memory model, resolved where the artifact is computed (`covgrad plan` prints them). "auto" alone is
    # [1, "auto"]. The store records the partition; resuming an unfinished one with another stops with a
    # one-line error.
    shards: tuple[int, int | Literal["auto"]] = (1, 1)

    @field_validator("shards", mode="before")
    @classmethod
    def _shards(cls, v: Any) -> Any:
        if v == "auto":
            return (1, "auto")
        if isinstance(v, list | tuple) and len(v) == 2:
            samples, blocks = v
            bad_blocks = blocks != "auto" and (not isinstance(blocks, int) or blocks < 1)
            if not isinstance(samples, int) or samples < 1 or bad_blocks:
                raise ValueError(
                    f'scores.shards {list(v)} needs a sample-shard count >= 1 and a block count >= 1 or "auto"'
                )
        return v


class MasksSection(Section):
    """Top-q fractions for masks and overlap tables."""

    qs: list[float] = Field(default_factory=lambda: [0.001, 0.01, 0.05, 0.1])

    @field_validator("qs")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        for q in v:
            if not 0.0 < q <= 1.0:
                raise ValueError(f"masks.qs value {q} must lie in (0, 1]")
        return sorted(set(v))


TokenMode = Literal["exact", "topk", "mc", "probe", "probe_seq"]


class TokensSection(Section):
    """Token-level Fisher (estimators in covgrad/token_fisher.py).

    ``modes`` unset picks by vocabulary: exact, topk, mc and probe side by side when exact's T·V
    cotangent rows per sample fit ``exact_budget`` (T = the sampler's max_new_tokens), else probe
    alone. Listing ``exact`` above the budget is an error naming the modes that fit. ``topk``,
    ``mc_samples`` and ``probes``: candidates, draws and Rademacher probes per position (per sequence for
    probe_seq); ``row_bytes``: memory aimed at per block of cotangent rows (larger blocks batch the
    backward with vmap, which suits a GPU; on a CPU one row per block was fastest).
    """

    enabled: bool = True
    max_samples: int = Field(64, ge=2)
    modes: list[TokenMode] | None = None
    topk: int = Field(4, ge=1)
    mc_samples: int = Field(8, ge=1)
    probes: int = Field(8, ge=1)
    exact_budget: int = Field(65536, ge=1)
    row_bytes: int = Field(32 * 1024**2, ge=1)
    seed: int = 0

    @field_validator("modes")
    @classmethod
    def _distinct(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError(f"tokens.modes {v} must be a non-empty list without repeats (or unset: chosen by V)")
        return v


class UpdateCheckSection(Section):
    """Real optimizer steps on the REINFORCE loss against the predicted masks."""

    enabled: bool = True
    optimizers: list[Literal["sgd", "adam", "adamw"]] = Field(default_factory=lambda: ["sgd", "adam"])
    precisions: list[Literal["bf16", "fp32_master", "fp32"]] = Field(
        default_factory=lambda: ["bf16", "fp32_master", "fp32"]
    )
    adam_lrs: list[float] = Field(default_factory=lambda: [1e-6, 1e-5])
    sgd_lrs: list[float] = Field(default_factory=lambda: [1e-3, 1e-2])
    steps: list[int] = Field(default_factory=lambda: [1, 4, 16])
    fresh_minibatches: bool = True
    seed: int = 0


class DaskSection(Section):
    """Where reductions run: the threaded scheduler (no address) or an existing dask.distributed scheduler."""

    address: str | None = None


class PipelineConfig(Section):
    """Everything one pipeline run needs. ``root`` is a local path or an fsspec URL."""

    name: str = "demo"
    root: str = "runs"
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollouts: RolloutsSection = RolloutsSection()
    scores: ScoresSection = ScoresSection()
    masks: MasksSection = MasksSection()
    tokens: TokensSection = TokensSection()
    update_check: UpdateCheckSection = UpdateCheckSection()
    dask: DaskSection = DaskSection()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError(f"name {v!r}: use letters, digits, '.', '-' and '_'")
        return v

    @model_validator(mode="after")
    def _samplers_need_sources(self) -> Self:
        for name, s in self.rollouts.samplers.items():
            if s.model == "stale" and self.model.path is not None:
                raise ValueError(
                    f"sampler {name!r} uses model=stale, which only exists for the demo model; "
                    "give a checkpoint directory instead"
                )
        return self


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` strings (values parsed as YAML scalars/lists) to a nested dict copy."""
    import copy

    import yaml

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def format_validation_error(exc: Exception) -> str:
    """One line naming the first bad key and why (for pydantic ValidationError), else str(exc)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "config"
        value = first.get("input")
        shown = f" (got {value!r})" if not isinstance(value, dict) else ""
        return f"invalid config at {loc}: {first['msg']}{shown}"
    return str(exc)
