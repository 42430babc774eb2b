"""The report stage against the stores it reads: numbers, plots, HTML, Prefect keys, ``covgrad report``."""

import base64
import io
import json
import logging
import math
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from covgrad.config import PipelineConfig
from covgrad.report import Report
from covgrad.report.document import finite
from storage.artifacts import MARKER, ArtifactStore
from storage.runs import read_run_index, write_run_index
from tasks.report import artifact_key, publish, render_run
from tasks.specs import plan
from tests.helpers.pipeline import run_planned, tiny_config
from tests.helpers.zero_mean import reference as zero_mean_reference

PLOTS = (
    "fisher_vs_grad.png",
    "overlap.png",
    "tensor_shares.png",
    "zero_mean.png",
    "token_trace.png",
    "update_check.png",
    "rho.png",
    "update_steps.png",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_run):
    """One tiny pipeline run with every stage (policy and stale samplers), task bodies called directly;
    the stages it shares with the session's tiny run (all but tokens, update check and report) are copied."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("report") / "root"
    shutil.copytree(tiny_run[0], root)
    cfg = tiny_config(str(root))
    refs = {n: r.ref for n, r in run_planned(cfg).items()}
    store = ArtifactStore(cfg.root)
    write_run_index(store, cfg, plan(cfg).run_key, refs)
    return cfg, refs, store


def _read(store: ArtifactStore, ref, name: str) -> bytes:
    with store.fs.open(store.path(ref, name), "rb") as f:
        return f.read()


def _fmt(v: float) -> str:
    return format(v, ".4g")


def _topk_reference(values: np.ndarray, q: float) -> set[int]:
    """Top ceil(q·P) indices by value, ties to the lowest index (stable argsort of the negated values)."""
    k = math.ceil(q * values.size)
    return set(np.argsort(-values, kind="stable")[:k].tolist())


@pytest.mark.slow
def test_report_numbers_equal_the_stores(run):
    cfg, refs, store = run
    out = json.loads(_read(store, refs["report"], "report.json"))["numbers"]
    st = store.open_group(refs[out["main_stats"]], "stats.zarr", mode="r")
    s = st.attrs["scalars"]
    for k in ("N", "P", "std_A", "max_abs_rho", "bound_violations", "zero_mean_trace", "zero_mean_coord"):
        assert out[k] == s[k], k
    assert out["crossfit_frac_exceed_odd_F_even_G"] == s["crossfit_odd_F_even_G_frac_exceed"]
    summary = store.read_json(refs["masks"], "summary.json")
    assert out["spearman_F_absG"] == summary["spearman_F_absG"]
    assert out["overlap"] == store.read_json(refs["masks"], "overlap.json")

    # the zero-mean test as a float64 loop over each half's stored rows computes it (tests/helpers/zero_mean.py)
    scores = store.open_group(refs["scores." + out["main_stats"].split(".", 1)[1]], "scores.zarr", mode="r")
    want = zero_mean_reference(scores["scores"][:], scores["group"][:])
    for k in ("trace", "coord"):
        value, z, lo, hi = want[k]
        assert out[f"zero_mean_{k}"] == pytest.approx(value, rel=1e-9)
        assert out["intervals"][f"z_{k}"] == pytest.approx(z, rel=1e-6)
        np.testing.assert_allclose(out["intervals"][f"null_band_{k}"], (lo, hi), rtol=1e-6)

    headline = _read(store, refs["report"], "headline.md").decode()
    cells = dict(re.findall(r"^\| (\S+) \| ([^|]+?) \|", headline, flags=re.M))
    assert cells["N"] == str(s["N"]) and cells["std_A"] == _fmt(s["std_A"])
    assert cells["max_abs_rho"] == _fmt(s["max_abs_rho"])
    assert cells["spearman_F_absG"] == _fmt(summary["spearman_F_absG"])
    q1 = next(r for r in out["overlap"] if r["scope"] == "global" and r["q"] == 0.01)
    assert cells["overlap(q=0.01)"] == _fmt(q1["overlap"])

    # the off-policy table as the offpolicy stage stored it (its numbers: tests/stages/test_offpolicy.py)
    stored = json.loads(_read(store, refs["offpolicy"], "offpolicy.json"))
    assert out["off_policy"] == [{k: finite(v) for k, v in r.items()} for r in stored]
    rows = {(r["sampler"], r["centering"]): r for r in out["off_policy"]}
    assert set(rows) == {(i.sampler, i.centering) for i in plan(cfg).stats}
    assert rows[("stale", "sampler")]["rel_diff_G"] > 0 and rows[("policy", "policy")]["rel_diff_G"] is None
    for (sampler, centering), row in rows.items():
        g = store.open_group(refs[f"stats.{sampler}.{centering}"], "stats.zarr")
        assert row["zero_mean_trace"] == g.attrs["scalars"]["zero_mean_trace"]
        top_g, top_f = _topk_reference(np.abs(g["G"][:]), 0.01), _topk_reference(g["F"][:], 0.01)
        assert row["overlap_1pct"] == pytest.approx(len(top_g & top_f) / len(top_g), abs=1e-15)
        assert row["overlap_1pct"] == g.attrs["scalars"]["overlap_1pct"]  # read from the stats store

    tokens = store.open_group(refs["tokens"], "tokens.zarr").attrs["scalars"]
    assert out["tokens"]["spearman_trace_entropy"] == tokens["spearman_trace_entropy"]


@pytest.mark.slow
def test_token_fisher_numbers_appear_once(run):
    """The per-mode table holds the errors against F and the error table those at three N; the scalars
    table repeats neither, and the trace/entropy Spearman is one row, not also a sentence."""
    _, refs, store = run
    md = _read(store, refs["report"], "report.md").decode()
    section = md.split("## Token Fisher", 1)[1].split("\n## ", 1)[0]
    assert not re.findall(r"^\| (?:relerr|spearman)_\w+_vs_seq", section, flags=re.M), section
    assert len(re.findall(r"^\| spearman_trace_entropy \|", section, flags=re.M)) == 1
    assert "Spearman(per-position trace" not in section


@pytest.mark.slow
def test_plots_are_valid_pngs_embedded_in_the_html(run):
    _, refs, store = run
    html = _read(store, refs["report"], "report.html").decode()
    md = _read(store, refs["report"], "report.md").decode()
    for name in PLOTS:
        data = _read(store, refs["report"], name)
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)
        assert rgb.shape[0] > 200 and rgb.shape[1] > 200 and rgb.std() > 10, name
        colored = (rgb.max(axis=2) - rgb.min(axis=2)) > 40  # data marks; axes and text are gray
        assert colored.sum() > 100, name
        assert f"data:image/png;base64,{base64.b64encode(data).decode()}" in html, name
        assert f"]({name})" in md, name
    assert html.count("<img") == len(PLOTS) and 'src="http' not in html


@pytest.mark.slow
def test_cli_report_names_the_missing_stage_and_renders_the_rest(run, tmp_path, capsys):
    from flows.cli import main

    cfg, refs, _ = run
    root = tmp_path / "copy"
    shutil.copytree(cfg.root, root)
    (root / "masks" / refs["masks"].key / MARKER).unlink()
    (root / "offpolicy" / refs["offpolicy"].key / MARKER).unlink()
    assert main(["report", cfg.name, "--root", str(root)]) == 0
    captured = capsys.readouterr()
    for stage in ("masks", "offpolicy"):
        assert f"stage {stage} ({stage}/{refs[stage].key}) is missing" in captured.err
    out = root / "_reports" / cfg.name
    assert {p.name for p in out.iterdir()} >= {"report.md", "report.html", "headline.md", "fisher_vs_grad.png"}
    assert not (out / "overlap.png").exists() and not (out / "zero_mean.png").exists()
    text = (out / "report.md").read_text()
    assert "Overlap and tensor shares: skipped, masks is missing" in text
    assert "Off-policy table: skipped, offpolicy is missing" in text
    assert "| N | 32 |" in (out / "headline.md").read_text()


@pytest.mark.slow
def test_render_report_on_memory_root(run):
    """The same numbers from a ``memory://`` copy of the run (an fsspec root, no local paths)."""
    cfg, _, store = run
    mem = ArtifactStore("memory://h7-report")
    mem.fs.put(store.base, mem.base, recursive=True)
    index = read_run_index(mem, cfg.name)
    local = render_run(store, read_run_index(store, cfg.name))
    remote = render_run(mem, index)
    assert remote.numbers == local.numbers and not remote.missing
    assert remote.plots.keys() == local.plots.keys()
    mem.fs.rm(mem.base, recursive=True)


def test_artifact_keys_are_valid_and_publish_needs_a_run_context():
    for text in ("covgrad-report-Demo_Run.v2", "covgrad-headline-__x__", "A--B"):
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", artifact_key(text)), text
    publish(Report(title="t", headline=[{"quantity": "N", "value": 1}]), "Demo_Run")


def test_config_round_trip_in_run_index(tmp_path):
    """render_run validates the index's config; an index from write_run_index holds a valid one."""
    cfg = tiny_config(str(tmp_path))
    store = ArtifactStore(cfg.root)
    write_run_index(store, cfg, "k", {})
    index = read_run_index(store, "tiny")
    assert PipelineConfig.model_validate(index["config"]) == cfg
    report = render_run(store, index)
    assert report.missing == [] and "Statistics: skipped" in report.markdown()


@pytest.mark.slow
def test_publish_creates_prefect_artifacts_in_a_flow(prefect_server):
    from prefect import flow
    from prefect.client.orchestration import get_client

    report = Report(title="t", headline=[{"quantity": "N", "value": 32}, {"quantity": "std_A", "value": 0.5}])

    @flow(name="h7-publish")
    def publish_flow() -> None:
        publish(report, "Demo_Run.v2")

    publish_flow()
    with get_client(sync_client=True) as client:
        keys = {a.key: a for a in client.read_artifacts()}
    assert {"covgrad-report-demo-run-v2", "covgrad-headline-demo-run-v2"} <= set(keys)
    assert "std_A" in str(keys["covgrad-headline-demo-run-v2"].data)


def test_wide_tables_wrap_with_no_inner_scroll_box():
    from covgrad.report.document import STYLE

    row = {f"column_{i}": float(i) for i in range(30)}
    html = Report(title="t", blocks=[("table", [row])]).html()
    assert (
        '<div class="table"><table>' in html
        and not re.search(r"overflow(-[xy])?:", STYLE)
        and "white-space:normal" in STYLE
    )


def test_progress_logs_a_line_every_interval(caplog, capsys, monkeypatch):
    """Log lines and, with stderr not a terminal (pytest captures it), the same lines on stderr: items
    done, rate and ETA."""
    from tasks.common import progress_bar

    monkeypatch.setenv("COVGRAD_PROGRESS_SECONDS", "0")
    with caplog.at_level(logging.INFO, logger="covgrad"), progress_bar("scores x/y", 3) as bar:
        bar.update(1)
        bar.update(1)
        bar.update(1)  # the last unit: the stage's own computed line follows, no progress line
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("scores x/y:")]
    assert [line.split(",")[0] for line in lines] == ["scores x/y: 1/3 batch (33%)", "scores x/y: 2/3 batch (67%)"]
    assert all(re.search(r", \S+ batch/s, ETA \S+ s, \d+ s so far$", line) for line in lines), lines
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("covgrad progress: scores")]
    assert err == [f"covgrad progress: {line}" for line in lines]


@pytest.mark.parametrize("block", [1, 7, 1000, 1 << 22])
def test_log_histogram_in_blocks_equals_numpy_on_the_whole_arrays(block):
    from covgrad.report.plots import log_histogram

    rng = np.random.default_rng(block)
    P = 2_503
    F = rng.lognormal(-10, 3, P)
    G = rng.normal(0, 1e-4, P)
    F[rng.random(P) < 0.1] = 0.0
    G[rng.random(P) < 0.1] = 0.0
    F[:5] = np.nan
    h = log_histogram([F, G], bins=17, block=block)
    keep = (F > 0) & (np.abs(G) > 0)
    x, y = np.log10(F[keep]), np.log10(np.abs(G[keep]))
    edges = [np.linspace(x.min(), x.max(), 18), np.linspace(y.min(), y.max(), 18)]
    expected = np.histogramdd(np.stack([x, y], 1), bins=edges)[0]
    assert h.n == keep.sum() == expected.sum() and h.P == P
    np.testing.assert_array_equal(h.counts, expected)
    for got, want in zip(h.edges, edges, strict=True):
        np.testing.assert_allclose(np.log10(got), want, rtol=0, atol=1e-12)
    assert log_histogram([F, np.zeros(P)], block=block) is None
