"""Damaged artifacts are never served: a deleted, truncated or corrupted chunk of a complete store is
noticed on the next run (one warning line), that artifact and everything below it are recomputed
byte-identically, reads of a damaged chunk fail in one line, and ``covgrad verify`` names the damage.

Stages run through their task functions (``.fn``), without a Prefect server. One tiny pipeline is
computed once per module; each test works on a copy of it.
"""

import logging
import shutil
from pathlib import Path

import pytest

from tests.helpers.faults import OVERRIDES, digests, run_chain
from tests.helpers.pipeline import below, tiny_config


@pytest.fixture(scope="module")
def reference(tiny_run):
    """(root, node map, headline text) of one uninterrupted tiny pipeline (the session's ``tiny_run``)."""
    root, nodes = tiny_run
    return root, nodes, headline(root, nodes)


def headline(root: Path, nodes) -> str:
    ref = nodes["report"].ref
    return (root / ref.stage / ref.key / "headline.md").read_text()


def copy(reference, dest: Path):
    root, _, _ = reference
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(".locks"))
    return tiny_config(str(dest), **OVERRIDES)


def chunk_file(root: Path, nodes, instance: str, array: str) -> Path:
    ref = nodes[instance].ref
    store = f"{ref.stage}.zarr"
    chunks = sorted(p for p in (root / ref.stage / ref.key / store / array / "c").rglob("*") if p.is_file())
    assert chunks, f"{instance} {array} has no chunk files"
    return chunks[len(chunks) // 2]


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :])


@pytest.mark.slow  # 9 cases, each recomputing a chain of stages
@pytest.mark.parametrize(
    ("instance", "array", "how"),
    [
        ("rollouts.policy", "reward", "delete"),
        ("rollouts.stale", "tokens", "truncate"),
        ("rollouts.policy", "advantage", "flip"),
        ("scores.policy.policy", "mean_s", "delete"),
        ("scores.policy.policy", "mean_s", "truncate"),
        ("scores.stale.sampler", "m2_s", "flip"),
        ("stats.policy.policy", "F", "flip"),
        ("stats.policy.policy", "G", "delete"),
        ("stats.stale.sampler", "rho", "truncate"),
    ],
)
def test_damaged_chunk_recomputes_artifact_and_below(reference, tmp_path, caplog, instance, array, how):
    ref_root, nodes, want_headline = reference
    root = tmp_path / "root"
    cfg = copy(reference, root)
    from storage.artifacts import ArtifactStore
    from tasks.common import cache_options

    target = chunk_file(root, nodes, instance, array)
    store = ArtifactStore(cfg.root)
    assert cache_options(store, nodes[instance].ref)["refresh_cache"] is False
    damage(target, how)
    assert cache_options(store, nodes[instance].ref)["refresh_cache"] is True  # Prefect's cache is bypassed too
    with caplog.at_level(logging.WARNING, logger="covgrad"):
        status = run_chain(cfg)
    assert {n for n, s in status.items() if s == "computed"} == below(cfg, instance)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    ref = nodes[instance].ref
    assert f"{ref.stage} {ref.key}: damaged" in warnings[0]
    assert str(target.relative_to(root / ref.stage / ref.key)) in warnings[0]
    assert headline(root, nodes) == want_headline
    for name in below(cfg, instance):
        r = nodes[name].ref
        assert digests(root / r.stage / r.key) == digests(ref_root / r.stage / r.key), name
    assert set(run_chain(cfg).values()) == {"cached"}


@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_reading_a_damaged_chunk_raises_one_line(reference, tmp_path, how):
    from storage.artifacts import ArtifactStore
    from storage.integrity import DamagedArtifactError

    _, nodes, _ = reference
    root = tmp_path / "root"
    cfg = copy(reference, root)
    ref = nodes["scores.policy.policy"].ref
    target = chunk_file(root, nodes, "scores.policy.policy", "mean_s")
    damage(target, how)
    g = ArtifactStore(cfg.root).open_group(ref, "scores.zarr", mode="r")
    with pytest.raises(DamagedArtifactError) as err:
        g["mean_s"][:]
    message = str(err.value)
    assert "\n" not in message
    chunk = "/".join(target.relative_to(target.parents[2]).parts)
    assert f"damaged artifact scores/{ref.key}: store 'scores.zarr' array 'mean_s' chunk {chunk}" in message


def test_every_chunk_exists_and_missing_one_is_not_read_as_fill(reference):
    """zarr skips chunks equal to the fill value; complete stores have every chunk on disk."""
    import zarr

    root, nodes, _ = reference
    ref = nodes["scores.policy.policy"].ref
    g = zarr.open_group(str(root / ref.stage / ref.key / "scores.zarr"), mode="r")
    for name, arr in g.arrays():
        assert arr.nchunks_initialized == arr.nchunks, name


def test_verify_names_each_damaged_artifact_and_chunk(reference, tmp_path, capsys):
    from flows.cli import main

    _, nodes, _ = reference
    root = tmp_path / "root"
    cfg = copy(reference, root)
    capsys.readouterr()
    assert main(["verify", "--all", "--root", cfg.root]) == 0
    out = capsys.readouterr().out
    assert out.endswith(": 0 damaged\n") and "damaged " not in out.splitlines()[0], out
    assert main(["verify", "tiny", "--root", cfg.root]) == 0
    capsys.readouterr()

    flipped = chunk_file(root, nodes, "stats.policy.policy", "F")
    damage(flipped, "flip")
    deleted = chunk_file(root, nodes, "rollouts.stale", "tokens")
    damage(deleted, "delete")
    assert main(["verify", "--all", "--root", cfg.root]) == 1
    out = capsys.readouterr().out
    for path, why in ((flipped, "corrupted"), (deleted, "missing")):
        art = path.relative_to(root).parts
        assert f"damaged {art[0]}/{art[1]}: {'/'.join(art[2:])}: {why}" in out, out
    assert main(["verify", "tiny", "--root", cfg.root]) == 1
    capsys.readouterr()


def test_ls_gc_verify_default_to_covgrad_root_and_gc_without_tty_removes_nothing(
    reference, tmp_path, capsys, monkeypatch
):
    from flows.cli import main

    _, nodes, _ = reference
    root = tmp_path / "root"
    copy(reference, root)
    damage(chunk_file(root, nodes, "stats.policy.policy", "F"), "truncate")
    monkeypatch.setenv("COVGRAD_ROOT", str(root))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["ls"]) == 0
    states = {line.split()[1]: line.split()[2] for line in capsys.readouterr().out.splitlines()[1:]}
    assert states[nodes["stats.policy.policy"].ref.key] == "damaged"
    assert main(["verify", "--all"]) == 1
    assert main(["gc"]) == 0
    out = capsys.readouterr().out
    assert "(damaged" in out and "nothing removed: not a terminal" in out
    assert (root / "stats" / nodes["stats.policy.policy"].ref.key).exists()
    assert not (tmp_path / "runs").exists()


def zero_reward(prompt: str, response: str, answer: str) -> float:
    """A reward that never varies (every response scores 0): std(A) = 0."""
    del prompt, response, answer
    return 0.0


@pytest.mark.slow
def test_all_rewards_equal_is_a_finding_without_overlap_numbers(reference, tmp_path, caplog, capsys):
    import warnings

    from flows.cli import main

    root = tmp_path / "root"
    copy(reference, root)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n' for a, b in [(1, 2), (3, 4)]))
    task = {
        "kind": "jsonl",
        "digits": 1,
        "n_prompts": 2,
        "path": str(prompts),
        "reward": f"{__name__}:zero_reward",
        "trust_reward_code": True,
    }
    cfg = tiny_config(str(root), **OVERRIDES, name="flat", task=task)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="covgrad"):
        warnings.simplefilter("error", RuntimeWarning)
        run_chain(cfg)
    logged = [r.getMessage() for r in caplog.records if "no reward variance" in r.getMessage()]
    assert logged and all(m.startswith(("stats ", "masks ")) for m in logged), logged
    capsys.readouterr()
    assert main(["report", "flat", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "no reward variance: G ≡ 0; overlap, ρ and the bound are undefined" in out
    assert not [line for line in out.splitlines() if line.startswith(("| overlap(", "| max_abs_rho", "| spearman"))]
    for line in out.splitlines():
        if line.startswith("| policy") or line.startswith("| stale"):
            assert line.rstrip(" |").endswith("nan"), line  # overlap_1pct is the last column
    full = (root / "_reports" / "flat" / "report.md").read_text()
    assert "Finding: no reward variance: G ≡ 0; overlap, ρ and the bound are undefined." in full
    assert "| overlap(" not in full and "Overlap of the top sets" not in full and "overlap.png" not in full


def test_degenerate_conditions():
    from covgrad.moments.stats import crossfit_gap, degenerate

    assert degenerate(8, True, 0.5) is None
    assert degenerate(8, True, 0.0).startswith("no reward variance: G ≡ 0")
    assert degenerate(8, False, 0.5).startswith("no scored tokens")
    assert degenerate(1, True, float("nan")).startswith("too few samples: N = 1, the statistics need N ≥ 2")
    assert crossfit_gap(4, 4) is None
    assert crossfit_gap(4, 0).startswith("cross-fit undefined: the odd prompt groups hold N = 0 samples")


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    from tests.helpers.user import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("user-model") / "ckpt")


@pytest.mark.slow
def test_one_sample_is_a_finding_that_every_stage_records(user_model, tmp_path, caplog, capsys):
    """N = 1 (one imported record): stats record "too few samples" with NaN arrays, masks hold none,
    the update check takes no steps, tokens still runs (it is per sample), report and watch say it in
    words with no overlap numbers; every artifact is complete."""
    import json
    import warnings

    import numpy as np
    import zarr

    from flows.cli import main
    from flows.watch import finding
    from storage.artifacts import ArtifactStore
    from storage.stores.masks import load_masks
    from tasks.specs import plan
    from tests.helpers.user import user_config

    record = {"prompt_ids": [1, 5], "response_ids": [6, 2], "reward": 1.0, "logprobs": [-1.0, -0.5]}
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(record) + "\n")
    cfg = user_config(
        tmp_path / "root",
        user_model,
        tmp_path / "task.jsonl",
        name="one",
        **{
            "rollouts.samplers": {"engine": {"import_path": str(one), "on_policy": True}},
            "rollouts.analyse": "engine",
            "tokens.enabled": True,
            "update_check.enabled": True,
        },
    )
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="covgrad"):
        warnings.simplefilter("error", RuntimeWarning)
        assert set(run_chain(cfg).values()) == {"computed"}
    said = "too few samples: N = 1, the statistics need N ≥ 2; F, G, overlap, ρ and the bound are undefined"
    logged = [r.getMessage() for r in caplog.records]
    for stage in ("stats", "masks", "update_check"):
        assert any(m.startswith(f"{stage} ") and m.endswith(said) for m in logged), (stage, logged)
    store, nodes = ArtifactStore(cfg.root), plan(cfg)
    assert all(store.is_complete(n.ref) for n in nodes.values())
    st = store.open_group(nodes["stats.engine.policy"].ref, "stats.zarr")
    assert st.attrs["degenerate"] == said and st.attrs["scalars"]["N"] == 1
    assert all(np.isnan(st[name][:]).all() for name in ("F", "G", "rho", "crossfit_ratio"))
    masks_dir = store.path(nodes["masks"].ref)
    assert set(zarr.open_group(f"{masks_dir}/masks.zarr", mode="r").array_keys()) == {"q"}
    with pytest.raises(ValueError, match=f"holds no masks: {said}"):
        load_masks(masks_dir, 0.01)
    assert store.read_json(nodes["update_check"].ref, "summary.json")["degenerate"] == said
    assert store.open_group(nodes["tokens"].ref, "tokens.zarr").attrs["scalars"]["N"] == 1
    assert finding(cfg) == said  # what the watch flow records for a checkpoint
    (row,) = json.loads((Path(store.path(nodes["offpolicy"].ref)) / "offpolicy.json").read_text())
    assert row["finding"] == said and np.isnan(row["zero_mean_trace"]) and np.isnan(row["rel_diff_G"])
    capsys.readouterr()
    assert main(["report", "one", "--root", cfg.root]) == 0
    out = capsys.readouterr().out
    assert f"| finding | {said} |" in out
    assert not [line for line in out.splitlines() if line.startswith(("| overlap(", "| max_abs_rho", "| spearman"))]
    full = (tmp_path / "root" / "_reports" / "one" / "report.md").read_text()
    assert f"No optimizer steps: {said}." in full and "| overlap(" not in full


@pytest.mark.slow
def test_one_prompt_group_leaves_only_the_crossfit_undefined(user_model, tmp_path, caplog):
    """A single prompt group: the odd half is empty, so the cross-fit ratios are NaN with the reason in
    words; every other statistic, the masks and the overlap are computed as usual."""
    import numpy as np

    from storage.artifacts import ArtifactStore
    from tasks.specs import plan
    from tests.helpers.user import user_config

    cfg = user_config(tmp_path / "root", user_model, tmp_path / "task.jsonl", **{"task.n_prompts": 1})
    with caplog.at_level(logging.WARNING, logger="covgrad"):
        run_chain(cfg)
    said = "cross-fit undefined: the odd prompt groups hold N = 0 samples, each half needs N ≥ 2"
    assert any(r.getMessage().startswith("stats ") and said in r.getMessage() for r in caplog.records)
    store, nodes = ArtifactStore(cfg.root), plan(cfg)
    st = store.open_group(nodes["stats.policy.policy"].ref, "stats.zarr")
    assert st.attrs["degenerate"] is None and st.attrs["crossfit_undefined"].startswith(said)
    assert np.isnan(st["crossfit_ratio"][:]).all() and np.isfinite(st["G"][:]).all()
    assert np.isnan(st.attrs["scalars"]["crossfit_even_F_odd_G_frac_exceed"])
    text = headline(tmp_path / "root", nodes)  # the report stage's render_run(...).headline_markdown()
    assert "| overlap(q=0.01) |" in text
    rows = [line for line in text.splitlines() if line.startswith("| crossfit_frac_exceed")]
    assert len(rows) == 2 and all("| nan | " + said in row for row in rows), rows


@pytest.mark.slow
def test_sigkills_at_random_moments_then_rerun_is_byte_identical(reference, tmp_path):
    """SIGKILL a run of rollouts → scores → stats → masks → report at seeded random moments, resume
    after each kill, then finish: every artifact's data equals the uninterrupted run's (5 kills, each at a
    fresh moment of a resumed run; the seed is printed, so a failure can be replayed)."""
    import random
    import time

    from tests.helpers import forked

    ref_root, nodes, want_headline = reference
    root = tmp_path / "root"
    cfg = copy(reference, root)
    base = nodes["base_model"].ref
    for name, node in nodes.items():  # keep only the trained model: everything else is recomputed
        if name != "base_model":
            shutil.rmtree(root / node.ref.stage / node.ref.key)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    claims = []
    for _ in range(5):
        started, deadline = time.time(), time.monotonic() + 120
        child = forked.start(forked.chain, str(root))  # a child process

        def claimed(since: float = started) -> list[str]:  # stages begun since (a resume rewrites the claim)
            return [p.parent.parent.name for p in root.glob("*/*/_STARTED.json") if p.stat().st_mtime >= since]

        while not claimed() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 2.0))
        claims += claimed()
        with child:
            child.kill()
    run_chain(cfg)
    assert headline(root, nodes) == want_headline, f"seed {seed}"
    for name, node in nodes.items():
        r = node.ref
        assert digests(root / r.stage / r.key) == digests(ref_root / r.stage / r.key), f"seed {seed}: {name}"
    assert (root / base.stage / base.key / "_COMPLETE.json").exists()
    assert claims, f"seed {seed}: no kill landed inside a stage"
    print(f"seed {seed}: kills while writing {sorted(set(claims))}")


def test_describe_key_names_array_and_chunk():
    from storage.integrity import describe_key

    assert describe_key("s.zarr", "c_as/c/0/1") == "store 's.zarr' array 'c_as' chunk c/0/1"
    assert describe_key("s.zarr", "g/arr/c") == "store 's.zarr' array 'g/arr' chunk c"
    assert describe_key("s.zarr", "F/zarr.json") == "store 's.zarr' metadata of 'F' (F/zarr.json)"
