"""The config schema's choices (Literal types) and the defaults that engines share with it, in a module free of
pydantic: :mod:`covgrad.config` builds its schema from these, and engines that run on a bare GPU image (no
pipeline packages) import them from here."""

from typing import Literal, get_args

Dtype = Literal["float32", "bfloat16"]  # dtype a model is loaded in
Device = Literal["auto", "cpu", "cuda"]  # where per-sample passes run; auto: cuda when visible
StateDtype = Literal["float64", "float32"]  # moment state of the scores stage
Advantage = Literal["group_mean", "group_zscore", "batch_zscore", "rloo", "global_mean", "none"]
"""Advantage A from rewards r (covgrad.rollouts.sampling.compute_advantages), named as the trainers name them:
group_mean, group_zscore and batch_zscore are TRL GRPOTrainer's scale_rewards "none", "group" and "batch"; rloo is
the leave-one-out baseline of TRL RLOOTrainer."""
MuStore = Literal["none", "full", "topk"]  # how much of the sampler's distribution μ the rollouts keep
TokenMode = Literal["exact", "topk", "mc", "probe", "probe_seq"]  # token-Fisher estimators
MU_UNKNOWN_FORMATS = frozenset({"responses"})  # import formats of datasets whose data distribution μ is unknown
Blocks = int | Literal["auto"]  # parameter blocks of the scores stage: a count, or the fewest that fit
RegimeKind = Literal[
    "rl", "rl_token", "distill_sampled", "distill_reverse_kl", "distill_forward_kl", "sft_drift", "sft_sampled"
]  # the post-training objectives a regime analyses (docs/regimes.md; their cotangents: covgrad.regimes)
LengthNorm = Literal["none", "response_length", "constant"]  # GRPO length normalisation of rl_token's advantages

REGIME_KINDS: tuple[RegimeKind, ...] = get_args(RegimeKind)  # every regime kind, in the order above
TEACHER_KINDS: tuple[RegimeKind, ...] = ("distill_sampled", "distill_reverse_kl", "distill_forward_kl", "sft_drift")
"""Regime kinds whose objective reads a teacher's q (sft_drift: the known data distribution μ, given as a teacher)."""
FULL_DISTRIBUTION_KINDS: tuple[RegimeKind, ...] = ("distill_reverse_kl", "distill_forward_kl", "sft_drift")
"""Regime kinds whose per-position gradient is a covariance over the vocabulary, Cov_{v~p_t}(c_t, J_t): their bound
holds in-sample exactly with the token Fisher Σ_t f_t at the rows' own prefixes
(:func:`covgrad.regimes.fold.head_token_fisher`)."""
LENGTH_NORMS: tuple[LengthNorm, ...] = get_args(LengthNorm)

TOKENS_EXACT_BUDGET = 65536  # largest T·V cotangent rows per sample for which the exact token Fisher runs
TOKENS_ROW_BYTES = 32 * 1024**2  # bytes aimed at per block of token-Fisher cotangent rows
MASK_QS = (0.001, 0.01, 0.05, 0.1)  # default top-q fractions of the masks and overlap tables
