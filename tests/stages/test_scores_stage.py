"""The scores stage end to end: stored per-sample scores against a naive autograd loop, and the three
ways of obtaining μ for sampler centering (stored full, stored top-k with k = V, recomputed from the
sampler model) against each other."""

import shutil

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from storage.artifacts import ArtifactStore
from tasks.specs import plan
from tests.helpers.pipeline import run_planned, tiny_config

STALE = {"model": "stale", "group_size": 4, "max_new_tokens": 3, "batch_size": 16}
OVERRIDES = {
    "rollouts.samplers": {
        "policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 16},
        "full": {**STALE, "store_mu": "full"},
        "topk": {**STALE, "store_mu": "topk", "mu_topk": 16},
        "model": {**STALE, "store_mu": "none"},
    },
    "tokens.enabled": False,
    "update_check.enabled": False,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_run):
    """Base model, rollouts and scores of four samplers; the session's tiny run is copied in first, so its
    trained model and its policy sampler's artifacts (the same keys) are reused, not recomputed."""
    root = tmp_path_factory.mktemp("scores-stage") / "root"
    shutil.copytree(tiny_run[0], root)
    cfg = tiny_config(str(root), **OVERRIDES)
    steps = plan(cfg)
    wanted = {n for n, s in steps.items() if s.ref.stage in ("base_model", "rollouts", "scores")}
    refs = {n: r.ref for n, r in run_planned(cfg, wanted).items()}
    return cfg, ArtifactStore(cfg.root), refs


def _scores(store, ref):
    return store.open_group(ref, "scores.zarr", mode="r")["scores"][:]


def test_same_rollouts_for_all_stale_samplers(run):
    _, store, refs = run
    tok = [store.open_group(refs[f"rollouts.{s}"], "rollouts.zarr")["tokens"][:] for s in ("full", "topk", "model")]
    assert np.array_equal(tok[0], tok[1]) and np.array_equal(tok[0], tok[2])


def test_sampler_centering_sources_agree(run):
    _, store, refs = run
    full = _scores(store, refs["scores.full.sampler"])
    topk = _scores(store, refs["scores.topk.sampler"])
    model = _scores(store, refs["scores.model.sampler"])
    scale = np.linalg.norm(full)
    assert np.linalg.norm(topk - full) / scale < 1e-5
    assert np.linalg.norm(model - full) / scale < 1e-5
    policy_centered = _scores(store, refs["scores.full.policy"])
    assert np.linalg.norm(policy_centered - full) / scale > 1e-3  # off-policy: the centerings differ


def test_stage_scores_match_naive_loop(run):
    cfg, store, refs = run
    from storage.models import load_models
    from tasks.specs import policy_spec

    model, _ = load_models(store, refs["base_model"], "policy", policy_spec(cfg))
    model.eval()
    layout = select_parameters(model, cfg.model.params)
    ro = store.open_group(refs["rollouts.policy"], "rollouts.zarr")
    stored = _scores(store, refs["scores.policy.policy"])
    params = dict(model.named_parameters())
    for n in (0, 5, 17):
        pl, rl = int(ro["prompt_len"][n]), int(ro["response_len"][n])
        ids = torch.from_numpy(ro["tokens"][n, : pl + rl]).long()[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        target = ids[0, 1:]
        total = logp[pl - 1 : pl + rl - 1].gather(-1, target[pl - 1 : pl + rl - 1, None]).sum()
        grads = torch.autograd.grad(total, [params[e.name] for e in layout.entries])
        ref = torch.cat([g.reshape(-1) for g in grads]).float().numpy()
        assert np.linalg.norm(stored[n] - ref) / np.linalg.norm(ref) < 1e-5


def test_moment_state_matches_per_sample_rows(run):
    """The state rows (one per parity half, folded on the device) equal two-pass float64 moments of the
    stored per-sample rows within 1e-9."""
    _, store, refs = run
    g = store.open_group(refs["scores.policy.policy"], "scores.zarr")
    S = g["scores"][:].astype(np.float64)
    A = g["advantage"][:]
    half = g["group"][:] % 2
    assert g["count"].shape == (2,) and g["mean_s"].shape == (2, S.shape[1]) and g["shard_batches"][:].tolist() == [[4]]
    assert g.attrs["per_sample_rows"] and g.attrs["state_dtype"] == "float64"
    assert list(g["ckpt/shard0/block0"].group_keys()) == []  # checkpoints are dropped once the final rows are written
    for h in (0, 1):
        s, a = S[half == h], A[half == h]
        ds, da = s - s.mean(0), a - a.mean()
        assert g["count"][h] == len(a)
        np.testing.assert_allclose([g["mean_a"][h], g["m2_a"][h]], [a.mean(), da @ da], rtol=1e-12)
        for name, want in (("mean_s", s.mean(0)), ("m2_s", (ds * ds).sum(0)), ("c_as", da @ ds)):
            err = np.abs(g[name][h] - want).max() / np.abs(want).max()
            assert err < 1e-9, (name, h, err)


def test_kl_recorded_and_equal_across_mu_sources(run):
    _, store, refs = run
    kls = [
        store.open_group(refs[f"scores.{s}.sampler"], "scores.zarr").attrs["kl_sampler_policy_per_token"]
        for s in ("full", "topk", "model")
    ]
    assert kls[0] > 0
    np.testing.assert_allclose(kls, kls[0], rtol=1e-5)


def test_kl_sampler_policy_against_numpy():
    from covgrad.scores.centering import kl_sampler_policy

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 7, generator=gen)
    mu = torch.softmax(torch.randn(2, 5, 7, generator=gen), -1)
    mu[0, 1, :3] = 0.0  # truncated sampler: zero-mass tokens contribute nothing
    mu[0, 1] /= mu[0, 1].sum()
    target = torch.zeros(2, 5)
    target[0, 2:4] = 1
    target[1, 1:5] = 1
    total, count = kl_sampler_policy(mu, logits, target)
    ref = 0.0
    for b, t in zip(*np.nonzero(target[:, 1:].numpy()), strict=True):
        m = mu[b, t].double().numpy()
        logp = torch.log_softmax(logits[b, t].double(), -1).numpy()
        ref += sum(mi * (np.log(mi) - lp) for mi, lp in zip(m, logp, strict=True) if mi > 0)
    assert count == 6
    np.testing.assert_allclose(total, ref, rtol=1e-12)


def test_row_writer_writes_every_batch_in_the_background_and_reports_failures(tmp_path):
    import zarr

    from storage.stores.scores import RowWriter

    arr = zarr.open_group(str(tmp_path / "g.zarr"), mode="w").create_array(
        "scores", shape=(10, 7), chunks=(4, 7), dtype="float32"
    )
    rows = torch.randn(10, 7)
    writer = RowWriter(arr, 4, 7, torch.device("cpu"), depth=2)
    buffer = torch.empty(4, 7)  # reused between batches, as in the stage
    for lo in (0, 4, 8):
        hi = min(lo + 4, 10)
        buffer[: hi - lo] = rows[lo:hi]
        writer.submit(lo, hi, buffer[: hi - lo])
    writer.close()
    assert np.array_equal(arr[:], rows.numpy())

    read_only = zarr.open_group(str(tmp_path / "g.zarr"), mode="r")["scores"]
    broken = RowWriter(read_only, 4, 7, torch.device("cpu"))
    broken.submit(0, 4, torch.zeros(4, 7))
    with pytest.raises(RuntimeError, match="writing per-sample rows failed"):
        broken.close()
    assert not broken.thread.is_alive()


@pytest.mark.slow
def test_stats_from_moment_state_equal_stats_from_rows(run):
    """Without per-sample rows the stats stage reads the O(P) state (float64 or float32) and gets the
    statistics of the rows path: to 1e-9 (float64 state) and 1e-5 (float32 state)."""
    cfg, _, _ = run
    with_rows = _stats(cfg, "rows")
    for state_dtype, rtol in (("float64", 1e-9), ("float32", 1e-5)):
        over = {**OVERRIDES, "scores.byte_budget": 0, "scores.state_dtype": state_dtype}
        other = tiny_config(cfg.root, **over)
        got = _stats(other, "state")
        assert "scores" not in ArtifactStore(other.root).open_group(_ref(other, "scores"), "scores.zarr")
        for name in ("m", "F", "Fvar", "G", "Cov"):
            scale = np.abs(with_rows[name]).max()
            assert np.abs(got[name] - with_rows[name]).max() <= rtol * scale, (state_dtype, name)
        finite = np.isfinite(with_rows["rho"])
        assert np.array_equal(finite, np.isfinite(got["rho"]))
        np.testing.assert_allclose(got["rho"][finite], with_rows["rho"][finite], rtol=100 * rtol, atol=rtol)


def _ref(cfg, stage: str):
    return plan(cfg)[f"{stage}.policy.policy"].ref


def _stats(cfg, source: str) -> dict:
    """Run scores.policy.policy and stats.policy.policy of ``cfg``; the stats arrays (numpy)."""
    names = {"base_model", "rollouts.policy", "scores.policy.policy", "stats.policy.policy"}
    refs = {n: r.ref for n, r in run_planned(cfg, names).items()}
    g = ArtifactStore(cfg.root).open_group(refs["stats.policy.policy"], "stats.zarr")
    assert g.attrs["source"] == ("per-sample rows" if source == "rows" else "moment rows")
    return {k: g[k][:] for k in ("m", "F", "Fvar", "G", "Cov", "rho")}
