"""Block-wise top sets, Spearman and the masks stage against whole-array references: stable argsort,
average ranks from the definition, brute-force set counts; every block size gives the same bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import covgrad.moments.topk as topk_module
import storage.schema as schema_module
from covgrad.layout import ParamLayout, TensorEntry
from covgrad.moments.topk import (
    SCOPES,
    TopSets,
    Values,
    _exact_dot,
    _mark,
    _parts,
    as_values,
    count_for_fraction,
    find_cuts,
    spearman,
    spearman_blocked,
)
from storage.artifacts import ArtifactStore
from storage.schema import STATS
from tasks.masks import compute_masks
from tasks.specs import MasksSpec
from tests.helpers.ranks import naive_spearman


def reference_topk(values: np.ndarray, k: int) -> np.ndarray:
    """The k first of a stable descending argsort minus the NaNs it puts last, as a (P,) bool mask."""
    top = np.argsort(-values, kind="stable")[:k]
    mask = np.zeros(len(values), dtype=bool)
    mask[top[~np.isnan(values[top])]] = True
    return mask


def tied_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Heavy ties: a third exact zeros (±0), repeated values from a small pool, NaN, ±inf, and a few
    values that differ only in the last float64 bits."""
    pool = np.array([0.0, -0.0, 1.0, 2.5, -1.0, 1e-300, np.inf, -np.inf, np.nan, 1 + 2**-52, 1 + 2**-51])
    v = rng.exponential(1.0, n)
    pooled = rng.random(n) < 0.5
    v[pooled] = pool[rng.integers(0, len(pool), int(pooled.sum()))]
    v[rng.random(n) < 0.33] = 0.0
    return v


def blocked(values: np.ndarray) -> Values:
    return Values(lambda a, b: values[a:b], len(values))


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 22])
@pytest.mark.parametrize("candidates", [1, 5, 1 << 22])  # 1: every search narrows to all 64 key bits
def test_find_cuts_and_marks_equal_stable_argsort(block: int, candidates: int) -> None:
    rng = np.random.default_rng(block * 7 + candidates)
    for n in (1, 2, 3, 50, 301):
        values = tied_values(rng, n)
        ks = sorted({0, 1, 2 % (n + 1), n // 3, n - 1, n})
        with mock.patch.object(topk_module, "BLOCK", block), mock.patch.object(topk_module, "_CANDIDATES", candidates):
            cuts = find_cuts(blocked(values), ks)
            for k, cut in zip(ks, cuts, strict=True):
                taken, parts = 0, []
                for _, v in blocked(values).blocks():
                    mask, taken = _mark(v, cut, taken)
                    parts.append(mask)
                np.testing.assert_array_equal(np.concatenate(parts), reference_topk(values, k), err_msg=f"n={n} k={k}")


# tiny tensors: one element, two, and a tensor of one repeated value
LAYOUT = ParamLayout(
    (
        TensorEntry("embed.weight", 0, 700, (70, 10), "float32"),
        TensorEntry("a.bias", 700, 1, (1,), "float32"),
        TensorEntry("b.bias", 701, 2, (2,), "float32"),
        TensorEntry("flat.weight", 703, 40, (4, 10), "float32"),
        TensorEntry("head.weight", 743, 257, (257,), "float32"),
    )
)


def scope_mask(values: np.ndarray, q: float, scope: str) -> np.ndarray:
    if scope == "global":
        return reference_topk(values, count_for_fraction(q, len(values)))
    return np.concatenate(
        [reference_topk(values[e.offset : e.offset + e.numel], count_for_fraction(q, e.numel)) for e in LAYOUT.entries]
    )


def metric(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = tied_values(rng, LAYOUT.P)
    v[703:743] = 0.25  # one repeated value in a whole tensor
    return np.abs(v)


@pytest.mark.parametrize("block", [5, 333, 1 << 22])
def test_top_sets_sweep_equals_reference(block: int) -> None:
    qs = [1e-4, 0.01, 0.3, 1.0]  # k = 1 globally and per tensor, ..., every number
    values = metric(1)
    with mock.patch.object(topk_module, "BLOCK", block):
        top = TopSets(blocked(values), LAYOUT, qs)
        swept = list(top.sweep())
    for scope in SCOPES:
        got = np.concatenate([m[scope] for _, m in swept], axis=1)  # (q, P)
        for i, q in enumerate(qs):
            want = scope_mask(values, q, scope)
            np.testing.assert_array_equal(got[i], want, err_msg=f"{scope} q={q}")
            counts = [int(want[e.offset : e.offset + e.numel].sum()) for e in LAYOUT.entries]
            assert top.counts[scope][i].tolist() == counts
    assert [start for start, _ in swept] == list(range(0, LAYOUT.P, block))


@pytest.mark.parametrize("block", [1, 6, 1000])
def test_spearman_blocked_matches_definition_and_whole_array_code(block: int, tmp_path: Path) -> None:
    rng = np.random.default_rng(block)
    for n in (2, 3, 17, 400):
        x = np.abs(tied_values(rng, n))
        x[np.isnan(x) | np.isinf(x)] = 3.0
        y = np.round(x + rng.normal(0, 0.5, n), 1)  # ties in y too
        y[: n // 4] = 0.0
        with mock.patch.object(topk_module, "BLOCK", block):
            got = spearman_blocked(blocked(x), blocked(y), scratch=str(tmp_path))
        if len(np.unique(x)) == 1 or len(np.unique(y)) == 1:
            assert math.isnan(got) and math.isnan(spearman(x, y))
            continue
        assert got == pytest.approx(naive_spearman(x, y), abs=1e-12)
        assert got == pytest.approx(spearman(x, y), rel=1e-12)  # the whole-array float64 code
    assert list(tmp_path.iterdir()) == []  # the temporary rank file is gone


def test_spearman_blocked_exact_cases_and_bad_input() -> None:
    x = np.arange(1000.0)
    assert spearman_blocked(blocked(x), blocked(np.exp(x / 100))) == 1.0
    assert spearman_blocked(blocked(x), blocked(-x)) == -1.0
    assert math.isnan(spearman_blocked(blocked(x), blocked(np.zeros(1000))))
    with pytest.raises(ValueError, match="NaN"):
        spearman_blocked(blocked(np.array([1.0, np.nan, 2.0])), blocked(x[:3]))
    with pytest.raises(ValueError, match="equal length"):
        spearman_blocked(blocked(x), blocked(x[:-1]))
    with pytest.raises(ValueError, match="equal length"):
        spearman_blocked(blocked(x[:1]), blocked(x[:1]))


def test_exact_dot_is_exact_near_its_limit() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(-(2**34) + 1, 2**34, 1 << 18)
    b = rng.integers(-(2**34) + 1, 2**34, len(a))
    assert _exact_dot(_parts(a), _parts(b)) == sum(int(i) * int(j) for i, j in zip(a.tolist(), b.tolist(), strict=True))


def write_stats(root: str, seed: int) -> ArtifactStore:
    """A stats artifact ``stats/up`` over LAYOUT with F, G, Fvar, Cov and ρ (NaN where Fvar = 0)."""
    rng = np.random.default_rng(seed)
    F = metric(seed)
    F[np.isnan(F) | np.isinf(F)] = 0.0
    Fvar = F * rng.uniform(0.5, 1, LAYOUT.P)
    Cov = np.round(0.7 * np.sqrt(Fvar) * rng.uniform(-1, 1, LAYOUT.P), 2)
    G = Cov + 0.01 * rng.normal(size=LAYOUT.P)
    G[:100] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(Fvar > 0, Cov / (0.7 * np.sqrt(Fvar)), np.nan)
    store = ArtifactStore(root)
    g = store.open_group(store.ref("stats", "up"), STATS, mode="w")
    for name, v in {"F": F, "G": G, "Fvar": Fvar, "Cov": Cov, "rho": rho}.items():
        g.create_array(name, data=v, chunks=(64,), dimension_names=["param"])
    g.attrs.update({"tensors": LAYOUT.to_records(), "scalars": {"std_A": 0.7, "P": LAYOUT.P}, "degenerate": None})
    return store


def artifact_files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_masks_stage_blocks_and_chunks_against_references(tmp_path: Path) -> None:
    store = write_stats(str(tmp_path), seed=3)
    up = store.ref("stats", "up")
    qs = [1e-4, 0.01, 0.05, 1.0]
    spec = MasksSpec(qs=qs)
    # several param chunks (64) and blocks (320 and 129 values: not dividing P) against one of each
    with mock.patch.object(schema_module, "PARAM_CHUNK", 64):
        for key, block in (("blocks", 320), ("odd", 129), ("one", 1 << 22)):
            with mock.patch.object(topk_module, "BLOCK", block):
                compute_masks(store, store.ref("masks", key), spec, up)
    outputs = {key: artifact_files(Path(store.path(store.ref("masks", key)))) for key in ("blocks", "odd", "one")}
    assert outputs["blocks"] == outputs["one"] == outputs["odd"]
    st = store.open_group(up, STATS)
    stats = {name: st[name][:] for name in ("F", "G", "Fvar", "Cov", "rho")}
    g = store.open_group(store.ref("masks", "blocks"), "masks.zarr")
    for name, values in (("F", stats["F"]), ("absG", np.abs(stats["G"])), ("absrho", np.abs(stats["rho"]))):
        for scope in SCOPES:
            want = np.stack([scope_mask(values, q, scope) for q in qs])
            np.testing.assert_array_equal(g[f"{name}_{scope}"][:], want, err_msg=f"{name}_{scope}")
    art = Path(store.path(store.ref("masks", "blocks")))
    overlap = json.loads((art / "overlap.json").read_text())
    for row in overlap:
        top_G = scope_mask(np.abs(stats["G"]), row["q"], row["scope"])
        top_F = scope_mask(stats["F"], row["q"], row["scope"])
        expected = sum(
            top_G[e.offset : e.offset + e.numel].sum() * top_F[e.offset : e.offset + e.numel].sum() / e.numel
            for e in LAYOUT.entries
        )
        assert (row["n_G"], row["n_F"], row["n_both"]) == (top_G.sum(), top_F.sum(), (top_G & top_F).sum())
        assert row["per_tensor_random"] == pytest.approx(expected / top_G.sum(), rel=1e-12)
    bound = json.loads((art / "bound.json").read_text())
    absCov = np.abs(stats["Cov"])
    for row, q in zip(bound, qs, strict=True):
        assert row["tau"] == np.sort(absCov)[-count_for_fraction(q, LAYOUT.P)]
        in_bound, in_cov = 0.7 * np.sqrt(stats["Fvar"]) >= row["tau"], absCov >= row["tau"]
        assert (row["n_bound"], row["n_cov"], row["n_both"]) == (
            in_bound.sum(),
            in_cov.sum(),
            (in_bound & in_cov).sum(),
        )
    summary = json.loads((art / "summary.json").read_text())
    assert summary["spearman_F_absG"] == pytest.approx(naive_spearman(stats["F"], np.abs(stats["G"])), abs=1e-12)
    shares = (art / "tensors.csv").read_text().splitlines()
    assert len(shares) == 1 + 2 * len(LAYOUT.entries)


def test_as_values_rejects_2d() -> None:
    with pytest.raises(ValueError, match="1-D"):
        as_values(np.zeros((2, 2)))
