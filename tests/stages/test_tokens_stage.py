"""tokens stage on one tiny pipeline: the documented store, the in-stage checks, and recomputation from
scratch (one batch of all samples, per-sample score loop) as the slow reference; the study's summary on
plain numpy arrays."""

import math

import numpy as np
import pytest
import torch
import zarr

import storage.stores.tokens
import tasks.tokens
from covgrad.layout import select_parameters
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.tokens.fisher import cross_term_ratio, token_fisher, token_scores
from covgrad.tokens.study import (
    POSITION_ARRAYS,
    StudyRecord,
    TokenStudy,
    rel_l2,
    relerr_jackknife,
    row_names,
    summarize,
    trace_names,
)
from storage.artifacts import ArtifactStore, mark_batch_done
from storage.models import load_models
from storage.schema import ROLLOUTS
from storage.schema import TOKENS as STORE
from tasks.specs import plan, policy_spec
from tests.helpers.pipeline import tiny_config
from tests.helpers.stages import POLICY_ONLY, run_upto


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    cfg = tiny_config(str(tmp_path_factory.mktemp("tokens")), **POLICY_ONLY)
    refs = run_upto(cfg, "tokens")
    store = ArtifactStore(cfg.root)
    return cfg, refs, store, store.open_group(refs["tokens"], STORE, mode="r")


@pytest.mark.slow
def test_store_has_documented_arrays(run):
    cfg, refs, store, g = run
    N = cfg.tokens.max_samples
    T = cfg.rollouts.samplers["policy"].max_new_tokens
    P = g["fisher_seq"].shape[0]
    assert store.is_complete(refs["tokens"])
    assert g.attrs["modes"] == ["exact", "topk", "mc", "probe"]  # chosen by V: exact fits the budget
    for name in (*POSITION_ARRAYS, "trace_exact", "trace_topk", "trace_mc", "trace_probe"):
        assert g[name].shape == (N, T)
    for name in ("fisher_exact", "fisher_topk", "fisher_mc", "fisher_probe", "fisher_seq"):
        assert g[name].shape == (P,)
        assert np.isfinite(g[name][:]).all() and g[name][:].sum() > 0
    mass = g["covered_mass"][:][g["p_drawn"][:] > 0]
    assert ((mass > 0) & (mass <= 1 + 1e-12)).all()
    assert not [name for name, _ in g.arrays() if name.startswith("rows_")]  # resume state, dropped
    rows = g.attrs["errors_vs_seq"]
    assert sorted({r["n"] for r in rows}) == [2, 4, 8]
    assert all(math.isfinite(r["relerr_vs_seq"]) for r in rows)


@pytest.mark.slow
def test_in_stage_checks_hold(run):
    _, _, _, g = run
    s = g.attrs["scalars"]
    assert s["score_sum_relerr_max"] < 1e-5  # Σ_t s_t = s per sample
    assert s["lm_head_closed_form_relerr_max"] < 1e-5
    assert 0 < s["mc_expected_relerr"] < 10 and math.isfinite(s["mc_vs_exact"])
    assert 0 < s["probe_expected_relerr"] < 10 and math.isfinite(s["probe_vs_exact"])
    assert -1 <= s["spearman_exact_vs_seq"] <= 1


@pytest.mark.slow
def test_matches_one_batch_recomputation(run):
    """Batched, resumable sums agree with token_fisher / token_scores on all N samples at once."""
    cfg, refs, store, g = run
    ro = store.open_group(refs["rollouts.policy"], ROLLOUTS, mode="r")
    model = load_models(store, refs["base_model"], "policy", policy_spec(cfg))[0].eval()
    layout = select_parameters(model, cfg.model.params)
    N = cfg.tokens.max_samples
    pl = torch.from_numpy(ro["prompt_len"][:N]).long()
    rl = torch.from_numpy(ro["response_len"][:N]).long()
    L = int((pl + rl).max())
    ids = torch.from_numpy(ro["tokens"][:N, :L]).long()
    attn = (torch.arange(L)[None, :] < (pl + rl)[:, None]).long()
    target = torch.from_numpy(ro["response_mask"][:N, :L]).float()
    exact = token_fisher(model, layout, ids, attn, pl, rl, "exact")
    np.testing.assert_allclose(g["fisher_exact"][:], exact["fisher_sum"].numpy() / N, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(g["trace_exact"][:, : exact["trace"].shape[1]], exact["trace"].numpy(), rtol=1e-5)
    psg = PerSampleGrads(model, layout)
    seq = torch.stack(
        [psg(ids[n : n + 1], attn[n : n + 1], lambda z, n=n: score_logit_grad(z, ids[n : n + 1], target[n : n + 1]))[0]
         for n in range(N)]
    )  # fmt: skip
    tok = token_scores(model, layout, ids, attn, pl, rl)
    np.testing.assert_allclose(g["fisher_seq"][:], seq.double().square().mean(0).numpy(), rtol=1e-5, atol=1e-12)
    expected = cross_term_ratio(seq, tok.double().square().sum(1))
    # the ratio is a difference of float32 per-sample squares over ‖mean s²‖: resolved to ~1e-7 absolute
    assert g.attrs["scalars"]["cross_term_ratio"] == pytest.approx(expected, rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_topk_with_k_equal_v_is_exact_and_resume_is_identical(run, monkeypatch):
    cfg, _, store, g = run
    V = g.attrs["V"]
    cfg_v = cfg.model_copy(update={"tokens": cfg.tokens.model_copy(update={"topk": V})})
    ref = plan(cfg_v)["tokens"].ref

    def killed_at_batch_2(group, b):
        if b == 2:
            raise RuntimeError("killed")
        mark_batch_done(group, b)

    monkeypatch.setattr(storage.stores.tokens, "mark_batch_done", killed_at_batch_2)
    with pytest.raises(RuntimeError, match="killed"):
        run_upto(cfg_v, "tokens")
    assert not store.is_complete(ref)
    monkeypatch.undo()
    computed = []
    batch = TokenStudy.batch
    monkeypatch.setattr(TokenStudy, "batch", lambda self, ro, b, emit: computed.append(b) or batch(self, ro, b, emit))
    run_upto(cfg_v, "tokens")
    assert store.is_complete(ref) and computed == [2, 3]
    gv = store.open_group(ref, STORE, mode="r")
    np.testing.assert_allclose(gv["fisher_topk"][:], g["fisher_exact"][:], rtol=1e-6, atol=1e-12)
    assert_uninterrupted_run_equals(cfg_v, store, ref, gv)


def assert_uninterrupted_run_equals(cfg, store, ref, resumed: zarr.Group) -> zarr.Group:
    """Clear the resumed tokens store ``resumed``, compute it again without a kill: the same arrays with the
    same values. Returns the fresh group."""
    arrays = {name: array[:] for name, array in resumed.arrays()}
    store.clear(ref)
    run_upto(cfg, "tokens")
    fresh = store.open_group(ref, STORE, mode="r")
    assert sorted(arrays) == sorted(name for name, _ in fresh.arrays())
    for name, values in arrays.items():
        np.testing.assert_array_equal(fresh[name][:], values, err_msg=name)
    return fresh


@pytest.mark.slow
def test_killed_while_dropping_the_batch_rows_resumes_to_the_same_store(run, monkeypatch):
    cfg, _, store, _ = run
    cfg_k = cfg.model_copy(update={"tokens": cfg.tokens.model_copy(update={"seed": 7})})
    ref = plan(cfg_k)["tokens"].ref
    drop = zarr.Group.__delitem__

    def killed_after_one_drop(group, key):
        drop(group, key)
        raise RuntimeError("killed")

    monkeypatch.setattr(zarr.Group, "__delitem__", killed_after_one_drop)
    with pytest.raises(RuntimeError, match="killed"):
        run_upto(cfg_k, "tokens")
    assert not store.is_complete(ref)
    monkeypatch.undo()
    summarized = []
    summarize = tasks.tokens.summarize
    monkeypatch.setattr(tasks.tokens, "summarize", lambda *a: summarized.append(1) or summarize(*a))
    run_upto(cfg_k, "tokens")
    assert store.is_complete(ref) and summarized == []  # the rerun only drops the remaining rows
    resumed = store.open_group(ref, STORE, mode="r")
    scalars = resumed.attrs["scalars"]
    assert not [name for name, _ in resumed.arrays() if name.startswith("rows_")]
    fresh = assert_uninterrupted_run_equals(cfg_k, store, ref, resumed)
    assert fresh.attrs["scalars"] == scalars


@pytest.mark.slow
def test_topk_above_vocabulary_is_one_clear_error(run):
    cfg, _, store, g = run
    V = g.attrs["V"]
    bad = cfg.model_copy(update={"tokens": cfg.tokens.model_copy(update={"topk": V + 1})})
    with pytest.raises(ValueError, match=rf"tokens.topk = {V + 1} exceeds the vocabulary size V = {V}"):
        run_upto(bad, "tokens")
    assert not store.is_complete(plan(bad)["tokens"].ref)


@pytest.mark.slow
def test_budget_picks_probe_and_refuses_exact(run):
    """Above the exact budget the default is the probe mode alone; asking for exact is one clear error."""
    cfg, _, store, g = run
    V, T = g.attrs["V"], cfg.rollouts.samplers["policy"].max_new_tokens
    small = cfg.model_copy(update={"tokens": cfg.tokens.model_copy(update={"exact_budget": T * V - 1})})
    refs = run_upto(small, "tokens")
    gp = store.open_group(refs["tokens"], STORE, mode="r")
    assert gp.attrs["modes"] == ["probe"] and "trace_probe" in gp and "fisher_exact" not in gp
    s = gp.attrs["scalars"]
    assert 0 < s["probe_expected_relerr"] < 10 and s["score_sum_relerr_max"] < 1e-5
    bad = small.model_copy(update={"tokens": small.tokens.model_copy(update={"modes": ["exact", "probe"]})})
    with pytest.raises(ValueError, match=rf"T·V = {T}·{V} = {T * V} backward rows .* use mode='probe'"):
        run_upto(bad, "tokens")


def test_study_summary_of_numpy_arrays():
    """The study's summary on plain numpy arrays: the estimates are the batch sums over N (the halves of
    mc weighted by their draws), the same bits whatever the column step, the errors their relative L2."""
    rng = np.random.default_rng(0)
    modes, n_batches, P, N, T = ["exact", "mc"], 4, 37, 8, 3
    rows = {name: rng.random((n_batches, P)) for name in row_names(modes)}
    positions = {name: rng.random((N, T)) for name in (*POSITION_ARRAYS, *trace_names(modes))}
    response_len = np.array([3, 2, 1, 3, 3, 2, 1, 1])
    head = np.full(n_batches, np.nan)
    record = StudyRecord(rows, np.full(n_batches, 2.0), positions, rng.random(N), head, response_len)
    runs = []
    for step in (5, P):
        out = {name: np.zeros(P) for name in ("fisher_exact", "fisher_mc", "fisher_seq")}
        runs.append((out, *summarize(record, out, modes, {"exact": 0, "mc": 4}, step)))
    (out, scalars, table), (out_whole, scalars_whole, _) = runs
    for name, values in out.items():
        np.testing.assert_array_equal(values, out_whole[name])
    np.testing.assert_allclose(out["fisher_exact"], rows["exact"].sum(0) / N)
    np.testing.assert_allclose(out["fisher_mc"], (rows["mc_a"] + rows["mc_b"]).sum(0) / (2 * N))
    assert scalars["relerr_exact_vs_seq"] == pytest.approx(rel_l2(out["fisher_exact"], out["fisher_seq"]), rel=1e-12)
    assert scalars["mc_vs_exact"] == pytest.approx(scalars_whole["mc_vs_exact"], rel=1e-12)
    assert sorted({r["n"] for r in table}) == [2, 4, 8] and scalars["lm_head_closed_form_relerr_max"] is None
    response = np.arange(T)[None, :] < response_len[:, None]
    assert scalars["entropy_mean"] == pytest.approx(positions["entropy"][response].mean())
    assert scalars["trace_mode"] == "exact" and -1 <= scalars["spearman_trace_entropy"] <= 1


def test_summary_interval_is_the_jackknife_of_the_batch_sums():
    """The summary's interval of each error against F is the delete-one-batch jackknife of the batch sums
    (Gram matrices recovered from the cumulative sums), and for equal batches the textbook jackknife."""
    rng = np.random.default_rng(3)
    modes, g, P, N, T = ["exact", "mc"], 5, 41, 10, 2
    rows = {name: rng.random((g, P)) for name in row_names(modes)}
    positions = {name: rng.random((N, T)) for name in (*POSITION_ARRAYS, *trace_names(modes))}
    record = StudyRecord(rows, np.full(g, 2.0), positions, rng.random(N), np.full(g, np.nan), np.full(N, T))
    out = {name: np.zeros(P) for name in ("fisher_exact", "fisher_mc", "fisher_seq")}
    scalars, _ = summarize(record, out, modes, {"exact": 0, "mc": 4}, 7)
    batch = {"exact": rows["exact"], "mc": (2 * rows["mc_a"] + 2 * rows["mc_b"]) / 4}
    for mode, est_rows in batch.items():
        d, r = est_rows - rows["seq_sq"], rows["seq_sq"]
        theta = scalars[f"relerr_{mode}_vs_seq"]
        assert theta == pytest.approx(np.linalg.norm(d.sum(0)) / np.linalg.norm(r.sum(0)), rel=1e-12)
        loo = np.array(
            [np.linalg.norm(np.delete(d, j, 0).sum(0)) / np.linalg.norm(np.delete(r, j, 0).sum(0)) for j in range(g)]
        )
        half = 2.7764 * math.sqrt((g - 1) / g * ((loo - loo.mean()) ** 2).sum())  # t_4 at 0.975
        lo, hi = scalars[f"relerr_{mode}_vs_seq_lo"], scalars[f"relerr_{mode}_vs_seq_hi"]
        assert lo == pytest.approx(max(theta - half, 0.0), rel=1e-3, abs=1e-9)
        assert hi == pytest.approx(theta + half, rel=1e-3)
    assert all(math.isnan(v) for v in relerr_jackknife(np.ones((1, 1)), np.ones((1, 1)), np.array([3]), 0.5))


def test_jackknife_interval_covers_a_rerun():
    """Heavy-tailed scores (t with 5 df), a probe-like token Fisher: the 95% interval of the relative L2
    error holds the error's mean over fresh runs in at least 88% of 200 runs, at 4 batches of 4 samples
    (the SmolLM2 config's study) and 8 of 8."""
    rng = np.random.default_rng(4)
    P = 200
    sigma = np.exp(rng.normal(size=P))

    def draw(g, m):
        s = rng.standard_t(5, size=(g * m, P)) * sigma
        f = sigma**2 * rng.chisquare(2, size=(g * m, P)) / 2
        r, e = (s * s).reshape(g, m, P).sum(1), f.reshape(g, m, P).sum(1)
        d = e - r
        return np.linalg.norm(d.sum(0)) / np.linalg.norm(r.sum(0)), d @ d.T, r @ r.T

    for g, m in ((4, 4), (8, 8)):
        mean = np.mean([draw(g, m)[0] for _ in range(1000)])
        covered = 0
        for _ in range(200):
            theta, kd, kr = draw(g, m)
            lo, hi = relerr_jackknife(kd, kr, np.full(g, m), theta)
            covered += lo <= mean <= hi
        assert covered >= 176, (g, m, covered)
