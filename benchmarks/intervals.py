"""Coverage of the report's 95% intervals (``covgrad.report.uncertainty``) on synthetic scores with a known truth.

Model: G prompt groups of g samples; reward r ~ N(0, 1), A = r − group mean (``group_mean``); score
s_n = β·r_n + σ ⊙ ε_n with ε ~ N(0, I_P), so E[s] = 0, F = β² + σ², G = E[A·s] = β·(1 − 1/g), and
ρ_i = β_i / √(β_i² + σ_i²) · √(1 − 1/g) (all exact). Two truths per statistic (overlap at each q,
Spearman(F, |G|), max |ρ|): the value at this N over fresh seeds (the mean of the statistic over
``--reference`` fresh runs), which the interval is for, and the population value at N → ∞ (printed
too: the finite-N bias is not removed). Each trial draws fresh samples, runs the bootstrap and checks
whether each interval covers each truth. The zero-mean band is checked
the same way on β = 0 (E[s] = 0): the trace statistic should fall inside its band in ~95% of trials.

Run: ``python -m benchmarks.intervals`` (40 trials, about a minute on one core); ``--trials``, ``--P``,
``--groups``, ``--group-size`` and ``--boot`` change the sizes, ``--seed`` the draws.
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import numpy as np

from covgrad.moments import spearman
from covgrad.report.uncertainty import group_bootstrap, interval

QS = (0.01, 0.1)


def population(P: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """β and σ of the P parameters: log-normal scales, so F and |G| spread over decades and partly agree."""
    sigma = np.exp(rng.normal(0.0, 1.0, P))
    beta = sigma * np.exp(rng.normal(-1.0, 1.0, P)) * rng.choice([-1.0, 1.0], P)
    return beta, sigma


def truth(beta: np.ndarray, sigma: np.ndarray, g: int) -> dict[str, float]:
    """The population statistics: overlap at each q, Spearman(F, |G|), max |ρ|."""
    F, absG = beta**2 + sigma**2, np.abs(beta) * (1 - 1 / g)
    out = {"spearman": spearman(F, absG), "max_abs_rho": float(np.max(absG / np.sqrt(F) / math.sqrt(1 - 1 / g)))}
    for q in QS:
        k = math.ceil(q * F.size)
        top_f = set(np.argsort(-F)[:k].tolist())
        out[f"overlap_{q:g}"] = len(top_f & set(np.argsort(-absG)[:k].tolist())) / k
    return out


def sample(beta, sigma, groups: int, g: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Score rows (N, P), advantages (N,) and groups (N,) of one synthetic run."""
    r = rng.normal(size=(groups, g))
    A = (r - r.mean(axis=1, keepdims=True)).ravel()
    S = r.ravel()[:, None] * beta + rng.normal(size=(groups * g, beta.size)) * sigma
    return S, A, np.repeat(np.arange(groups), g)


def estimates(S: np.ndarray, A: np.ndarray) -> dict[str, float]:
    """The point estimates the pipeline stores (1/N moments)."""
    m, F, G = S.mean(0), (S * S).mean(0), (A[:, None] * S).mean(0)
    cov = G - A.mean() * m
    rho = cov / (A.std() * np.sqrt(F - m * m))
    out = {"spearman": spearman(F, np.abs(G)), "max_abs_rho": float(np.nanmax(np.abs(rho)))}
    for q in QS:
        k = math.ceil(q * F.size)
        out[f"overlap_{q:g}"] = len(set(np.argsort(-F)[:k].tolist()) & set(np.argsort(-np.abs(G))[:k].tolist())) / k
    return out


def _cols(S: np.ndarray, a: int, b: int) -> np.ndarray:
    return S[:, a:b]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--P", type=int, default=2000)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--boot", type=int, default=200)
    p.add_argument("--reference", type=int, default=200, help="fresh runs whose mean is the truth at this N")
    p.add_argument("--seed", type=int, default=0, help="seed of the population, the runs and the bootstrap draws")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    beta, sigma = population(args.P, rng)
    true = truth(beta, sigma, args.group_size)
    ref = [estimates(*sample(beta, sigma, args.groups, args.group_size, rng)[:2]) for _ in range(args.reference)]
    at_n = {k: float(np.mean([r[k] for r in ref])) for k in true}
    covered = {k: 0 for k in true}
    covered_inf = {k: 0 for k in true}
    in_band = 0
    for _ in range(args.trials):
        S, A, grp = sample(beta, sigma, args.groups, args.group_size, rng)
        est = estimates(S, A)
        seed = int(rng.integers(1 << 30))
        boot = group_bootstrap(partial(_cols, S), A, grp, args.P, QS, n_boot=args.boot, seed=seed)
        reps = {"spearman": boot["spearman"], "max_abs_rho": boot["max_abs_rho"]}
        reps |= {f"overlap_{q:g}": boot["overlap"][:, i] for i, q in enumerate(QS)}
        for k, t in true.items():
            corr = not k.startswith("overlap")  # Spearman and max |ρ|: on Fisher's z scale, as the report does
            low = -1.0 if k == "spearman" else 0.0
            lo, hi = interval(est[k], reps[k], low, 1.0, groups=boot["groups"], fisher_z=corr)
            covered[k] += lo <= at_n[k] <= hi
            covered_inf[k] += lo <= t <= hi
        S0 = rng.normal(size=S.shape) * sigma  # β = 0: the zero-mean null
        b0 = group_bootstrap(partial(_cols, S0), A, grp, args.P, QS, n_boot=0, seed=seed)
        test = b0["zero_mean"]["trace"]
        in_band += test.band[0] <= test.value <= test.band[1]
    n = args.trials
    print(
        f"P={args.P} groups={args.groups}x{args.group_size} boot={args.boot} trials={n} seed={args.seed}; "
        f"at N {at_n}; N → ∞ {true}"
    )
    for k, c in covered.items():
        inf = covered_inf[k]
        print(f"{k}: 95% interval covers its value at N in {c}/{n} = {c / n:.0%} (the N → ∞ value in {inf}/{n})")
    print(f"zero_mean_trace under E[s]=0 inside its 95% band in {in_band}/{n} = {in_band / n:.0%}")


if __name__ == "__main__":
    main()
