"""covgrad.updates.kstep against a brute force over every materialised weight vector: d_k(t) for every k and
window, the independent curve, consecutive Jaccard and the persistence histogram, per group; and the kinds."""

import numpy as np
import pytest

from covgrad.updates.kstep import (
    KS,
    N_DECILES,
    Cells,
    count_trace,
    magnitude_deciles,
    persistence_tables,
    tensor_kind,
)

NAMES = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "lm_head.weight",
)
NUMELS = (60, 40, 50, 7, 43)


def synthetic_run(seed: int, steps: int, noise: float = 0.05) -> tuple[np.ndarray, list[np.ndarray]]:
    """Start bits (P,) uint16 and the weights after every step (T + 1, P): some coordinates drift one way
    every step (persistent), others flip back and forth (net zero over two steps), the rest change at random."""
    rng = np.random.default_rng(seed)
    P = sum(NUMELS)
    w = [rng.integers(0x3C00, 0x3E00, P).astype(np.uint16)]
    persistent = rng.random(P) < 0.1
    flipper = ~persistent & (rng.random(P) < 0.1)
    for t in range(1, steps + 1):
        nxt = w[-1].copy()
        nxt[persistent] += 1
        nxt[flipper] += np.uint16(1) if t % 2 else np.uint16(0xFFFF)  # +1 then −1 (uint16 wraps)
        noisy = ~persistent & ~flipper & (rng.random(P) < noise)
        nxt[noisy] += rng.integers(1, 3, int(noisy.sum())).astype(np.uint16)
        w.append(nxt)
    return w[0], w


def brute(w: list[np.ndarray], groups: np.ndarray, G: int, ks: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Every measure recounted from the weights of every step, per group (labels ``groups`` (P,))."""
    T = len(w) - 1
    size = np.bincount(groups, minlength=G).astype(np.float64)
    frac = lambda mask: np.bincount(groups[mask], minlength=G) / size  # noqa: E731
    dk = np.full((len(ks), T, G), np.nan)
    for i, k in enumerate(ks):
        for t in range(T - k + 1):
            dk[i, t] = frac(w[t + k] != w[t])
    d1 = np.stack([frac(w[t + 1] != w[t]) for t in range(T)])
    independent = np.full((len(ks), T, G), np.nan)
    for i, k in enumerate(ks):
        for t in range(T - k + 1):
            independent[i, t] = 1 - np.prod(1 - d1[t : t + k], axis=0)
    sets = [w[t] != w[t - 1] for t in range(1, T + 1)]
    jaccard = np.full((T, G), np.nan)
    for t in range(1, T):
        both = np.bincount(groups[sets[t] & sets[t - 1]], minlength=G)
        union = np.bincount(groups[sets[t] | sets[t - 1]], minlength=G)
        jaccard[t] = np.where(union > 0, both / np.maximum(union, 1), np.nan)
    times = np.sum(sets, axis=0)
    hist = np.zeros((G, T + 1), dtype=np.int64)
    np.add.at(hist, (groups, times), 1)
    return {"dk": dk, "independent": independent, "jaccard": jaccard, "hist": hist}


@pytest.mark.parametrize(("seed", "steps"), [(0, 40), (1, 5), (2, 1)])
def test_every_measure_equals_a_brute_force_recount(seed, steps):
    start, w = synthetic_run(seed, steps)
    floats = (start.astype(np.uint32) << 16).view(np.float32)
    cells = Cells.of(NAMES, NUMELS, floats)

    def delta(t: int) -> tuple[np.ndarray, np.ndarray]:
        idx = np.flatnonzero(w[t] != w[t - 1])
        return idx, w[t][idx]

    tables = persistence_tables(count_trace(start, delta, steps, cells), cells)
    tensor = np.repeat(np.arange(len(NAMES)), NUMELS)
    decile = np.empty(tensor.shape[0], dtype=np.int64)
    decile[np.argsort(np.abs(floats.astype(np.float64)), kind="stable")] = np.arange(tensor.shape[0])
    decile = decile * N_DECILES // tensor.shape[0]
    kinds = tables["labels_kind"]
    kind = np.asarray([kinds.index(tensor_kind(NAMES[e])) for e in tensor])
    for name, groups, G in (
        ("all", np.zeros_like(tensor), 1),
        ("kind", kind, len(kinds)),
        ("tensor", tensor, len(NAMES)),
        ("decile", decile, N_DECILES),
    ):
        want = brute(w, groups, G, KS)
        np.testing.assert_array_equal(tables[f"dk_{name}"], want["dk"], err_msg=name)
        np.testing.assert_allclose(tables[f"independent_{name}"], want["independent"], rtol=1e-12, atol=0)
        np.testing.assert_array_equal(tables[f"jaccard_{name}"], want["jaccard"], err_msg=name)
        np.testing.assert_array_equal(tables[f"hist_{name}"], want["hist"], err_msg=name)


def test_a_persistent_set_stays_far_below_the_independent_curve():
    """The flipping coordinates never count over even windows, the persistent ones count once however long
    the window: d_32 is far below what independent sets of the same per-step size give."""
    start, w = synthetic_run(0, 40, noise=0.002)
    cells = Cells.of(NAMES, NUMELS, (start.astype(np.uint32) << 16).view(np.float32))

    def delta(t):
        idx = np.flatnonzero(w[t] != w[t - 1])
        return idx, w[t][idx]

    tables = persistence_tables(count_trace(start, delta, 40, cells), cells)
    d32, ind32 = tables["dk_all"][KS.index(32), 0, 0], tables["independent_all"][KS.index(32), 0, 0]
    assert d32 < 0.5 * ind32


def test_tensor_kinds():
    assert [tensor_kind(n) for n in NAMES] == ["embedding", "attention", "mlp", "norm", "embedding"]
    assert tensor_kind("transformer.h.3.attn.c_attn.weight") == "attention"
    assert tensor_kind("transformer.h.3.mlp.c_fc.weight") == "mlp"
    assert tensor_kind("transformer.ln_f.bias") == "norm"
    assert tensor_kind("model.layers.2.mlp.experts.gate_up_proj") == "mlp"
    assert tensor_kind("score.weight") == "other"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_magnitude_deciles_are_the_stable_argsorts(dtype):
    """Deciles of |w_0| against argsort: ties by the lowest index (±0 and ±w tie), NaN last."""
    rng = np.random.default_rng(3)
    P = 1003
    w = (rng.integers(-40, 40, P) / 16).astype(dtype)
    w[rng.choice(P, 9, replace=False)] = np.nan
    w[rng.choice(P, 9, replace=False)] = -0.0
    a = np.abs(w.astype(np.float64))
    ranks = np.empty(P, dtype=np.int64)
    ranks[np.argsort(np.where(np.isnan(a), np.inf, a), kind="stable")] = np.arange(P)
    np.testing.assert_array_equal(magnitude_deciles(w), (ranks * N_DECILES // P).astype(np.int8))
