"""The device-resident reduction: MomentAccumulator against numpy float64, and PerSampleGrads.accumulate
(blocks folded tensor by tensor during the backward) against the moments of the per-sample rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from covgrad.layout import select_parameters
from covgrad.moments import accum
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.rules import Slot, _embedding_rule
from tests.helpers.moments import assert_close, check_row_chunks, fused, numpy_moments, state
from tests.helpers.persample import BATCH, MODELS, doubled_up_proj, llama, make_batch, naive_scores

TOL = {"float64": 1e-9, "float32": 1e-5}


@pytest.fixture(params=["native", "inductor"])
def kernel(request, monkeypatch) -> str:
    """The compiled fold on the CPU both ways: the native kernel (float64 state; it must build here) and the
    torch.compile kernel every other device and state dtype runs."""
    monkeypatch.setattr(accum, "NATIVE_CPU", request.param == "native")
    if request.param == "native":
        assert accum.native_fold() is not None, "the native fold did not build (no working C++ compiler?)"
    return request.param


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("state_dtype", ["float64", "float32"])
@pytest.mark.parametrize("ratio", [1.0, 1e4])
def test_accumulator_matches_numpy_float64(state_dtype, ratio, compiled, kernel):
    """Uneven batches (single-sample, single-half) and mean/std up to 1e4 against a two-pass float64, for
    the eager and the compiled fold (which takes over once both halves have samples)."""
    rng = np.random.default_rng(int(ratio) + len(state_dtype))
    N, P = 120, 300
    S = (rng.standard_normal((N, P)) * rng.uniform(0.5, 2, P) + ratio * rng.standard_normal(P)).astype(np.float32)
    S[:, 7] = 3.25  # a constant column: zero variance, exactly
    A = rng.standard_normal(N) + 5.0
    half = rng.integers(0, 2, N)
    half[:9] = 1  # the first batch holds one half only
    acc = MomentAccumulator(P, "cpu", state_dtype, compiled=compiled)
    bounds = [0, 9, 10, 33, 64, 120]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        acc.begin_batch(A[lo:hi], half[lo:hi])
        for c0, c1 in ((0, 100), (100, 101), (101, P)):  # tensors folded in any order, any sizes
            acc.fold(c0, torch.from_numpy(S[lo:hi, c0:c1]))
        acc.end_batch()
    want = numpy_moments(S, A, half)
    got = state(acc)
    assert_close(got, want, TOL[state_dtype])
    assert got["m2_s"][:, 7].tolist() == [0.0, 0.0] and got["c_as"][:, 7].tolist() == [0.0, 0.0]
    assert acc.mean.dtype == (torch.float64 if state_dtype == "float64" else torch.float32)
    assert acc.bytes_per_param == (48 if state_dtype == "float64" else 32)
    assert acc.fold_path == ("compiled" if compiled else "eager")


def test_compiled_fold_matches_eager_fold(kernel):
    """Fresh random blocks, both halves, an empty half in one batch: the compiled and the eager fold agree to
    float64 rounding (float32 state: to the float32 error model)."""
    rng = np.random.default_rng(11)
    N, P = 96, 1000
    S = (rng.standard_normal((N, P)) * 3 + 50 * rng.standard_normal(P)).astype(np.float32)
    A, half = rng.standard_normal(N), rng.integers(0, 2, N)
    half[40:48] = 0  # a batch without half 1: its rows must come through unchanged
    for state_dtype, rtol in (("float64", 1e-12), ("float32", 1e-5)):
        accs = [MomentAccumulator(P, "cpu", state_dtype, compiled=flag) for flag in (False, True)]
        for acc in accs:
            for b in range(0, N, 8):
                acc.begin_batch(A[b : b + 8], half[b : b + 8])
                acc.fold(0, torch.from_numpy(S[b : b + 8, :700]))
                acc.fold(700, torch.from_numpy(S[b : b + 8, 700:]).reshape(8, 20, 15))
                acc.end_batch()
        assert accs[1].fold_path == "compiled"
        assert_close(state(accs[1]), state(accs[0]), rtol)
        assert_close(state(accs[1]), numpy_moments(S, A, half), 1e-9 if state_dtype == "float64" else 1e-5)


def test_compiled_fold_in_column_tiles_is_bit_identical(monkeypatch, kernel):
    """A block wider than the compiled fold's tile is folded tile by tile: the same bytes as one call (the native
    kernel also in tiles of 37 columns, across its strips and vector widths)."""
    rng = np.random.default_rng(12)
    N, P = 48, 1000
    S = (rng.standard_normal((N, P)) * 3 + 50 * rng.standard_normal(P)).astype(np.float32)
    A, half = rng.standard_normal(N), rng.integers(0, 2, N)
    for state_dtype in ("float64", "float32"):
        states = []
        tiles = (1 << 22, 64, *((37,) if kernel == "native" and state_dtype == "float64" else ()))
        for tile in tiles:  # one call, then tiles of 64 columns (a multiple of every vector width)
            monkeypatch.setattr(accum, "_COMPILED_COLUMNS", tile)
            acc = MomentAccumulator(P, "cpu", state_dtype, compiled=True)
            for b in range(0, N, 8):
                acc.begin_batch(A[b : b + 8], half[b : b + 8])
                acc.fold(0, torch.from_numpy(S[b : b + 8, :700]))
                acc.fold(700, torch.from_numpy(S[b : b + 8, 700:]))
                acc.end_batch()
            assert acc.fold_path == "compiled"
            states.append(acc.rows())
        for other in states[1:]:
            for name, value in states[0].items():
                np.testing.assert_array_equal(other[name], value, err_msg=f"{state_dtype} {name}")


def test_compiled_fold_takes_over_at_the_same_batch_after_a_resume(monkeypatch):
    """Default accumulators switch to the compiled fold once samples × P reaches the threshold: the batches
    before it run eager, and a run resumed from a checkpoint, or split into parameter blocks, switches at the
    same batch (identical bytes)."""
    import covgrad.moments.accum as accum

    monkeypatch.setattr(accum, "_COMPILE_AFTER", 24 * 40)  # from the fourth batch of 8 (24 samples × P = 40)
    rng = np.random.default_rng(13)
    S, A, half = rng.standard_normal((48, 40)).astype(np.float32), rng.standard_normal(48), np.arange(48) % 2
    paths: list[bool] = []

    def feed(acc: MomentAccumulator, lo: int, hi: int) -> None:
        for b in range(lo, hi, 8):
            acc.begin_batch(A[b : b + 8], half[b : b + 8])
            paths.append(acc._batch.compiled)
            acc.fold(0, torch.from_numpy(S[b : b + 8]))
            acc.end_batch()

    whole = MomentAccumulator(40, "cpu")
    assert whole.fold_path.startswith("eager until samples × P >= ")
    feed(whole, 0, 48)
    assert paths == [False, False, False, True, True, True]
    assert whole.fold_path == "compiled"
    part = MomentAccumulator(40, "cpu")
    feed(part, 0, 16)
    resumed = MomentAccumulator(40, "cpu")
    resumed.load(part.rows())
    feed(resumed, 16, 48)
    assert paths[6:] == [False, False, False, True, True, True]  # 2 batches before the checkpoint, 4 after
    for k, v in whole.rows().items():
        assert v.tobytes() == resumed.rows()[k].tobytes(), k
    assert_close(state(whole), numpy_moments(S, A, half), 1e-9)
    # parameter blocks hold whole tensors: two "tensors" of 15 and 25 columns, folded one call each, in one
    # accumulator of 40 columns or in two blocks (other offsets and alignments) switch at the same batch
    tensors = (slice(0, 15), slice(15, 40))
    one = MomentAccumulator(40, "cpu")
    blocks = [MomentAccumulator(15, "cpu", switch_P=40), MomentAccumulator(25, "cpu", switch_P=40)]
    for b in range(0, 48, 8):
        one.begin_batch(A[b : b + 8], half[b : b + 8])
        for cols in tensors:
            one.fold(cols.start, torch.from_numpy(np.ascontiguousarray(S[b : b + 8, cols])))
        one.end_batch()
        for acc, cols in zip(blocks, tensors, strict=True):
            acc.begin_batch(A[b : b + 8], half[b : b + 8])
            paths.append(acc._batch.compiled)
            acc.fold(0, torch.from_numpy(np.ascontiguousarray(S[b : b + 8, cols])))
            acc.end_batch()
    assert paths[12:] == [p for p in paths[:6] for _ in range(2)]
    for k, v in one.rows().items():
        if v.ndim == 1:  # count, mean_a, m2_a (H,)
            assert all(acc.rows()[k].tobytes() == v.tobytes() for acc in blocks), k
        else:
            assert np.concatenate([acc.rows()[k] for acc in blocks], axis=1).tobytes() == v.tobytes(), k


@pytest.mark.parametrize(
    ("state_dtype", "compiled"),
    [("float64", False), ("float32", False), ("float64", True)],
    ids=["float64-eager", "float32-eager", "float64-compiled"],
)
def test_state_without_comoment_keeps_the_mean_and_m2(state_dtype, compiled, kernel):
    """``comoment=False`` (a regime's g_n, advantages all 0): no ``c``, a third less state, and the mean and
    M2 of the full state (to float64 rounding: the kernels differ), against numpy float64. The compiled fold
    in float32 state is the float64 one's code at another dtype (each compile costs 10–20 s of the suite):
    test_accumulator_matches_numpy_float64 covers it with the comoment."""
    rng = np.random.default_rng(21)
    N, P = 64, 500
    S = (rng.standard_normal((N, P)) * 2 + 30 * rng.standard_normal(P)).astype(np.float32)
    half = rng.integers(0, 2, N)
    full = MomentAccumulator(P, "cpu", state_dtype, compiled=compiled)
    bare = MomentAccumulator(P, "cpu", state_dtype, compiled=compiled, comoment=False)
    for acc in (full, bare):
        for b in range(0, N, 8):
            acc.begin_batch(np.zeros(8), half[b : b + 8])
            acc.fold(0, torch.from_numpy(S[b : b + 8, :300]))
            acc.fold(300, torch.from_numpy(S[b : b + 8, 300:]))
            acc.end_batch()
    assert bare.c is None and "c_as" not in bare.rows()
    assert bare.bytes_per_param == (32 if state_dtype == "float64" else 24)
    want = numpy_moments(S, np.zeros(N), half)
    got = state(bare)
    assert_close(
        {k: v for k, v in got.items() if k != "c_as"}, {k: want[k] for k in got if k != "c_as"}, TOL[state_dtype]
    )
    for k, v in bare.rows().items():
        np.testing.assert_allclose(v, full.rows()[k], rtol=0, atol=1e-12 * np.abs(v).max(), err_msg=k)


def test_compiled_fold_falls_back_to_eager(monkeypatch):
    """A compiler that fails: a warning, the eager fold from then on, and the eager fold's exact bytes."""
    import covgrad.moments.accum as accum

    def broken() -> object:
        def fail(*args: object) -> None:
            raise torch._dynamo.exc.TorchDynamoException("no working C++ compiler")

        return fail

    monkeypatch.setattr(accum, "_compiled", broken)
    monkeypatch.setattr(accum, "NATIVE_CPU", False)  # the torch.compile kernel's fallback
    rng = np.random.default_rng(12)
    S, A, half = rng.standard_normal((24, 30)).astype(np.float32), rng.standard_normal(24), np.arange(24) % 2
    accs = [MomentAccumulator(30, "cpu", compiled=flag) for flag in (False, True)]
    with pytest.warns(RuntimeWarning, match="compile failed: TorchDynamoException: no working C"):
        for acc in accs:
            for b in range(0, 24, 8):
                acc.begin_batch(A[b : b + 8], half[b : b + 8])
                acc.fold(0, torch.from_numpy(S[b : b + 8]))
                acc.end_batch()
    assert accs[1].fold_path.startswith("eager (compile failed")
    for k, v in accs[0].rows().items():
        assert v.tobytes() == accs[1].rows()[k].tobytes(), k


def test_accumulator_state_round_trips_and_continues_identically():
    rng = np.random.default_rng(5)
    S = rng.standard_normal((40, 50)).astype(np.float32)
    A, half = rng.standard_normal(40), rng.integers(0, 2, 40)

    def feed(acc: MomentAccumulator, lo: int, hi: int) -> None:
        for b in range(lo, hi, 8):
            acc.begin_batch(A[b : b + 8], half[b : b + 8])
            acc.fold(0, torch.from_numpy(S[b : b + 8]))
            acc.end_batch()

    for dt, compiled in (("float64", False), ("float32", False), ("float64", True), ("float32", True)):
        whole = MomentAccumulator(50, "cpu", dt, compiled=compiled)
        feed(whole, 0, 40)
        part = MomentAccumulator(50, "cpu", dt, compiled=compiled)
        feed(part, 0, 16)
        resumed = MomentAccumulator(50, "cpu", dt, compiled=compiled)
        resumed.load(part.rows())
        feed(resumed, 16, 40)
        for k, v in whole.rows().items():
            assert v.tobytes() == resumed.rows()[k].tobytes(), k


def test_fold_batches_checkpoints_and_resumes_with_the_same_bytes():
    """covgrad.scores.fold without a store: checkpoints every 2 batches and after the last, and a fold resumed
    from the state of its second checkpoint ends with the bytes of the uninterrupted fold."""
    from covgrad.rollouts.batch import RolloutBatch
    from covgrad.scores.centering import policy_logit_grad
    from covgrad.scores.fold import fold_batches
    from tests.helpers.models import tiny_llama

    model = tiny_llama(11, hidden=8, intermediate=16, layers=1, heads=2, kv_heads=1)
    layout = select_parameters(model, None)
    rng = np.random.default_rng(3)
    L, B, n = 7, 4, 5
    pl, rl = rng.integers(1, 3, (n, B)), rng.integers(1, 5, (n, B))
    pos = np.arange(L)[None, None]
    mask = (pos >= pl[..., None]) & (pos < (pl + rl)[..., None])  # (n, B, L): the response tokens
    tokens = rng.integers(1, 11, (n, B, L)) * (pos < (pl + rl)[..., None])  # right-padded with 0
    adv = rng.standard_normal((n, B))

    def read(b: int) -> RolloutBatch:
        groups = np.arange(B) // 2 + 2 * b  # two prompt groups per batch
        return RolloutBatch.from_arrays(tokens[b], pl[b], rl[b], mask[b], adv[b], groups, trim=False)

    grad = lambda b, batch: policy_logit_grad(batch, torch.device("cpu"))  # noqa: E731

    def fold(todo, acc, done, calls):
        psg = PerSampleGrads(model, layout, check=False)
        save = lambda folded, final, batches: calls.append((folded, final, list(batches)))  # noqa: E731
        on_batch = lambda b, out: seen.append((b, out.data_ptr() == rows.data_ptr()))  # noqa: E731
        fold_batches(psg, acc, todo, read, grad, save, done=done, rows=rows, on_batch=on_batch, every=2)

    rows, seen, calls = torch.empty(B, layout.P), [], []
    whole = MomentAccumulator(layout.P, "cpu")
    fold(range(n), whole, 0, calls)
    assert calls == [(2, False, [0, 1]), (4, False, [2, 3]), (5, True, [4])]
    part, resumed, again = MomentAccumulator(layout.P, "cpu"), MomentAccumulator(layout.P, "cpu"), []
    fold(range(2), part, 0, [])
    resumed.load(part.rows())
    fold(range(2, n), resumed, 2, again)
    assert again == [(4, False, [2, 3]), (5, True, [4])]
    assert seen == [(b, True) for b in [*range(n), *range(n)]]  # each batch's rows, in the buffer
    assert whole.count.sum() == n * B and np.count_nonzero(whole.rows()["c_as"]) > 0
    for k, v in whole.rows().items():
        assert v.tobytes() == resumed.rows()[k].tobytes(), k


def test_accumulator_rejects_bad_use():
    acc = MomentAccumulator(4, "cpu")
    with pytest.raises(ValueError, match="state_dtype 'float16'"):
        MomentAccumulator(4, "cpu", "float16")
    with pytest.raises(ValueError, match="outside a batch"):
        acc.fold(0, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="half values"):
        acc.begin_batch(np.zeros(2), np.array([0, 2]))
    acc.begin_batch(np.zeros(2), np.array([0, 1]))
    with pytest.raises(ValueError, match="does not fit"):
        acc.fold(2, torch.zeros(2, 4))


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_reduction_matches_moments_of_rows(name):
    """The fused fold sees exactly the rows __call__ returns (bitwise), and its state equals numpy float64
    moments of them; the rows themselves match the naive loop."""
    model = MODELS[name]()
    layout = select_parameters(model)
    batches, rows = [], []
    psg = PerSampleGrads(model, layout, check=False)
    for seed in (30, 31, 32):
        batch = make_batch(seed, **BATCH)
        gen = np.random.default_rng(seed)
        batches.append((batch, gen.standard_normal(4), np.array([0, 1, 1, seed % 2])))
        fn = lambda z, b=batch: score_logit_grad(z, b["input_ids"], b["target_mask"])  # noqa: E731
        rows.append(psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"]))
    S = torch.cat(rows).numpy()
    ref = naive_scores(model, layout, batches[0][0]).double()
    assert float((rows[0].double() - ref).norm() / ref.norm()) < 1e-5
    A = np.concatenate([a for _, a, _ in batches])
    half = np.concatenate([h for _, _, h in batches])
    want = numpy_moments(S, A, half)
    acc = fused(model, layout, batches)
    assert_close(state(acc), want, 1e-9)
    with_rows = fused(model, layout, batches, rows=True, check=False)
    for k, v in acc.rows().items():
        assert np.array_equal(v, with_rows.rows()[k]), k
    assert_close(state(fused(model, layout, batches, "float32", check=False)), want, 1e-5)
    if name in ("llama-tied", "gpt2-conv1d"):  # the compiled fold in the backward hooks (batches 2, 3: both halves)
        assert_close(state(fused(model, layout, batches, check=False, compiled=True)), want, 1e-9)
        assert_close(state(fused(model, layout, batches, "float32", check=False, compiled=True)), want, 1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 1500], ids=["one-row", "ragged"])
@pytest.mark.parametrize("name", ["llama-untied", "llama-tied", "qwen2-bias", "gpt2-conv1d"])
def test_weights_folded_in_row_chunks(name, chunk_bytes):
    """Linear/Conv1D weights and embeddings (tied: the LM head's chunk with the embedding's rows added) written and
    folded in chunks of rows (one row each; chunks that do not divide the rows): see :func:`check_row_chunks`."""
    check_row_chunks(name, chunk_bytes, "cpu")


class _RowChunks(Slot):
    """Hands a rule chunks of ``per`` rows from row ``start`` on (a row-cut block's grid), each a fresh NaN buffer
    copied into ``into`` once the rule asks for the next, as the fused reduction consumes them."""

    def __init__(self, into: torch.Tensor, per: int, start: int = 0) -> None:
        super().__init__(lambda name: None)
        self.into, self.per, self.start = into, per, start

    def rows(self, name: str, n_rows: int):
        for r0 in range(self.start, n_rows, self.per):
            r1 = min(n_rows, r0 + self.per)
            buf = torch.full((self.into.shape[0], r1 - r0, *self.into.shape[2:]), float("nan"))
            yield r0, r1, buf
            self.into[:, r0:r1] = buf


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_rows_in_chunks_are_the_whole_tables_bits(padding_idx):
    """The embedding rule writing chunks of rows (positions sorted by id once, each chunk adding its own in
    position order) gives every sample's table of the position-order loop, and of the whole-table scatter, bit for
    bit: repeated ids, the padding row, chunks of 1, 3 and 7 rows (ragged at the end), a grid starting inside the
    table (a row-cut block's)."""
    torch.manual_seed(0)
    emb = nn.Embedding(23, 5, padding_idx=padding_idx)
    ids = torch.randint(0, 23, (4, 9))
    ids[0, :4], ids[1, 2], ids[1, 5] = 3, 11, 11
    g = torch.randn(4, 9, 5)
    want = torch.zeros(4, 23, 5)
    for b in range(4):
        for t in range(9):
            if ids[b, t] != padding_idx:
                want[b, ids[b, t]] += g[b, t]
    whole = torch.full_like(want, float("nan"))
    _embedding_rule(emb, ids, g, Slot(lambda name: (whole, True)))
    assert torch.equal(whole, want)
    for per, start in ((1, 0), (3, 0), (7, 0), (4, 6)):
        got = torch.full_like(want, float("nan"))
        _embedding_rule(emb, ids, g, _RowChunks(got, per, start))
        assert torch.equal(got[:, start:], want[:, start:]), (per, start)


@pytest.mark.parametrize("chunk_bytes", [0, 1500], ids=["whole", "chunked"])
def test_fused_self_check_catches_rule_mismatch(chunk_bytes):
    model = doubled_up_proj(llama(tied=False))
    layout = select_parameters(model)
    batch = make_batch(34, **BATCH)
    with pytest.raises(ValueError, match=r"self-check failed for parameter 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        fused(model, layout, [(batch, np.ones(4), np.zeros(4, int))], chunk_bytes=chunk_bytes)


def test_fused_reduction_never_holds_all_blocks():
    """Untied model whose (B, P) block is larger than one chunk: at every fold, the blocks in flight are a small part
    of B × P."""
    model = llama(tied=False)
    layout = select_parameters(model)
    batch = make_batch(33, **BATCH)
    psg = PerSampleGrads(model, layout, check=False, chunk_bytes=4 * 4 * layout.P - 1)
    acc = MomentAccumulator(layout.P, "cpu")
    in_flight = []
    real_fold = acc.fold
    acc.fold = lambda offset, block: (
        in_flight.append(sum(b.numel() for b in psg._blocks.in_flight.values())),
        real_fold(offset, block),
    )
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    psg.accumulate(
        batch["input_ids"], batch["attention_mask"], fn, acc, np.ones(4), np.zeros(4, int), batch["position_ids"]
    )
    assert len(in_flight) == len(layout.entries)
    largest = max(e.numel for e in layout.entries)
    assert max(in_flight) <= 4 * largest < 4 * layout.P / 3


@pytest.mark.parametrize("chunk_bytes", [0, 1500], ids=["whole", "chunked"])
def test_tied_embedding_block_is_never_whole_beside_another(chunk_bytes):
    """Tied model: the LM-head call is held back until the embedding's gradient arrives. Without row chunks the
    embedding's (B, V, H) block is made then and folded at once, never in flight while another tensor folds; with
    row chunks it is never whole: each chunk of the LM head's rows gets the embedding's rows added and is folded
    (several chunks), and the state is the whole block's within the LM-head products' fp32 rounding."""
    model = llama(tied=True)
    layout = select_parameters(model)
    tied = "model.embed_tokens.weight"
    entry = layout.entry(tied)
    batch = make_batch(34, **BATCH)
    psg = PerSampleGrads(model, layout, check=True, chunk_bytes=chunk_bytes)
    acc = MomentAccumulator(layout.P, "cpu")
    seen = []
    real_fold = acc.fold
    acc.fold = lambda offset, block: (seen.append((offset, set(psg._blocks.in_flight))), real_fold(offset, block))
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    a, half = np.arange(4.0), np.array([0, 1, 0, 1])
    psg.accumulate(batch["input_ids"], batch["attention_mask"], fn, acc, a, half, batch["position_ids"])
    in_flight = [names for _, names in seen if tied in names]
    tied_folds = [o for o, _ in seen if entry.offset <= o < entry.offset + entry.numel]
    if chunk_bytes == 0:
        assert len(seen) == len(layout.entries) and in_flight == [{tied}]  # alone, at its own fold
        return
    assert in_flight == [] and len(tied_folds) > 1
    whole = fused(model, layout, [(batch, a, half)], chunk_bytes=0)
    cols = slice(entry.offset, entry.offset + entry.numel)
    for part in ("mean", "m2", "c"):
        got, want = getattr(acc, part)[:, cols], getattr(whole, part)[:, cols]
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), part


def test_compiled_fold_without_a_native_build_is_the_torch_compile_kernel(monkeypatch):
    """No C++ compiler for the native kernel: the torch.compile kernel folds, to the same float64 rounding."""
    rng = np.random.default_rng(13)
    S, A, half = rng.standard_normal((32, 50)).astype(np.float32), rng.standard_normal(32), np.arange(32) % 2
    states = []
    for native in (True, False):
        monkeypatch.setattr(accum, "native_fold", (lambda: None) if not native else accum.native_fold)
        acc = MomentAccumulator(50, "cpu", compiled=True)
        for b in range(0, 32, 8):
            acc.begin_batch(A[b : b + 8], half[b : b + 8])
            acc.fold(0, torch.from_numpy(S[b : b + 8]))
            acc.end_batch()
        assert acc.fold_path == "compiled"
        states.append(state(acc))
    assert_close(states[1], states[0], 1e-12)


def test_eager_fold_takes_a_smaller_later_batch():
    """Batches of 8, 2 and 8 samples folding blocks wider than the eager fold's step: the later batch of 2 folds
    four times the columns per step, and the reused workspace grows for it (no shape error); the state is numpy
    float64's moments."""
    P = 3 * (accum.FOLD_ELEMENTS["cpu"] // 8) + 5
    gen = np.random.default_rng(7)
    acc = MomentAccumulator(P, "cpu", compiled=False)
    blocks, advantages, halves = [], [], []
    for B in (8, 2, 8):
        block = gen.standard_normal((B, P)).astype(np.float32)
        a, half = gen.standard_normal(B), np.arange(B) % 2
        acc.begin_batch(a, half)
        acc.fold(0, torch.from_numpy(block))
        acc.end_batch()
        blocks.append(block)
        advantages.append(a)
        halves.append(half)
    want = numpy_moments(np.concatenate(blocks), np.concatenate(advantages), np.concatenate(halves))
    assert_close(state(acc), want, 1e-9)
