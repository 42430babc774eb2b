"""The regime and regimes stages on the tiny config: each fold's G against a naive per-sequence autograd
loop of the regime's objective, the bound statistics, resume byte-identical, keys unchanged without regimes."""

import json
import shutil

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.rollouts.batch import group_batches
from storage.artifacts import ArtifactStore
from storage.models import load_models
from storage.schema import REGIMES, ROLLOUTS, SCORES
from storage.stores.regimes import bound_a2, regime_gradient
from storage.stores.rollouts import read_batch
from tests.helpers.pipeline import NO_OPTIONAL, run_planned, tiny_config

REGIME_CFG = {
    "rl": {"kind": "rl"},
    "klpen": {"kind": "rl_token", "kl_beta": 0.5, "reference": "stale", "advantages": "none"},
    "distill": {"kind": "distill_reverse_kl", "teacher": "stale"},
    "sampled": {"kind": "distill_sampled", "teacher": "stale"},
    "sft": {"kind": "sft_drift", "sampler": "stale", "teacher": "stale"},
}


IMPORTED_CFG = {
    "imp": {"kind": "rl_token", "sampler": "engine", "advantages": "imported"},
    "implq": {"kind": "distill_sampled", "sampler": "engine", "teacher_logprobs": True},
}


def _export(tiny_run, path):
    """The tiny run's policy rollouts as an import JSONL with per-token advantages and teacher log-probs."""
    root, p = tiny_run
    ro = ArtifactStore(str(root)).open_group(p["rollouts.policy"].ref, ROLLOUTS, mode="r")
    rng = np.random.default_rng(0)
    lines = []
    for n in range(ro["group"].shape[0]):
        pl, rl = int(ro["prompt_len"][n]), int(ro["response_len"][n])
        row = ro["tokens"][n].tolist()
        rec = {
            "prompt_ids": row[:pl],
            "response_ids": row[pl : pl + rl],
            "reward": float(ro["reward"][n]),
            "logprobs": ro["sampler_logp"][n, :rl].tolist(),
            "group": int(ro["group"][n]),
            "advantages": rng.normal(size=rl).tolist(),
            "teacher_logprobs": (-rng.exponential(size=rl)).tolist(),
        }
        lines.append(json.dumps(rec) + "\n")
    path.write_text("".join(lines))
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_run):
    root = tmp_path_factory.mktemp("regimes") / "root"
    shutil.copytree(tiny_run[0], root)
    engine = {"import_path": _export(tiny_run, root.parent / "engine.jsonl"), "on_policy": True}
    over = {"rollouts.samplers.engine": engine, "regimes": {**REGIME_CFG, **IMPORTED_CFG}}
    cfg = tiny_config(str(root), **NO_OPTIONAL, **over)
    results = run_planned(cfg)
    return cfg, results


def _objective(kind, z, zq, ids, mask, adv, imported=None):
    """J_n of one sequence (L, V) logits, naive: the regime's objective summed over scored positions
    (``imported``: the row's token-aligned imported advantages or teacher log-probs)."""
    logp = torch.log_softmax(z[:-1].double(), -1)
    tok = ids[1:]
    w = mask[1:].double()
    drawn = logp.gather(-1, tok[:, None])[:, 0]
    if kind == "rl":
        return adv * (w * drawn).sum()
    if imported is not None:
        a = imported[1:] if kind == "rl_token" else (imported[1:] - drawn).detach()
        return (w * a * drawn).sum()
    logq = torch.log_softmax(zq[:-1].double(), -1)
    if kind == "rl_token":  # the KL penalty −β(log p − log p_ref)(y_t), held constant
        a = -0.5 * (drawn - logq.gather(-1, tok[:, None])[:, 0]).detach()
        return (w * a * drawn).sum()
    if kind == "distill_sampled":
        a = (logq.gather(-1, tok[:, None])[:, 0] - drawn).detach()
        return (w * a * drawn).sum()
    if kind == "distill_reverse_kl":
        return -(w * (logp.exp() * (logp - logq)).sum(-1)).sum()
    return (w * (logq.exp() * logp).sum(-1)).sum()  # sft_drift


def test_regime_G_equals_the_naive_per_sequence_loop(run):
    cfg, results = run
    store = ArtifactStore(cfg.root)
    base = results["base_model"].ref
    policy = load_models(
        store, base, "policy", type("P", (), {"path": None, "dtype": "float32", "trust_remote_code": False})
    )[0]
    stale = load_models(
        store, base, "stale", type("P", (), {"path": None, "dtype": "float32", "trust_remote_code": False})
    )[0]
    layout = select_parameters(policy, None)
    params = [p for _, p in policy.named_parameters() if p.requires_grad]
    for name, r in {**REGIME_CFG, **IMPORTED_CFG}.items():
        fold = store.open_group(results[f"regime.{name}"].ref, SCORES, mode="r")
        G = regime_gradient(fold, slice(None))[0][0]
        ro = store.open_group(results[f"rollouts.{r.get('sampler', 'policy')}"].ref, ROLLOUTS, mode="r")
        total = torch.zeros(layout.P, dtype=torch.float64)
        N, sums = 0, {}  # each prompt group's Σ g_n and size
        for lo, hi in group_batches(ro["group"][:], cfg.scores.groups_per_batch):
            batch = read_batch(ro, lo, hi, trim=False)
            field = {"imp": "token_advantage", "implq": "teacher_logprob"}.get(name)
            extra = None if field is None else torch.from_numpy(ro[field][lo:hi].astype(np.float64))
            with torch.no_grad():
                zq = stale(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            for n in range(hi - lo):
                out = policy(input_ids=batch.input_ids[n : n + 1], attention_mask=batch.attention_mask[n : n + 1])
                J = _objective(
                    r["kind"],
                    out.logits[0],
                    zq[n],
                    batch.input_ids[n],
                    batch.response_mask[n],
                    float(batch.advantages[n]),
                    None if extra is None else extra[n],
                )
                grads = torch.autograd.grad(J, params, allow_unused=True)
                g_n = torch.cat(
                    [
                        (g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                        for g, p in zip(grads, params, strict=False)
                    ]
                )
                total += g_n
                S, k = sums.get(int(ro["group"][lo + n]), (0.0, 0))
                sums[int(ro["group"][lo + n])] = (S + g_n, k + 1)
                N += 1
        naive = (total / N).numpy()
        scale = max(np.abs(naive).max(), 1e-12)
        assert np.abs(G - naive).max() <= 1e-5 * scale, (name, np.abs(G - naive).max(), scale)
        # the prompt-clustered standard error: C/(C − 1)·Σ_c (S_c − n_c G)² / N²
        resid = sum(((S.numpy() - k * naive) ** 2 for S, k in sums.values()), np.zeros(layout.P))
        se = np.sqrt(len(sums) / (len(sums) - 1) * resid) / N
        stored = store.open_group(results["regimes"].ref, REGIMES, mode="r")[f"se_{name}"][:]
        np.testing.assert_allclose(stored, se, rtol=1e-4, atol=1e-6 * se.max(), err_msg=name)
        a2, halves = bound_a2(fold)
        assert a2 > 0 and all(h > 0 for h in halves), name


def test_regimes_stage_tables(run):
    cfg, results = run
    store = ArtifactStore(cfg.root)
    ref = results["regimes"].ref
    rows = {r["regime"]: r for r in store.read_json(ref, "regimes.json")}
    assert set(rows) == set(REGIME_CFG) | set(IMPORTED_CFG)
    assert rows["rl"]["violations"] == 0  # rl on its own rollouts: Cauchy–Schwarz in-sample
    g = store.open_group(ref, REGIMES, mode="r")
    st = store.open_group(results["stats.policy.policy"].ref, "stats.zarr", mode="r")
    np.testing.assert_allclose(
        g["G_rl"][:], st["G"][:], rtol=0, atol=1e-5 * np.abs(st["G"][:]).max()
    )  # float32 g_n vs s_n·A
    np.testing.assert_allclose(g["F"][:], st["F"][:], rtol=1e-9, atol=1e-15)
    pairs = store.read_json(ref, "pairs.json")
    names = [*REGIME_CFG, *IMPORTED_CFG]
    assert {frozenset((p["a"], p["b"])) for p in pairs} == {frozenset((a, b)) for a in names for b in names if a != b}


def test_regimes_only_add_stages():
    """A config with regimes plans every artifact of the same config without them under the same key (the report
    and the update check aside: one renders them, the other steps each regime's loss), plus the regime folds
    and their statistics."""
    from tasks.specs import plan

    plain = plan(tiny_config("runs"))
    with_regimes = plan(tiny_config("runs", regimes={"rl": {"kind": "rl"}}))
    keys = {name: step.ref.key for name, step in with_regimes.items()}
    readers = ("update_check", "report")
    assert {n: s.ref.key for n, s in plain.items() if n not in readers} == {
        n: k for n, k in keys.items() if n in dict(plain.items()) and n not in readers
    }
    assert set(keys) - {n for n, _ in plain.items()} == {"regime.rl", "regimes"}


def test_moment_mean_se_merges_rows_like_numpy():
    from covgrad.regimes.errors import moment_mean_se

    rng = np.random.default_rng(3)
    g = rng.normal(size=(11, 5))
    parts = [g[:4], g[4:4], g[4:]]  # an empty row is skipped
    count = np.array([len(p) for p in parts], dtype=float)
    mean = np.stack([p.mean(0) if len(p) else np.zeros(5) for p in parts])
    m2 = np.stack([((p - p.mean(0)) ** 2).sum(0) if len(p) else np.zeros(5) for p in parts])
    G, se, n = moment_mean_se(count, mean, m2)
    assert n == 11
    np.testing.assert_allclose(G, g.mean(0), rtol=1e-12)
    np.testing.assert_allclose(se, g.std(0, ddof=1) / np.sqrt(11), rtol=1e-12)


def test_regime_block_stats_counts_violations_against_the_allowance():
    from covgrad.regimes.stats import regime_block_stats

    F = np.array([1.0, 1.0, 1.0, 0.0])
    G = np.array([0.5, 1.2, 3.0, 0.0])  # bound a·√F = 1: inside, over by 0.2 (within 3 se), over by 2
    se = np.full(4, 0.1)
    out = regime_block_stats(G, se, F, 1.0, np.stack([G, G]), np.stack([se, se]), np.stack([F, F]), np.ones(2))
    assert out["violations"] == 2 and out["violations_beyond"] == 1
    np.testing.assert_array_equal(out["crossfit_exceed"], [2, 2])
    np.testing.assert_array_equal(out["crossfit_defined"], [3, 3])  # F = 0: the ratio is undefined
    assert np.isnan(out["rho"][3]) and out["max_abs_rho"] == 3.0
    np.testing.assert_array_equal(out["crossfit_exceed_beyond"], [1, 1])
    F_h = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.2, 0.05, 0.0]])  # coordinate 2: F 20× smaller in half 1
    split = regime_block_stats(G, se, F, 1.0, np.stack([G, G]), np.stack([se, se]), F_h, np.ones(2))
    np.testing.assert_array_equal(split["crossfit_exceed_beyond"], [2, 1])  # coordinate 1 beyond with F 0.2
    none = regime_block_stats(
        G, se, F, float("nan"), np.stack([G, G]), np.stack([se, se]), np.stack([F, F]), np.full(2, np.nan)
    )
    assert none["violations"] == 0 and np.isnan(none["bound"]).all()


def test_the_report_has_the_regimes_section(run):
    cfg, results = run
    store = ArtifactStore(cfg.root)
    text = store.fs.cat_file(f"{store.path(results['report'].ref)}/report.md").decode()
    assert "## Regimes" in text and "| distill | distill_reverse_kl |" in text
    assert "standard errors clustered by prompt" in text


def test_full_distribution_regimes_bound_the_head_by_its_token_fisher(run):
    """distill and sft fold the untied LM head's token Fisher at their rows; the regimes stage bounds the head's
    columns by it (bound = a·√F_tok there, no violation), the other columns and the sampled regimes by F."""
    cfg, results = run
    store = ArtifactStore(cfg.root)
    ref = results["regimes"].ref
    rows = {r["regime"]: r for r in store.read_json(ref, "regimes.json")}
    g = store.open_group(ref, REGIMES, mode="r")
    F = g["F"][:]
    for name, r in {**REGIME_CFG, **IMPORTED_CFG}.items():
        fold = store.open_group(results[f"regime.{name}"].ref, SCORES, mode="r")
        bound, a2 = g[f"bound_{name}"][:], bound_a2(fold)[0]
        info = fold.attrs.get("head_token_fisher")
        if r["kind"] not in ("distill_reverse_kl", "distill_forward_kl", "sft_drift"):
            assert info is None and rows[name]["bound_token_fisher"] is None, name
            np.testing.assert_allclose(bound, np.sqrt(a2 * F), rtol=1e-12, atol=0)
            continue
        assert info["tensor"] == "lm_head.weight" and rows[name]["bound_token_fisher"] == "lm_head.weight"
        head = slice(info["offset"], info["offset"] + info["numel"])
        F_tok = fold["head_token_fisher"][:].sum(0) / sum(info["count"])
        np.testing.assert_allclose(bound[head], np.sqrt(a2 * F_tok), rtol=1e-12, atol=0)
        rest = np.ones(F.shape, bool)
        rest[head] = False
        np.testing.assert_allclose(bound[rest], np.sqrt(a2 * F[rest]), rtol=1e-12, atol=0)
        G = g[f"G_{name}"][:]
        assert (np.abs(G[head]) <= bound[head] * (1 + 1e-6)).all(), name
