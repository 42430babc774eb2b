"""The pipeline's one typed configuration, validated once at the boundary.

``PipelineConfig`` is the parameter of the ``covgrad-pipeline`` flow and of ``covgrad run``. Every
section forbids unknown keys, so a typo is an error naming the key rather than a silently ignored
setting. ``configs/demo.yaml`` holds the embedded defaults for the built-in demo.
"""

import json
import re
import string
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from covgrad.choices import (  # the schema's choices and the defaults engines share, without pydantic
    MASK_QS,
    MU_UNKNOWN_FORMATS,
    TEACHER_KINDS,
    TOKENS_EXACT_BUDGET,
    TOKENS_ROW_BYTES,
    Advantage,
    Blocks,
    Device,
    Dtype,
    LengthNorm,
    MuStore,
    RegimeKind,
    StateDtype,
    TokenMode,
)

Launcher = Literal["auto", "in-process", "local", "torchrun"]  # how a scores job's ranks start (scores.launcher)

MOVED = {
    "scores.params": "model.params",
    "scores.device": "model.device",
    "scores.self_check": "model.self_check",
}
"""Keys that moved (old dotted key -> new): a config that sets an old key is refused in one line naming
the new one. Report keys hash the config in the layout before the move (:func:`report_layout`), so
every artifact key stays what it was; :func:`current_layout` reads a recorded config of either layout."""


class Section(BaseModel):
    """Base for config sections: unknown keys are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DemoModel(Section):
    """The built-in demo: a tiny Llama trained by SFT on integer addition."""

    hidden_size: int = Field(96, ge=8, le=1024, description="width of the demo Llama")
    num_layers: int = Field(2, ge=1, le=16, description="transformer layers of the demo Llama")
    num_heads: int = Field(4, ge=1, le=32, description="attention heads of the demo Llama")
    intermediate_size: int = Field(256, ge=8, le=8192, description="MLP width of the demo Llama")
    tie_embeddings: bool = Field(False, description="share the input embedding and the LM head")
    seed: int = Field(0, description="seed of the demo's initialisation and SFT batches")
    batch_size: int = Field(64, ge=1, description="SFT batch size (prompts)")
    lr: float = Field(3e-3, gt=0, le=1.0, description="SFT learning rate (AdamW)")
    max_steps: int = Field(3000, ge=1, description="SFT step limit; training stops earlier at the target accuracy")
    eval_every: int = Field(25, ge=1, description="SFT steps between accuracy evaluations")
    eval_prompts: int = Field(256, ge=16, description="prompts sampled per accuracy evaluation")
    target_accuracy: tuple[float, float] = Field(
        (0.4, 0.8), description="[low, high]: SFT stops once the sampled accuracy lies in this range"
    )
    stale_max_accuracy: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="the stale checkpoint (sampler model=stale) is the last one at or below this accuracy",
    )

    @field_validator("target_accuracy")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] < v[1] <= 1.0:
            raise ValueError(f"target_accuracy {v} must satisfy 0 <= low < high <= 1")
        return v


class ModelSection(Section):
    """The policy: the demo model (``path`` unset) or a local Hugging Face causal-LM directory, and how the
    stages that differentiate it (scores, tokens, update check, and the preflight's architecture check)
    select its parameters (``params``), where they run (``device``) and whether they self-check."""

    path: str | None = Field(None, description="local Hugging Face causal-LM directory; unset: the built-in demo")
    trust_remote_code: bool = Field(False, description="allow the model directory's own modelling code")
    dtype: Dtype = Field("float32", description="dtype the policy is loaded in")
    max_length: int | None = Field(
        None,
        ge=1,
        description="the policy's context in tokens (prompt plus response), for a model whose config.json gives no "
        "max_position_embeddings (or n_positions, ...) and whose tokenizer no model_max_length (state-space and "
        "some older families); ignored for a model that tells its own; unset: such a model is refused",
    )
    params: list[str] | None = Field(
        None,
        description="parameter names or glob patterns analysed by scores, tokens and the update check; "
        "unset: every trainable one (of a multimodal checkpoint, the language model's)",
    )
    device: Device = Field("auto", description="where scores and tokens compute; auto: cuda when visible")
    self_check: bool = Field(
        True,
        description="scores and tokens check their batched per-sample pass against autograd on a few samples first",
    )
    demo: DemoModel = DemoModel()


class TaskSection(Section):
    """Prompts and a reward: the built-in ``addition`` task or a JSONL file with an import-path reward."""

    kind: Literal["addition", "jsonl"] = Field(
        "addition", description="built-in addition, or prompts from a JSONL file"
    )
    digits: int = Field(2, ge=1, le=6, description="addition: digits per operand")
    n_prompts: int = Field(32, ge=1, description="prompts (prompt groups) drawn")
    seed: int = Field(1234, description="seed of the prompt draw")
    path: str | None = Field(None, description="jsonl: file of prompt/answer lines")
    reward: str | None = Field(None, description="jsonl: reward function as an import path 'module:function'")
    trust_reward_code: bool = Field(
        False,
        description="jsonl: import and run a task.reward outside covgrad.rewards (its module's code runs in every "
        "process that scores rewards); off: such a reward is refused before anything is imported",
    )

    @model_validator(mode="after")
    def _jsonl_needs_path_and_reward(self) -> Self:
        if self.kind == "jsonl":
            if not self.path:
                raise ValueError("task.kind=jsonl needs task.path (a JSONL file of prompt/answer lines)")
            if not self.reward or not re.fullmatch(r"[\w.]+:[\w]+", self.reward):
                raise ValueError(f"task.reward {self.reward!r} must be an import path 'module:function'")
        return self

    @model_serializer(mode="wrap")
    def _without_trust_default(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``trust_reward_code`` is left out while off, so a task serialises (and keys its artifacts, and renders
        its report config) as before the setting existed; the specs that hold a task leave it out of their keys
        when on too (a permission changes no byte: ``tasks.specs.stages``)."""
        out = handler(self)
        if out.get("trust_reward_code") is False:
            del out["trust_reward_code"]
        return out


RolloutFormat = Literal["covgrad", "open_instruct", "trl", "verl", "responses"]  # covgrad.rollouts.formats.READERS
SamplerDtype = Literal["float32", "bfloat16", "float16"]  # a sampler's own copy of its model


class SamplerSection(Section):
    """Who draws the responses and how: the policy, the demo's stale checkpoint, another model
    directory, or a file of rollouts imported from elsewhere (``import_path``). Imported rollouts need
    a source for the sampler's μ: ``on_policy: true`` when they were sampled from the policy itself at
    temperature 1, untruncated (μ = p: policy centering only), ``mu_model`` (the sampler's checkpoint
    directory, μ recomputed with this section's temperature/top_p/top_k), or top_logprobs in the file.
    A dataset of responses (``format: responses``) has μ unknown: no sampler centering, and without rewards
    no scores of its own; it is the data of ``sft_sampled`` / ``sft_drift`` regimes (docs/regimes.md, R4)."""

    model: str = Field("policy", description="who samples: policy, stale (demo only) or a model directory")
    dtype: SamplerDtype | None = Field(
        None,
        description="the dtype of the sampler's own copy of its model (and of mu_model), as an inference engine "
        "holds it (bf16, fp16); unset: model.dtype, the same weights as the policy",
    )
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus truncation; 1 = none")
    top_k: int = Field(0, ge=0, description="top-k truncation; 0 = none")
    max_new_tokens: int = Field(8, ge=1, le=4096, description="response length limit T")
    group_size: int = Field(8, ge=2, le=1024, description="responses per prompt")
    seed: int = Field(0, description="sampling seed")
    batch_size: int = Field(64, ge=1, description="sequences generated per batch")
    store_mu: MuStore = Field(
        "none", description="keep the sampler's distribution μ per position: not, in full, or its top-k"
    )
    mu_topk: int = Field(8, ge=1, description="store_mu=topk: entries of μ kept per position")
    import_path: str | None = Field(
        None,
        description="a JSONL (or parquet) file of rollouts sampled elsewhere, or of a dataset's responses (format "
        "responses), used instead of sampling",
    )
    on_policy: bool = Field(
        False, description="imported rollouts were sampled from the policy at temperature 1, untruncated"
    )
    mu_model: str | None = Field(
        None, description="imported rollouts: the sampler's checkpoint directory, to recompute μ"
    )
    format: RolloutFormat = Field(
        "covgrad",
        description="imported rollouts: the dump format of import_path (docs/formats.md): covgrad's JSONL, "
        "open-instruct's RolloutRecord, TRL's generation rows, verl's DataProto rows, or responses: a plain SFT "
        "dataset (prompt, response, optional eos, reward, group; no log-probs, μ unknown)",
    )
    reward_fields: list[str] | None = Field(
        None,
        description="imported rollouts: the reward is the NaN-skipping sum of these record columns, each 'name' or "
        "'name:weight' (TRL's one column per reward function and reward_weights); default: the format's reward",
    )
    verify_records: int = Field(
        0,
        ge=0,
        description="imported rollouts: how many records (at most all, picked with seed) the policy (or mu_model) "
        "re-scores to check the file's log-probs; per-record KL in the rollouts store",
    )
    verify_max_kl: float = Field(
        0.05, gt=0.0, description="verify_records: per-token k3-KL (nats) above which a record is an outlier"
    )

    @model_validator(mode="after")
    def _import_options(self) -> Self:
        if (self.on_policy or self.mu_model is not None) and self.import_path is None:
            raise ValueError("on_policy and mu_model describe imported rollouts; set import_path or drop them")
        if self.on_policy and self.mu_model is not None:
            raise ValueError("on_policy: true says μ = p, so there is no μ to recompute; drop mu_model")
        if not self.mu_known:
            for key in ("on_policy", "mu_model", "verify_records"):
                if getattr(self, key):
                    raise ValueError(
                        f"format {self.format} is a dataset whose μ is unknown, so {key} does not apply; drop it, "
                        "or import sampled rollouts with their log-probs as format covgrad"
                    )
        imported = {k: getattr(self, k) for k in IMPORT_DEFAULTS if getattr(self, k) != IMPORT_DEFAULTS[k]}
        if imported and self.import_path is None:
            raise ValueError(f"{sorted(imported)[0]} describes imported rollouts; set import_path or drop it")
        for entry in self.reward_fields or []:
            name, _, weight = entry.partition(":")
            if not name or (weight and not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", weight)):
                raise ValueError(f"reward_fields entry {entry!r}: write 'column' or 'column:weight' (a number)")
        return self

    @property
    def mu_known(self) -> bool:
        """False for a dataset of responses (``format`` in ``covgrad.choices.MU_UNKNOWN_FORMATS``): the data
        distribution μ is unknown, so there is no sampler μ (no log-probs, no sampler centering)."""
        return self.format not in MU_UNKNOWN_FORMATS

    @model_serializer(mode="wrap")
    def _without_import_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fields of :data:`IMPORT_DEFAULTS` and :data:`SAMPLER_DEFAULTS` are left out at their defaults,
        so a sampler that does not use them serialises (and keys its artifacts) as before they existed."""
        out = handler(self)
        for name, default in {**IMPORT_DEFAULTS, **SAMPLER_DEFAULTS}.items():
            if name in out and out[name] == default:
                del out[name]
        return out


IMPORT_DEFAULTS: dict[str, Any] = {
    "format": "covgrad",
    "reward_fields": None,
    "verify_records": 0,
    "verify_max_kl": 0.05,
}
"""The import settings a sampler's dump leaves out at these defaults (:class:`SamplerSection`)."""

SAMPLER_DEFAULTS: dict[str, Any] = {"dtype": None}
"""Sampler settings left out of the serialised section at these defaults, so keys stay what they were."""


class RolloutsSection(Section):
    """Samplers by name; ``analyse`` names the one whose rollouts feed masks, tokens and update check."""

    advantage: Advantage = Field(
        "group_mean",
        description="advantage A from rewards r: r − group mean, TRL's group or batch z-score, the leave-one-out "
        "baseline (RLOO), r − global mean, or r itself (docs/regimes.md)",
    )
    samplers: dict[str, SamplerSection] = Field(
        default_factory=lambda: {"policy": SamplerSection()}, description="samplers by name"
    )
    analyse: str = Field("policy", description="the sampler whose rollouts feed masks, tokens and the update check")

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

    groups_per_batch: int = Field(4, ge=1, description="prompt groups per score batch")
    byte_budget: int = Field(
        2 * 1024**3,
        ge=0,
        description="bytes of per-sample score rows kept in the store; above it only moments are kept",
    )
    state_dtype: StateDtype = Field(
        "float64",
        description="moment state on the device and in the store: float64 (48 bytes per parameter for the two halves) "
        "or float32 (32 bytes: mean as a float32 pair, sums in float32; relative error ≲ batches × 6e-8)",
    )
    checkpoint_batches: int = Field(
        64,
        ge=1,
        description="checkpoint the state every this many batches (or seconds, whichever first; never affects results)",
    )
    checkpoint_seconds: float = Field(1800.0, gt=0, description="checkpoint the state every this many seconds")
    shards: tuple[int, Blocks] = Field(
        (1, 1),
        description="[sample shards, parameter blocks]. Sample shard i folds the batches b with b % samples == i into "
        "its own state rows; their Chan merges run in another order than one shard's, so the sample count is part of "
        "the artifact's key (results differ in the last bits). Blocks split the parameter axis into runs of whole "
        'tensors and never change a byte: "auto" blocks are the fewest whose job fits one device (`covgrad plan` '
        'prints them). "auto" alone is [1, "auto"]. Resuming an unfinished partition with another is an error',
    )
    cut_tensors: bool = Field(
        False,
        description="parameter blocks may cut a tensor at row boundaries (dim 0), balanced by parameter count, so that "
        "a tensor larger than the device allows (a 262k-vocabulary embedding) is spread over several jobs; part of the "
        "key when true (the fold's float64 sums of a cut tensor run over other column tiles: last bits, within 1e-12)",
    )
    ranks: int = Field(
        1,
        ge=1,
        description="processes the model is sharded over (FSDP2, one shard of every parameter and of its state each; "
        "never changes a byte), every machine's: scores.nnodes machines run ranks / nnodes each. More than 1 (or "
        "torchrun) needs one parameter block",
    )
    rank_chunks: Literal["unsharded", "aligned"] = Field(
        "unsharded",
        description="with ranks > 1, where a rank's per-sample row chunks start: unsharded (the single-process "
        "grid: the state's bytes are the single-process run's, but a chunk that straddles a shard boundary is formed "
        "by every rank holding rows of it) or aligned (at the rank's own rows: every column formed once; the state "
        "agrees with the single-process run to the rounding of the products, and R is part of the key). Whole "
        "blocks (a run that keeps per-sample rows) are unaffected",
    )
    launcher: Launcher = Field(
        "auto",
        description="how the ranks start: in-process (no sharding, ranks 1), local (torch.multiprocessing processes "
        "on this machine, gloo), torchrun (a torchrun group on this machine or on scores.nnodes machines; gloo on "
        "the CPU, nccl with one CUDA device per rank), auto (in-process for ranks 1, else local)",
    )
    nnodes: int = Field(
        1,
        ge=1,
        description="machines of a torchrun group; each runs the same config (its own scores.node_rank) against "
        "the same store root",
    )
    node_rank: int = Field(
        0,
        ge=0,
        description="this machine's index in a torchrun group of scores.nnodes machines; node 0 hosts the "
        "rendezvous at scores.rdzv_endpoint, creates the artifact's arrays and completes it",
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="HOST:PORT of node 0, where torchrun's c10d rendezvous meets (needed for more than one "
        "machine; unset on one machine: a free local port)",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in MOVED.items():
                if old.removeprefix("scores.") in data:
                    raise ValueError(f"{old} moved to {new}")
        return data

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

    @model_validator(mode="after")
    def _ranks(self) -> Self:
        if self.ranks > 1 and self.launcher == "in-process":
            raise ValueError(
                f"scores.ranks={self.ranks} with scores.launcher=in-process: the in-process launcher runs one rank; "
                "set scores.launcher=local, torchrun (or auto)"
            )
        if (self.ranks > 1 or self.launcher == "torchrun") and self.shards[1] != 1:
            raise ValueError(
                f"scores.ranks={self.ranks} with scores.shards={list(self.shards)}: the ranks shard the parameters "
                f"themselves; set scores.shards=[{self.shards[0]}, 1]"
            )
        if self.launcher != "torchrun":
            for name, value, unset in (
                ("nnodes", self.nnodes, 1),
                ("node_rank", self.node_rank, 0),
                ("rdzv_endpoint", self.rdzv_endpoint, None),
            ):
                if value != unset:
                    raise ValueError(
                        f"scores.{name}={value} with scores.launcher={self.launcher}: only torchrun runs ranks on "
                        f"several machines; set scores.launcher=torchrun or unset scores.{name}"
                    )
            return self
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(
                f"scores.nnodes={self.nnodes} without scores.rdzv_endpoint: the machines meet at node 0's torchrun "
                "rendezvous; set scores.rdzv_endpoint=HOST:PORT (node 0's address and a free port)"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"scores.node_rank={self.node_rank} is not in [0, {self.nnodes}) (scores.nnodes={self.nnodes}); "
                "set it to this machine's index"
            )
        if self.ranks % self.nnodes:
            raise ValueError(
                f"scores.ranks={self.ranks} (every machine's ranks) does not split evenly over scores.nnodes="
                f"{self.nnodes} machines; set scores.ranks to a multiple of {self.nnodes}"
            )
        host, _, port = (self.rdzv_endpoint or "").rpartition(":")
        valid = bool(host) and not any(c in host for c in "/ ") and port.isdigit() and 0 < int(port) < 65536
        if self.rdzv_endpoint is not None and not valid:
            raise ValueError(
                f"scores.rdzv_endpoint={self.rdzv_endpoint} is not HOST:PORT; set it to node 0's address and a "
                "free port in [1, 65535], e.g. 10.0.0.1:29400"
            )
        return self

    @property
    def placement(self) -> tuple[str, int]:
        """The resolved (launcher, ranks): ``auto`` is in-process for one rank, local for more (ranks: every
        machine's)."""
        if self.launcher == "auto":
            return ("in-process" if self.ranks == 1 else "local"), self.ranks
        return self.launcher, self.ranks


class MasksSection(Section):
    """Top-q fractions for masks and overlap tables."""

    qs: list[float] = Field(
        default_factory=lambda: list(MASK_QS),
        description="top-q fractions of the parameters, each in (0, 1]",
    )

    @field_validator("qs")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        for q in v:
            if not 0.0 < q <= 1.0:
                raise ValueError(f"masks.qs value {q} must lie in (0, 1]")
        return sorted(set(v))


class TokensSection(Section):
    """Token-level Fisher (estimators in covgrad/tokens/fisher.py).

    ``modes`` unset picks by vocabulary: exact, topk, mc and probe side by side when exact's T·V
    cotangent rows per sample fit ``exact_budget`` (T = the sampler's max_new_tokens), else probe
    alone. Listing ``exact`` above the budget is an error naming the modes that fit. ``topk``,
    ``mc_samples`` and ``probes``: candidates, draws and Rademacher probes per position (per sequence for
    probe_seq); ``row_bytes``: memory aimed at per block of cotangent rows (larger blocks batch the
    backward with vmap, which suits a GPU; on a CPU one row per block was fastest).
    """

    enabled: bool = Field(True, description="run the token Fisher stage")
    max_samples: int = Field(64, ge=2, description="samples of the analysed rollouts it reads (the first ones)")
    modes: list[TokenMode] | None = Field(
        None, description="estimators: exact, topk, mc, probe, probe_seq; unset: chosen by the vocabulary size"
    )
    topk: int = Field(4, ge=1, description="topk: candidate tokens per position")
    mc_samples: int = Field(8, ge=1, description="mc: draws per position")
    probes: int = Field(8, ge=1, description="probe: Rademacher probes per position (per sequence for probe_seq)")
    exact_budget: int = Field(
        TOKENS_EXACT_BUDGET, ge=1, description="largest T·V cotangent rows per sample for which exact runs"
    )
    row_bytes: int = Field(TOKENS_ROW_BYTES, ge=1, description="memory aimed at per block of cotangent rows")
    seed: int = Field(0, description="seed of the mc draws and probes")

    @field_validator("modes")
    @classmethod
    def _distinct(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError(f"tokens.modes {v} must be a non-empty list without repeats (or unset: chosen by V)")
        return v


class UpdateCheckSection(Section):
    """Real optimizer steps on the REINFORCE loss against the predicted masks."""

    enabled: bool = Field(True, description="run the update check stage")
    optimizers: list[Literal["sgd", "adam", "adamw"]] = Field(
        default_factory=lambda: ["sgd", "adam"], description="optimizers stepped"
    )
    precisions: list[Literal["bf16", "fp32_master", "fp32"]] = Field(
        default_factory=lambda: ["bf16", "fp32_master", "fp32"], description="weight precisions stepped"
    )
    adam_lrs: list[float] = Field(default_factory=lambda: [1e-6, 1e-5], description="learning rates of adam/adamw")
    sgd_lrs: list[float] = Field(default_factory=lambda: [1e-3, 1e-2], description="learning rates of sgd")
    steps: list[int] = Field(default_factory=lambda: [1, 4, 16], description="step counts compared with the masks")
    fresh_minibatches: bool = Field(True, description="each step on another minibatch (else the same one)")
    seed: int = Field(0, description="seed of the minibatch order")


class TrajectorySection(Section):
    """K optimizer steps of one regime from the policy, each step's changed set against step-0 predictors.

    ``regime``: ``rl`` (the rollouts' advantages, predictors from the main statistics) or the name of an
    entry of ``regimes`` (its objective, teacher and temperatures; predictors G and ρ from its statistics;
    the sft kinds step on its sampler's rollouts). ``grid``: named cells, each overriding fields of this
    section (e.g. ``{regime: sft, optimizer: sgd, lr: 0.01}``); with cells, one trajectory runs per cell."""

    enabled: bool = Field(False, description="run the trajectory stage")
    data: Literal["on_policy", "fixed"] = Field(
        "on_policy",
        description="on_policy: fresh samples from the current policy every step; fixed: the analysed rollouts",
    )
    steps: int = Field(32, ge=1, description="optimizer steps K")
    optimizer: Literal["sgd", "adam", "adamw"] = Field("adam", description="optimizer stepped")
    lr: float = Field(1e-5, gt=0, description="learning rate (after warmup)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam/AdamW betas")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay; SGD and Adam take none")
    warmup: int = Field(0, ge=0, description="steps of linear learning-rate warmup")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="learning rate after the warmup: constant, or cosine decay to 0 at the last step"
    )
    max_grad_norm: float | None = Field(
        None, gt=0, description="clip the gradient's global L2 norm to this before each step; unset: no clipping"
    )
    minibatches: int = Field(
        1, ge=1, description="gradient accumulation: each step's rows in this many equal minibatches, one backward each"
    )
    precision: Literal["bf16", "fp32_master", "fp32"] = Field(
        "bf16",
        description="bf16: weights and optimizer in bf16; fp32_master: float32 master weights and optimizer state, "
        "forward/backward on a bf16 copy re-rounded after each step; fp32: everything float32",
    )
    prompts_per_step: int = Field(8, ge=1, description="on_policy: prompts per step (group_size samples each)")
    checkpoint_ratio: float = Field(
        2.0, ge=0, description="Hugging Face checkpoints at steps floor(r**i) and the last; 0: none"
    )
    state_every: int = Field(1, ge=1, description="steps between stored resume states")
    seed: int = Field(0, description="seed of the samples, the prompt order and the random predictors")
    regime: str = Field("rl", description="rl, or the name of an entry of regimes whose loss the steps follow")
    checkpoints: str | None = Field(
        None,
        description="analyse an external run instead of stepping: a manifest.json or a folder of step-named "
        "checkpoints (verl global_step_N, Trainer checkpoint-N, Hub step-N; starting at model.path)",
    )
    deltas: str | None = Field(
        None,
        description="analyse an external run from a weight-delta trace instead: grail's delta_NNNNNN.pt files beside "
        "base_weights.pt, TRL's async-GRPO anchors/ and deltas/, or slime's weight_vNNNNNN/ folders (the format is "
        "detected; docs/formats.md); the start weights are model.path's",
    )
    history: str | None = Field(
        None,
        description="with checkpoints: the run's logged history (lr, loss, grad norm, KL, reward, rollout-mismatch "
        "metrics per step): verl's file-logger JSONL, a TensorBoard event folder or file, or a trainer_state.json "
        "(format detected; docs/formats.md); with every step's lr the Adam drift rule runs",
    )
    inrun: str | None = Field(
        None,
        description="with checkpoints or deltas: the run's in-run series (an InRunFolder's out_dir: inrun.json and "
        "step_NNNNNN.npz); its F, |G|, |rho| at the latest folded step and at the first predict each checkpoint's "
        "changed sets beside the step-0 statistics (records {step,cum}_inrun_{latest,first}_*)",
    )
    grid: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="named cells overriding these fields, one trajectory each; none by default"
    )

    @field_validator("grid")
    @classmethod
    def _cells(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        fixed = {"enabled", "grid"}
        for name, cell in v.items():
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
                raise ValueError(f"trajectory.grid cell name {name!r}: use lowercase letters, digits, '-' and '_'")
            bad = sorted(set(cell) - (set(cls.model_fields) - fixed))
            if bad:
                raise ValueError(f"trajectory.grid.{name} sets {bad}: a cell overrides other trajectory fields")
            TrajectorySection.model_validate({**cell, "grid": {}})
        return v

    def cells(self) -> dict[str | None, "TrajectorySection"]:
        """The trajectories this section runs: its grid's cells by name (each the section with the cell's
        overrides, no grid), or only itself (name None) without a grid."""
        if not self.grid:
            return {None: self}
        base = self.model_dump(exclude={"grid"})
        return {name: TrajectorySection.model_validate({**base, **cell}) for name, cell in self.grid.items()}

    @model_validator(mode="after")
    def _one_external_run(self) -> "TrajectorySection":
        if self.checkpoints is not None and self.deltas is not None:
            raise ValueError(
                f"trajectory.checkpoints {self.checkpoints!r} and trajectory.deltas {self.deltas!r} are both set; "
                "an external run is read from one of them"
            )
        return self

    @model_validator(mode="after")
    def _history_of_external_run(self) -> "TrajectorySection":
        if self.history is not None and self.checkpoints is None:
            raise ValueError(
                f"trajectory.history {self.history!r} is the logged history of a checkpoint series; set "
                "trajectory.checkpoints to the run it belongs to (a grail delta trace's steps are not the trainer's)"
            )
        return self

    @model_validator(mode="after")
    def _inrun_of_external_run(self) -> "TrajectorySection":
        if self.inrun is not None and self.checkpoints is None and self.deltas is None:
            raise ValueError(
                f"trajectory.inrun {self.inrun!r} is the in-run series of an external run; set trajectory.checkpoints "
                "or trajectory.deltas to the run it was recorded in"
            )
        return self

    @field_validator("checkpoint_ratio")
    @classmethod
    def _ratio(cls, v: float) -> float:
        if v != 0 and not v > 1:
            raise ValueError(f"trajectory.checkpoint_ratio {v} must be 0 (no checkpoints) or > 1 (log-spaced steps)")
        return v


def template_fields(template: str) -> list[str]:
    """The field names of a teacher-prompt template, in order of appearance.

    The template is ``str.format`` text: ``{answer}`` is a field, ``{{`` and ``}}`` are literal braces. Only
    plain names are fields; positional (``{}``), indexed, attribute, converted or formatted fields are refused.

    Raises:
        ValueError: one line naming the bad field or the unbalanced brace.
    """
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"teacher prompt template {template!r}: {exc} (write a literal brace as {{{{ or }}}})"
        ) from None
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if not field.isidentifier() or spec or conversion:
            raise ValueError(
                f"teacher prompt template field {{{field}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} must be a plain name such as {{answer}} or {{prompt}}"
            )
        names.append(field)
    return names


def fill_template(template: str, record: Mapping[str, Any]) -> str:
    """The teacher prompt of one task record: ``template`` with each ``{field}`` replaced by ``str(record[field])``.

    Raises:
        ValueError: when the record lacks a field the template names (the message names it and the record's
            fields), or on a template :func:`template_fields` refuses.
    """
    missing = [f for f in template_fields(template) if f not in record]
    if missing:
        raise ValueError(
            f"the teacher prompt needs field {{{missing[0]}}}, which the task record lacks (it has {sorted(record)})"
        )
    return template.format_map({k: str(v) for k, v in record.items()})


class TeacherTraining(Section):
    """The demo's trained teacher: the policy trained on by SFT (AdamW) until its sampled accuracy reaches
    ``accuracy``; the defaults reach 0.85 from the demo policy in about 600 steps (docs/regimes.md)."""

    accuracy: float = Field(0.85, gt=0.0, le=1.0, description="stop at the first evaluation at or above this accuracy")
    lr: float = Field(1e-3, gt=0, le=1.0, description="AdamW learning rate")
    batch_size: int = Field(128, ge=1, description="prompts per SFT step")
    max_steps: int = Field(4000, ge=1, description="SFT step limit (an error when the accuracy is not reached)")
    eval_every: int = Field(50, ge=1, description="SFT steps between accuracy evaluations")


class RegimeSection(Section):
    """One analysed post-training objective (docs/regimes.md), folded over the rollouts of ``sampler``.

    Its options mirror ``covgrad.regimes.cotangents.Regime``. ``teacher``: the model whose logits are q (distill) or
    μ (sft_drift): ``stale`` (the demo's stale checkpoint), ``policy`` or a model directory;
    ``reference``: the KL-penalty reference of ``rl_token``; ``advantages``: ``sequence`` (the rollouts'
    A, broadcast over tokens), ``imported`` (the per-token ``advantages`` field of imported rollouts) or
    ``none`` (KL penalty only); ``teacher_logprobs``: distill_sampled reads the imported per-token
    ``teacher_logprobs`` field instead of a teacher model."""

    kind: RegimeKind = Field("rl", description="the objective: one of covgrad.choices.REGIME_KINDS")
    sampler: str | None = Field(
        None,
        description="whose rollouts (sft: the responses, e.g. a format: responses dataset); unset: rollouts.analyse",
    )
    teacher: str | None = Field(
        None, description="distill/sft_drift: stale, policy, trained (demo: the policy trained on) or a model directory"
    )
    reference: str | None = Field(None, description="rl_token with kl_beta: stale, policy or a model directory")
    advantages: Literal["sequence", "imported", "none"] = Field(
        "sequence", description="rl/rl_token advantages: the rollouts' A, the imported per-token field, or none"
    )
    teacher_logprobs: bool = Field(False, description="distill_sampled: the imported teacher_logprobs field")
    temperature: float = Field(1.0, gt=0.0, description="the policy's τ in p = softmax(z/τ)")
    teacher_temperature: float = Field(1.0, gt=0.0, description="τ_q of the teacher's logits")
    kl_beta: float = Field(0.0, ge=0.0, description="rl_token: β of the KL penalty to the reference")
    kl_reward_to_go: bool = Field(False, description="rl_token: sum the KL penalties to the end of the response")
    length_norm: LengthNorm = Field(
        "none", description="rl_token: GRPO length normalisation of the per-token advantages"
    )
    max_length: int | None = Field(None, ge=1, description="length_norm=constant: the constant")
    baseline: bool = Field(False, description="distill_sampled: subtract b_t = −KL(p_t‖q_t)")
    teacher_prompt: str | None = Field(
        None,
        description="context distillation: the teacher reads this prompt instead of the policy's, then the same "
        "response tokens; str.format text over the task record's fields ({prompt}, {answer}, and a JSONL "
        "record's other fields), e.g. teacher: policy with the answer in its system prompt",
    )
    responses: Literal["sampler", "teacher"] = Field(
        "sampler",
        description="whose responses the regime folds over: the rollouts of `sampler`, or group_size fresh samples "
        "per prompt drawn from the teacher (its prompt, its temperature, untruncated; sft on the teacher's samples)",
    )
    trained_teacher: TeacherTraining = Field(
        default_factory=TeacherTraining,
        description="teacher=trained (demo): how the teacher stage trains the demo policy on (shared by every regime)",
    )

    @model_validator(mode="after")
    def _sources(self) -> Self:
        k = self.kind
        if self.teacher_prompt is not None:
            if self.teacher is None:
                raise ValueError("teacher_prompt is the teacher's prompt: set teacher (policy: context distillation)")
            template_fields(self.teacher_prompt)
        if self.responses == "teacher" and self.teacher is None:
            raise ValueError("responses: teacher samples the teacher: set teacher")
        if k in TEACHER_KINDS and self.teacher is None and not (k == "distill_sampled" and self.teacher_logprobs):
            raise ValueError(f"regime kind {k} needs a teacher (stale, policy or a model directory)")
        if k == "rl_token" and self.kl_beta > 0 and self.reference is None:
            raise ValueError("regime kind rl_token with kl_beta > 0 needs a reference model")
        if k == "rl" and self.advantages != "sequence":
            raise ValueError("regime kind rl takes the sequence advantages; use rl_token for per-token ones")
        if self.length_norm == "constant" and self.max_length is None:
            raise ValueError("length_norm constant needs max_length")
        if k.startswith("sft") and self.sampler is None and self.responses == "sampler":
            raise ValueError(
                f"regime kind {k} needs responses: set sampler to the sampler that drew them, or responses: teacher"
            )
        if self.baseline and self.teacher is None:
            raise ValueError("baseline −KL(p_t‖q_t) needs a teacher model")
        return self


class DaskSection(Section):
    """Where reductions run: the threaded scheduler (no address) or an existing dask.distributed scheduler."""

    address: str | None = Field(None, description="dask.distributed scheduler address; unset: threads in-process")


class TrackersSection(Section):
    """Experiment trackers that ``covgrad run`` logs the run's scalars to after its stages (docs/formats.md): the
    headline statistics at step 0 and every trajectory's per-step metrics at the run's own steps, tags under
    ``covgrad/``. Each is an optional extra; none by default."""

    tensorboard: str | None = Field(
        None,
        description="a folder for TensorBoard event files, one subfolder <name>-<run key> per run (extra "
        "tensorboard: pip install 'covgrad[tensorboard]'); unset: no TensorBoard logging",
    )
    wandb: str | None = Field(
        None,
        description="a folder for W&B offline runs, one subfolder <name>-<run key> per run (extra wandb: pip "
        "install 'covgrad[wandb]'); unset: no W&B logging",
    )
    mlflow: str | None = Field(
        None,
        description="a folder for MLflow runs, one subfolder <name>-<run key> holding a SQLite store mlflow.db per "
        "run (extra mlflow: pip install 'covgrad[mlflow]'); unset: no MLflow logging",
    )
    trackio: str | None = Field(
        None,
        description="a folder for trackio runs, one subfolder <name>-<run key> per run holding the trackio project "
        "database covgrad.db (extra trackio: pip install 'covgrad[trackio]'); unset: no trackio logging",
    )


class PipelineConfig(Section):
    """Everything one pipeline run needs. ``root`` is a local path or an fsspec URL."""

    name: str = Field("demo", description="run name: the run index is {root}/runs/{name}.json")
    root: str = Field("runs", description="artifact root: a local path or an fsspec URL")
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollouts: RolloutsSection = RolloutsSection()
    scores: ScoresSection = ScoresSection()
    masks: MasksSection = MasksSection()
    tokens: TokensSection = TokensSection()
    update_check: UpdateCheckSection = UpdateCheckSection()
    trajectory: TrajectorySection = TrajectorySection()
    dask: DaskSection = DaskSection()
    trackers: TrackersSection = TrackersSection()
    regimes: dict[str, RegimeSection] = Field(
        default_factory=dict, description="analysed post-training objectives by name (docs/regimes.md); none by default"
    )

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

    @model_validator(mode="after")
    def _trajectory_regimes_exist(self) -> Self:
        for cell, t in self.trajectory.cells().items():
            if t.regime != "rl" and t.regime not in self.regimes:
                at = "trajectory" if cell is None else f"trajectory.grid.{cell}"
                raise ValueError(f"{at}.regime {t.regime!r} is not rl or one of regimes {list(self.regimes)}")
        return self

    @model_validator(mode="after")
    def _regimes_exist(self) -> Self:
        for name, r in self.regimes.items():
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
                raise ValueError(f"regime name {name!r}: use lowercase letters, digits, '-' and '_'")
            if r.sampler is not None and r.sampler not in self.rollouts.samplers:
                raise ValueError(f"regimes.{name}.sampler {r.sampler!r} is not one of {list(self.rollouts.samplers)}")
            for role in ("teacher", "reference"):
                if getattr(r, role) in ("stale", "trained") and self.model.path is not None:
                    raise ValueError(f"regimes.{name}.{role}: {getattr(r, role)} only exists for the demo model")
            if r.reference == "trained":
                raise ValueError(f"regimes.{name}.reference: trained is a teacher; give stale, policy or a directory")
            if r.teacher == "trained" and r.trained_teacher.accuracy <= self.model.demo.target_accuracy[1]:
                raise ValueError(
                    f"regimes.{name}.trained_teacher.accuracy {r.trained_teacher.accuracy} must exceed the policy's "
                    f"model.demo.target_accuracy high end {self.model.demo.target_accuracy[1]}"
                )
        trained = {r.trained_teacher.model_dump_json() for r in self.regimes.values() if r.teacher == "trained"}
        if len(trained) > 1:
            raise ValueError(f"regimes with teacher: trained must share one trained_teacher; got {sorted(trained)}")
        return self


def _moved(data: dict[str, Any], moves: dict[str, str]) -> dict[str, Any]:
    """A copy of the config JSON ``data`` with each key ``old`` of ``moves`` that it holds moved to ``new``."""
    out = json.loads(json.dumps(data))
    for old, new in moves.items():
        (src, key), (dst, new_key) = old.split("."), new.split(".")
        if key in out.get(src, {}):
            out.setdefault(dst, {})[new_key] = out[src].pop(key)
    return out


def report_layout(data: dict[str, Any]) -> dict[str, Any]:
    """The config JSON ``data`` in the layout the report's key hashes: the keys of ``MOVED`` at their old
    places (the report key of a config is the same as before they moved)."""
    return _moved(data, {new: old for old, new in MOVED.items()})


def current_layout(data: dict[str, Any]) -> dict[str, Any]:
    """A recorded config JSON (a report spec's, a run index's) of either layout, with the keys of
    ``MOVED`` at their new places: what ``PipelineConfig.model_validate`` accepts."""
    return _moved(data, MOVED)


def config_help(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[str]:
    """One line per leaf key of ``model``: dotted key, default (as YAML/JSON) and description.

    Sections are walked recursively; a dict of sections (``rollouts.samplers``) lists its value's keys
    under ``<name>``, with the default entries' names in its own line.
    """
    lines = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = field.annotation if isinstance(field.annotation, type) else None
        if section is not None and issubclass(section, BaseModel):
            lines += config_help(section, f"{key}.")
            continue
        default = field.get_default(call_default_factory=True)
        args = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is dict and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            lines.append(f"{key}  (default: {', '.join(default)})  {field.description}")
            lines += config_help(args[1], f"{key}.<name>.")
            continue
        shown = json.dumps(default, default=str, ensure_ascii=False)
        lines.append(f"{key} = {shown}  {field.description}")
    return lines


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The sections of a YAML config file, unvalidated; one-line errors for a missing file, bad YAML or
    a file that is not a mapping."""
    import yaml

    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"config file {str(source)!r} does not exist")
    try:
        data = yaml.safe_load(source.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {str(source)!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(source)!r} must hold a mapping of sections")
    return data


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
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
            raise ValueError(f"--set {key.strip()}: value {raw!r} is not valid YAML ({problem})") from exc
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
