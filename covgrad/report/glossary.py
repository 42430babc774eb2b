"""What every column and quantity name of the report means: the HTML's tooltips and footnotes, and
``docs/reading.md`` (which lists the same names; ``tests/report/test_report.py`` checks both).

Notation as in DESIGN.md section 1: s = sequence score ∇θ log p(response), A = advantage, means over the N
samples with 1/N; F = mean(s²), G = mean(A·s), Fvar = Var(s), Cov = Cov(A, s), ρ = Cov / (std(A)·√Fvar).
"""

from __future__ import annotations

import re

GLOSSARY: dict[str, str] = {
    # the generic table columns
    "quantity": "name of the number in this row (its own entry in this glossary)",
    "value": "the number as stored by the stage that computed it",
    "note": "what the number is, in words",
    "lo": "lower end of the 95-percent interval (or of the zero-mean band for zero_mean rows); see Uncertainty",
    "hi": "upper end of the 95-percent interval (or of the zero-mean band for zero_mean rows)",
    # task
    "model": "the analysed policy: a model directory or the built-in demo Llama",
    "selection": "parameter name patterns analysed (model.params); P counts their elements",
    "task": "prompt set and reward: the built-in addition task or a JSONL file",
    "sampler": "which sampler drew the responses (policy = the analysed model itself)",
    "centering": "score centering: policy (∇ log p) or sampler (logits centred under the sampler's μ)",
    "group_size": "responses drawn per prompt (one prompt group)",
    "groups": "prompt groups (prompts) in the rollouts",
    "T": "most new tokens per response (max_new_tokens)",
    "temperature": "sampling temperature of the sampler",
    "top_p": "nucleus truncation of the sampler (1 = none)",
    "top_k": "top-k truncation of the sampler (0 = none)",
    "advantage": "advantage mode: group_mean (reward minus its group's mean; TRL scale_rewards none), group_zscore "
    "(TRL group), batch_zscore (TRL batch), rloo (leave-one-out baseline), global_mean, none",
    "mean_reward": "mean reward over all N responses",
    "groups_with_reward_variance": "prompt groups whose rewards are not all equal (only they give A ≠ 0)",
    "finding": "why the run has no finding about G (degenerate), or an off-policy finding, in words",
    # headline
    "N": "samples (responses) the statistics are over",
    "P": "parameter elements analysed",
    "std_A": "standard deviation of the advantages (1/N)",
    "max_abs_rho": "largest |ρ_i| over the parameters; ≤ 1 by Cauchy–Schwarz",
    "bound_violations": "parameters with |Cov_i| > std(A)·√Fvar_i in sample (0 up to rounding: Cauchy–Schwarz)",
    "crossfit_frac_exceed": "fraction of parameters whose cross-fit ratio exceeds 1 (F even groups, G odd)",
    "crossfit_frac_exceed_even_F_odd_G": "fraction with |Cov| from odd prompt groups > std(A)·√Fvar from even ones",
    "crossfit_frac_exceed_odd_F_even_G": "fraction with |Cov| from even prompt groups > std(A)·√Fvar from odd ones",
    "zero_mean_trace": "N·‖m‖² / tr Var(s), m = mean(s): ≈ 1 (inside its band) when E[s] = 0",
    "zero_mean_coord": "mean over coordinates of N·m_i² / Var_i: ≈ 1 (inside its band) when E[s] = 0",
    "spearman_F_absG": "Spearman rank correlation of F and |G| over all parameters",
    # overlap
    "q": "top fraction of parameters (q = 1/100 keeps the top one percent)",
    "scope": "global: top-q over all parameters; per_tensor: top-q inside each tensor",
    "n_G": "size of the top-q set by |G|",
    "n_F": "size of the top-q set by F",
    "n_both": "parameters in both top-q sets",
    "overlap": "n_both / n_G: the fraction of the top-q set by |G| that is also in the top-q set by F",
    "random": "overlap expected for random positions (= q)",
    "per_tensor_random": "overlap expected when each tensor keeps its share of both top sets but positions are random",
    # off-policy
    "kl_per_token": "mean over response tokens of KL(μ ‖ p) in nats (0 when the sampler is the policy)",
    "sampler_weights": "policy: the sampler generated with bitwise the scored policy's weights (equal model "
    "identities); other; unknown: imported rollouts or a dataset, with no identity",
    "rel_diff_G": "‖G_sampler − G_policy‖ / ‖G_sampler‖ between one sampler's two centerings",
    "rel_diff_stats": "the largest such relative difference over m, F, Fvar, G and Cov (≈ 0 when μ ≡ p)",
    "overlap_1pct": "global overlap at q = 1/100",
    # tokens
    "mode": "token Fisher estimator: exact, topk (top-k vocabulary), mc (Monte Carlo tokens), probe (random probes)",
    "rel_L2_vs_F": "‖Σ f / N − F‖ / ‖F‖ over parameters: token Fisher against the sequence Fisher",
    "spearman_vs_F": "Spearman rank correlation of Σ f / N and F over parameters",
    "expected_relerr": "relative L2 error the estimator's own sampling noise predicts (NaN for exact estimators)",
    "n": "samples the errors of this row use",
    "relerr_vs_seq": "relative L2 error of Σ f / n against F at n samples",
    "cross_term_ratio": "‖F − Σ f / N‖ / ‖F‖ explained by cross-position terms (→ 0 as N grows when E[s_t] = 0)",
    "score_sum_relerr_max": "largest relative error of Σ_t s_t against the stored sequence score (self-check)",
    "covered_mass_topk_mean": "mean probability mass of the top-k tokens kept by the topk estimator",
    "entropy_mean": "mean next-token entropy over response positions (nats)",
    "mc_samples": "tokens drawn per position by the Monte Carlo estimator",
    "mc_expected_relerr": "relative L2 error the Monte Carlo estimator's sampling noise predicts",
    "probe_samples": "random probes per position of the probe estimator",
    "probe_expected_relerr": "relative L2 error the probe estimator's sampling noise predicts",
    "mc_vs_topk": "relative L2 difference of the Monte Carlo and top-k token Fisher",
    "topk_vs_exact": "relative L2 error of the top-k token Fisher against exact",
    "mc_vs_exact": "relative L2 error of the Monte Carlo token Fisher against exact",
    "probe_vs_exact": "relative L2 error of the probe token Fisher against exact",
    "lm_head_closed_form_relerr_max": "largest error of the LM-head closed form p_u(1 − p_u)·h² against autograd",
    "trace_mode": "estimator whose per-token trace is plotted",
    "spearman_trace_entropy": "Spearman correlation of the per-token Fisher trace and the token entropy",
    "main_mode": "the estimator the headline line reports",
    # update check
    "optimizer": "optimizer of the update-check cell (sgd, adam)",
    "precision": "weights the cell steps: bf16 (bf16 weights), fp32_master (fp32 master, bf16 copy), fp32",
    "lr": "learning rate of the cell",
    "steps": "optimizer steps taken",
    "frac_changed_bf16": "fraction of parameters whose bf16 value differs from its bf16 start (exact test)",
    "frac_changed_abs": "fraction of parameters with |Δw| > atol (1e-5) in the cell's own precision",
    "best_predictor": "predictor with the largest Jaccard index against the changed (bf16) set",
    "best_jaccard": "Jaccard index |predicted ∩ changed| / |predicted ∪ changed| of the best predictor",
    "random_jaccard": "Jaccard index of a random set of the changed set's size (the chance level)",
    "absorb_precision": "precision of absorb (predicted change: steps·|first step| ≥ half the bf16 spacing at w)",
    "absorb_recall": "recall of absorb against the changed set",
    "bound_precision": "precision of bound (absorb with |G| replaced by its bound √mean(A²)·√F; SGD only)",
    "bound_recall": "recall of bound against the changed set",
    "smallw": "predictor: the changed-set-sized set of smallest |w| (bf16 absorbs less at small weights)",
    "absG": "predictor: the changed-set-sized top set by |G|",
    "absrho": "predictor: the changed-set-sized top set by |ρ|",
    "F": "predictor: the changed-set-sized top set by F",
    "drift": "predictor: the changed-set-sized top set by c/h(w_0), Adam's expected move per step (c from |ρ| "
    "and the samples per step) over half the bf16 gap at w_0",
    "drift_rule": "rule: the steps at which the drift model's reach √((Σlr·c)² + Σlr²(1 − c²)) crosses the next "
    "midpoint w_0 ± h, ± 3h, … between bf16 neighbours",
    "k": "window length in optimizer steps",
    "d_k": "fraction of parameters whose stored value at step t + k differs from step t, mean over windows t",
    "independent": "d_k if every step changed an independent random set of its size: 1 − Π(1 − d_1) over the window",
    "ratio": "d_k / independent: far below 1 when the same parameters change step after step",
    # in-run series (covgrad.report.inrun: one row per folded step of the trainer's own batches)
    "mean_F": "mean over the parameters of F = mean(s²) on the folded step's batch, at that step's weights",
    "mean_absG": "mean over the parameters of |G|, G = mean(A·s) on the folded step's batch",
    "mean_absrho": "mean over the parameters of |ρ| on the folded step's batch (NaN entries left out)",
    "overlap_first": "|S_t ∩ S_first| / |S_t|: the fraction of the step's top-q set by F, |G| or |ρ| (the suffix) "
    "also in the first folded step's",
    "overlap_prev": "|S_t ∩ S_prev| / |S_t|: the fraction of the step's top-q set by F, |G| or |ρ| (the suffix) "
    "also in the previous folded step's (NaN at the first)",
    "inrun_latest": "predictor: the changed-set-sized top set by F, |G| or |ρ| (the suffix) of the run's latest "
    "in-run folded step before the record (trajectory.inrun)",
    "inrun_first": "predictor: the changed-set-sized top set by F, |G| or |ρ| (the suffix) of the run's first "
    "in-run folded step (trajectory.inrun)",
}
# Names that stand for a family (overlap(q=0.01), overlap_q0.01, ...): pattern -> glossary name.
PATTERNS = (
    (r"overlap\(q=.*\)", "overlap"),
    (r"relerr_(\w+)_vs_seq(_n\d+)?", "relerr_vs_seq"),
    (r"spearman_(\w+)_vs_seq", "spearman_vs_F"),
    (r"(\w+)_expected_relerr", "expected_relerr"),
    (r"overlap_first_(F|absG|absrho)", "overlap_first"),
    (r"overlap_prev_(F|absG|absrho)", "overlap_prev"),
    (r"(cum_)?inrun_latest_(F|absG|absrho)", "inrun_latest"),
    (r"(cum_)?inrun_first_(F|absG|absrho)", "inrun_first"),
)


def meaning(name: str) -> str | None:
    """What the column or quantity ``name`` means, or None when the glossary lacks it."""
    if name in GLOSSARY:
        return GLOSSARY[name]
    for pattern, key in PATTERNS:
        if re.fullmatch(pattern, name):
            return GLOSSARY[key]
    return None
