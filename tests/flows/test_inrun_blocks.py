"""The in-run statistics read off the state a column block at a time (covgrad.integrations.blocks): for blocks of 1,
7 and a prime number of columns, a step's files and :class:`InRunStep` are the one-block result's bytes (which is
:func:`statistics` and :func:`topk_indices` of the whole arrays, planted ties and NaN included), for the score fold,
the regime fold and the ranks' (2 gloo ranks); the streamed npz holds ``np.savez``'s members; the streaming top-k is
an argsort; the kept vectors and the temporary files behave as documented; ``InRunHook`` and ``CovgradInRun``
pass ``keep`` and ``block`` through."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import covgrad.moments.topk as topk_module
from covgrad.distributed.fsdp import RankColumns
from covgrad.integrations.blocks import SCALARS, StepVectors, column_blocks
from covgrad.integrations.inrun import METRICS, InRunFolder, InRunRegimeFolder, InRunStep, statistics
from covgrad.integrations.ranks import local_runs
from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.moments.topk import StreamingTopK, count_for_fraction, topk_indices
from covgrad.regimes.cotangents import Regime
from tests.helpers.inrun_files import assert_same_files, same_bytes
from tests.helpers.persample import llama, make_batch

# 2624 columns: the untied embedding (rows of tokens the batch lacks: F = 0, ρ NaN), a layer's down projection
# and two norms
SUBSET = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight", "*.0.*layernorm*"]
BLOCKS = (1, 7, 101)  # 101: a prime


def _batch() -> tuple[dict, np.ndarray, np.ndarray]:
    """A left-padded batch of 6 rows, its advantages (6,) and prompt groups (6,)."""
    batch = make_batch(5, [3, 5, 2, 4, 3, 2], [4, 3, 6, 2, 5, 3])
    return batch, np.random.default_rng(5).standard_normal(6), np.arange(6) // 2


def _assert_same_step(got: InRunStep, want: InRunStep, got_out: Path, want_out: Path) -> None:
    """Two folds of one state: the same files (member by member, bytes) and the same InRunStep."""
    assert got.step == want.step
    assert_same_files(got_out, want_out, want.step)
    assert got.stats.keys() == want.stats.keys() and got.summary.keys() == want.summary.keys()
    for k, v in want.stats.items():
        if np.ndim(v) == 0:
            assert type(got.stats[k]) is type(v) and (got.stats[k] == v or (np.isnan(v) and np.isnan(got.stats[k])))
        else:
            assert same_bytes(got.stats[k], v), k
    assert got.top.keys() == want.top.keys() and all(same_bytes(got.top[m], want.top[m]) for m in want.top)


# ---------------------------------------------------------------------------------------------- the streaming top-k


def _reference(v: np.ndarray, k: int) -> np.ndarray:
    """The first k of the non-NaN indices ordered by value descending, then index (−0 = +0), sorted: an argsort."""
    idx = np.flatnonzero(~np.isnan(v))
    order = np.lexsort((idx, -(v[idx].astype(np.float64) + 0.0)))
    return np.sort(idx[order][:k]).astype(np.int64)


@pytest.mark.parametrize("merge_at", [1, 1 << 16])
def test_the_streaming_topk_is_an_argsort(monkeypatch: pytest.MonkeyPatch, merge_at: int):
    """Random values with heavy ties, NaN, ±0 and ±inf, pushed in parts of random sizes, in index order or in
    shuffled parts of shuffled indices: the set is the argsort's and ``topk_indices``', its values the values."""
    monkeypatch.setattr(topk_module, "_MERGE_AT", merge_at)  # 1: every push merges, the filter runs
    gen = np.random.default_rng(0)
    pool = np.array([0.0, -0.0, 1.0, 2.0, 0.5, np.nan, np.inf, -np.inf, -1.0])
    for trial in range(400):
        P = int(gen.integers(1, 600))
        v = gen.choice(pool, P) if trial % 3 else np.round(gen.standard_normal(P), int(gen.integers(0, 3)))
        if trial % 7 == 0:
            v = v.astype(np.float32)
        k = int(gen.choice([0, 1, P, int(gen.integers(0, P + 1))]))
        stream = StreamingTopK(k)
        b = int(gen.integers(1, P + 1))
        parts = [np.arange(lo, min(P, lo + b)) for lo in range(0, P, b)]
        if trial % 2:
            gen.shuffle(parts)
            parts = [gen.permutation(p) for p in parts]
        for p in parts:
            stream.push(v[p], p)
        index, values = stream.result()
        want = _reference(v, k)
        assert index.dtype == np.int64 and np.array_equal(index, want), trial
        assert np.array_equal(index, topk_indices(v, k)), trial
        assert same_bytes(values, v[want].astype(np.float64)), trial
    with pytest.raises(ValueError, match="k must be"):
        StreamingTopK(-1)
    with pytest.raises(ValueError, match=r"\(b,\)"):
        StreamingTopK(1).push(np.zeros(3), np.arange(2))


# ------------------------------------------------------------------------------------------ planted moment state


def _planted(P: int, halves: str) -> MomentAccumulator:
    """Float64 moment state whose columns take few distinct values (F, |G|, |ρ| tied across many columns, Fvar = 0
    and so ρ NaN on some, Cauchy–Schwarz violated on others): both halves, one empty half, or std(A) = 0."""
    gen = np.random.default_rng(P)
    count = {"both": [3.0, 4.0], "one": [5.0, 0.0], "flat": [3.0, 4.0]}[halves]
    mean_a = [0.7, 0.7] if halves == "flat" else [0.2, -0.1]
    m2_a = [0.0, 0.0] if halves == "flat" else [1.5, 2.0]
    acc = MomentAccumulator(P, "cpu", halves=2)
    rows = {
        "count": np.array(count),
        "mean_a": np.array(mean_a),
        "m2_a": np.array(m2_a),
        "mean_s": gen.choice([0.0, 0.5, -0.5], (2, P)),
        "m2_s": gen.choice([0.0, 0.0, 1.0, 2.0], (2, P)),
        "c_as": gen.choice([0.0, -0.0, 0.3, -0.3, 5.0], (2, P)),
    }
    acc.load(rows)
    return acc


@pytest.mark.parametrize("halves", ["both", "one", "flat"])
def test_blocks_of_planted_state_give_the_whole_arrays_statistics(tmp_path: Path, halves: str):
    """The folder's statistics and sets of a planted state: with one block, :func:`statistics` of the whole rows
    and :func:`topk_indices` of the whole |values| (ties straddling the cuts, NaN); with 1, 7 and 101 columns a
    block, the same bytes."""
    batch, A, group = _batch()
    runs: dict[int, tuple[InRunStep, Path]] = {}
    acc: MomentAccumulator | None = None
    for block in (10**9, *BLOCKS):
        out = tmp_path / f"block-{block}"
        folder = InRunFolder(llama(tied=False), SUBSET, out_dir=out, q=0.3, vectors=("F", "G", "rho", "m"), block=block)
        if acc is None:
            acc = _planted(folder.layout.P, halves)
        folder._fold = lambda *args, state=acc: state  # the planted state instead of an engine pass
        got = folder.fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A, group=group)
        assert got is not None
        runs[block] = got, out
    one, one_out = runs[10**9]
    ref = statistics(acc.rows())
    k = count_for_fraction(0.3, acc.P)
    for name in ("m", "F", "Fvar", "G", "Cov", "rho"):
        assert same_bytes(one.stats[name], ref[name]), name
    for name in SCALARS:
        assert one.stats[name] == ref[name] or (np.isnan(ref[name]) and np.isnan(one.stats[name])), name
    for metric, src in METRICS.items():
        values = np.abs(ref[src])
        assert same_bytes(one.top[metric], topk_indices(values, k)), metric
        if halves != "flat" or metric != "absrho":  # the cut cuts through ties: equal values on both sides
            cut = values[one.top[metric]].min()
            assert 0 < np.count_nonzero(values[one.top[metric]] == cut) < np.count_nonzero(values == cut), metric
    assert np.isnan(ref["rho"]).any() and ref["bound_violations"] > 0
    assert bool(ref["rho_undefined"]) == (halves == "flat") and (len(one.top["absrho"]) == 0) == (halves == "flat")
    for block in BLOCKS:
        got, out = runs[block]
        _assert_same_step(got, one, out, one_out)


# ----------------------------------------------------------------------------------------------- real folds


def test_blocked_folds_are_the_one_block_folds_bytes(tmp_path: Path):
    """A real batch folded by the engine, twice (the overlaps with the first step), the score folder's files and
    InRunStep with 1, 7 and 101 columns a block are those of one block."""
    batch, A, group = _batch()
    runs: dict[int, tuple[list[InRunStep], Path]] = {}
    for block in (10**9, *BLOCKS):
        out = tmp_path / f"block-{block}"
        folder = InRunFolder(llama(tied=False), SUBSET, out_dir=out, q=0.5, block=block)
        steps = []
        for step in (0, 1):
            got = folder.fold(step, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A, group=group)
            assert got is not None
            steps.append(got)
            with torch.no_grad():
                folder.model.model.norm.weight.mul_(1.5)  # the next step's weights
        runs[block] = steps, out
    (first, second), one_out = runs[10**9]
    F = np.asarray(first.stats["F"])
    assert (F == 0).sum() > 0 and np.isnan(first.stats["rho"]).any()  # unseen tokens' rows: F = 0, ρ NaN
    assert 0 < second.summary["overlap_first"]["absG"] < 1
    for block in BLOCKS:
        steps, out = runs[block]
        for got, want in zip(steps, (first, second), strict=True):
            _assert_same_step(got, want, out, one_out)


def test_blocked_regime_folds_are_the_one_block_folds_bytes(tmp_path: Path):
    """The distillation folder (the regime's G from its group moments, a², ρ = G/(a√F)) by blocks of 7 and 101."""
    batch, _, _ = _batch()
    teacher = llama(tied=True)
    with torch.no_grad():
        zq = teacher(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    regime = Regime("distill_reverse_kl", temperature=0.8, teacher_temperature=0.8)
    runs = {}
    for block in (10**9, 7, 101):
        out = tmp_path / f"block-{block}"
        folder = InRunRegimeFolder(llama(tied=False), regime, SUBSET, out_dir=out, q=0.2, block=block)
        got = folder.fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], zq)
        assert got is not None and set(got.stats) == {*SCALARS, "bound_a2", "m", "F", "Fvar", "G", "rho"}
        runs[block] = got, out
    (want, want_out), *_ = runs.values()
    for block in (7, 101):
        got, out = runs[block]
        _assert_same_step(got, want, out, want_out)


def test_the_streamed_npz_is_savez_and_the_kept_vectors(tmp_path: Path):
    """The npz holds ``np.savez``'s members (names, order, bytes); ``keep`` chooses what InRunStep holds (a written
    one a read-only view of the npz, the others in memory, the same values without an output folder); nothing but
    the step's files is left in the folder, also after a failed fold."""
    batch, A, group = _batch()
    args = (batch["input_ids"], batch["attention_mask"], batch["target_mask"], A)
    folder = InRunFolder(llama(tied=False), SUBSET, out_dir=tmp_path / "a", keep=("m", "F"), block=64)
    got = folder.fold(3, *args, group=group)
    assert got is not None and set(got.stats) == {*SCALARS, "m", "F"}
    assert isinstance(got.stats["F"], np.memmap) and not got.stats["F"].flags.writeable
    assert not isinstance(got.stats["m"], np.memmap)
    saved = tmp_path / "a" / "step_000003.npz"
    with np.load(saved) as f:
        arrays = {name: f[name] for name in f.files}
    assert list(arrays) == ["F", "G", "rho", "top_F", "top_absG", "top_absrho"]
    assert same_bytes(got.stats["F"], arrays["F"])
    np.savez(tmp_path / "savez.npz", **arrays)
    with zipfile.ZipFile(saved) as ours, zipfile.ZipFile(tmp_path / "savez.npz") as theirs:
        assert ours.namelist() == theirs.namelist()
        assert all(ours.read(n) == theirs.read(n) for n in theirs.namelist())
        assert {i.compress_type for i in ours.infolist()} == {zipfile.ZIP_STORED}
    bare = InRunFolder(llama(tied=False), SUBSET, keep=("m", "F"), block=64).fold(3, *args, group=group)
    assert bare is not None and all(same_bytes(bare.stats[v], got.stats[v]) for v in ("m", "F"))
    none = InRunFolder(llama(tied=False), SUBSET, keep=(), block=64).fold(3, *args, group=group)
    assert none is not None and set(none.stats) == set(SCALARS)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["inrun.json", "step_000003.json", "step_000003.npz"]

    def fails(state: Any, lo: int, hi: int) -> dict[str, Any]:
        if lo >= 128:
            raise RuntimeError("lost the device")
        return InRunFolder._block(folder, state, lo, hi)

    folder._block = fails
    with pytest.raises(RuntimeError, match="lost the device"):
        folder.fold(5, *args, group=group)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["inrun.json", "step_000003.json", "step_000003.npz"]


def _trl_generation(batch: dict, A: np.ndarray) -> dict[str, torch.Tensor]:
    """The batch's rows as a TRL generation batch: prompts (B, P) left-padded, completions (B, C) right-padded,
    their masks, and the advantages (B,)."""
    lens = [(int((w == 0).sum()), int((w == 1).sum())) for w in batch["weights"]]  # (prompt, completion) per row
    B, P, C = len(lens), max(p for p, _ in lens), max(c for _, c in lens)
    out = {name: torch.zeros(B, n, dtype=torch.long) for name, n in (("prompt", P), ("completion", C))}
    out |= {f"{name}_mask": torch.zeros_like(out[name]) for name in ("prompt", "completion")}
    for n, (seq, (p, c)) in enumerate(zip(batch["seqs"], lens, strict=True)):
        out["prompt"][n, P - p :], out["prompt_mask"][n, P - p :] = seq[:p], 1
        out["completion"][n, :c], out["completion_mask"][n, :c] = seq[p:], 1
    return {
        "prompt_ids": out["prompt"],
        "prompt_mask": out["prompt_mask"],
        "completion_ids": out["completion"],
        "completion_mask": out["completion_mask"],
        "advantages": torch.as_tensor(A),
    }


def test_the_hook_and_the_trl_callback_pass_keep_and_block_through(tmp_path: Path):
    """``InRunHook(keep=(), block=7)`` returns an InRunStep of the scalars and sets only, and ``CovgradInRun`` (its
    default ``keep=()``, ``block=7``) folds a stand-in trainer's TRL-shaped generation batch with them: both write
    the default folder's files (one block, every statistic kept), byte for byte."""
    from types import SimpleNamespace

    from covgrad.integrations.torch import InRunHook
    from covgrad.integrations.trl import CovgradInRun, _rows

    batch, A, group = _batch()
    args = (batch["input_ids"], batch["attention_mask"], batch["target_mask"], A)
    want = InRunFolder(llama(tied=False), SUBSET, out_dir=tmp_path / "want", q=0.2).fold(0, *args, group=group)
    hook = InRunHook(llama(tied=False), tmp_path / "hook", 1, SUBSET, q=0.2, keep=(), block=7)
    rows = {"input_ids": args[0], "attention_mask": args[1], "response_mask": args[2]}
    got = hook(0, rows, A, group)
    assert want is not None and got is not None and set(got.stats) == set(SCALARS)
    assert got.top.keys() == want.top.keys() and all(same_bytes(got.top[m], want.top[m]) for m in want.top)
    assert_same_files(tmp_path / "hook", tmp_path / "want")

    generation = _trl_generation(batch, A)
    InRunFolder(llama(tied=False), SUBSET, out_dir=tmp_path / "want-trl", q=0.2).fold(
        0, *_rows(generation), A, group=group
    )
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(num_processes=1, unwrap_model=lambda m: m),
        model=llama(tied=False).train(),  # a training generation (the fold runs in eval mode)
        temperature=1.0,
        num_generations=2,
        state=SimpleNamespace(global_step=0),
        _generate_and_score_completions=lambda inputs: generation,
    )
    inrun = CovgradInRun(tmp_path / "trl", 1, SUBSET, q=0.2, block=7).attach(trainer)
    assert trainer._generate_and_score_completions(None) is generation
    assert inrun.folder is not None and inrun.folder.keep == () and inrun.folder.block == 7
    assert_same_files(tmp_path / "trl", tmp_path / "want-trl")


def test_blocks_and_arguments_are_checked(tmp_path: Path):
    assert column_blocks(0, 4) == [(0, 0)] and column_blocks(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert column_blocks(8, 8) == [(0, 8)]
    model = llama(tied=False)
    with pytest.raises(ValueError, match="block must be"):
        InRunFolder(model, block=0)
    with pytest.raises(ValueError, match=r"keep \['Cov'\]"):
        InRunRegimeFolder(model, Regime("distill_reverse_kl"), keep=("F", "Cov"))
    with pytest.raises(ValueError, match=r"vectors \['F2'\]"):
        InRunFolder(model, vectors=("F2",))
    with pytest.raises(ValueError, match="output folder"):
        StepVectors(4, ("F",), (), None, "step_000000")


def test_a_ranks_local_runs_are_its_global_columns():
    layout = select_parameters(llama(tied=False))
    for R in (1, 2, 3, 5):
        for r in range(R):
            cols = RankColumns.of(layout, R, r)
            for block in (1, 7, 101, cols.P + 1):
                found = [
                    np.arange(a, b) for lo, hi in column_blocks(cols.P, block) for a, b, _ in local_runs(cols, lo, hi)
                ]
                assert np.array_equal(np.concatenate(found), cols.index()), (R, r, block)
                offsets = [at for lo, hi in column_blocks(cols.P, block) for _, _, at in local_runs(cols, lo, hi)]
                assert all(0 <= at < block for at in offsets)
