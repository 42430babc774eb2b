"""``covgrad plan`` for the whole run: the arithmetic of ``flows.runplan`` and the printed stage list."""

from flows.cli import main
from flows.runplan import PROCESS_BYTES, RunShape, ScoresShape, stage_sizes, tokens_batches

SHAPE = RunShape(
    P=1000, n_params=2000, dtype_bytes=4, vocab=50, samples={"policy": 16, "stale": 16}, T={"policy": 3, "stale": 3},
    mu={"policy": ("none", 8), "stale": ("full", 8)}, L=10, stats_instances=3, n_qs=4, tokens=True,
    update_check=True, demo=True, tokens_samples=16, tokens_modes=4, tokens_rows=7,
)  # fmt: skip
BASE = PROCESS_BYTES


def test_stage_sizes_follow_the_schema_arithmetic():
    scores = ScoresShape(job_bytes=123_456, store_bytes=48_000, artifacts=3, device="cpu", rows=False)
    rows = {r["stage"]: r for r in stage_sizes(SHAPE, scores)}
    assert list(rows) == ["base_model", "rollouts", "scores", "stats", "masks", "tokens", "update_check", "report"]
    assert rows["rollouts"]["disk"] == 2 * 16 * (4 * 10 + 9 * 3 + 40) + 16 * 3 * 50 * 4  # μ in full for stale
    assert rows["rollouts"]["peak"] == BASE + 2000 * 4 + 16 * 10 * 50 * 12
    assert rows["stats"]["disk"] == 7 * 8 * 1000 * 3 and rows["stats"]["peak"] == BASE + 28 * 1000
    assert rows["masks"]["disk"] == 6 * 4 * 1000
    assert rows["base_model"]["disk"] == 2000 * 4 * 2 and rows["base_model"]["peak"] == BASE + 2000 * 20
    # on cpu the scores job runs in the pipeline's process: its bytes are host bytes
    assert rows["scores"] == {"stage": "scores", "disk": 3 * 48_000, "peak": BASE + 123_456, "note": ""}
    # tokens: 16 samples in 4 batches of 4 rows; one (4, P) float32 block, two (P,) float64 sums, the logits
    assert tokens_batches(16) == (4, 4) and tokens_batches(200) == (16, 13) and tokens_batches(0) == (0, 0)
    assert rows["tokens"]["peak"] == BASE + 2000 * 4 + 4 * 4 * 1000 + 2 * 8 * 1000 + 4 * 10 * 50 * 12
    assert (
        rows["tokens"]["disk"] == 5 * 8 * 1000 and "218.8 KiB on disk while running"
    )  # 7 rows × 4 batches × 8·P in rows["tokens"]["note"]
    assert rows["update_check"]["peak"] == BASE + 2000 * 22 + 16 * 1000
    assert rows["report"]["peak"] == BASE + 4 * 1000 + 2 * 8 * 16 * 16  # no per-sample rows: no bootstrap
    with_rows = {r["stage"]: r for r in stage_sizes(SHAPE)}
    assert "scores" not in with_rows and with_rows["report"]["peak"] == rows["report"]["peak"] + 2 * 4 * 200 * 1000


def test_scores_on_cuda_hold_the_weights_on_the_host_and_the_job_on_the_device():
    scores = ScoresShape(job_bytes=5 * 2**30, store_bytes=1, artifacts=1, device="cuda", rows=True)
    row = next(r for r in stage_sizes(SHAPE, scores) if r["stage"] == "scores")
    assert row["peak"] == BASE + 2000 * 4 and row["note"] == "device: 5.0 GiB per job"


def test_smollm2_full_plan_matches_the_measured_scores_peak():
    """The memory model's arithmetic for configs/smollm2_full.yaml (SmolLM2-135M's shape, every parameter,
    B = 16 at L = 52, float64 state in five blocks on a CPU) is within 25% of the measured 5.36 GiB peak of
    the scores stage (docs/memory.md), and so is every other stage's measured peak."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from covgrad.distributed.shardplan import ModelShape, Workload, make_plan
    from covgrad.layout import select_parameters

    V = 49152
    config = LlamaConfig(
        vocab_size=V, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    layout, shape = select_parameters(model), ModelShape.of(model)
    assert layout.P == 134_515_008
    work = Workload(B=16, L=52, N=256, n_batches=16, state_dtype="float64", device="cpu", byte_budget=0,
                    equal_batches=True)  # fmt: skip
    chosen = make_plan(layout, shape, work, (1, 5), workers=1, device_bytes=24 * 10**9)
    run = RunShape(
        P=layout.P, n_params=layout.P, dtype_bytes=4, vocab=V, samples={"policy": 256}, T={"policy": 8},
        mu={"policy": ("none", 0)}, L=52, stats_instances=1, n_qs=4, tokens=True, update_check=True, demo=False,
        tokens_samples=16, tokens_modes=1, tokens_rows=4,
    )  # fmt: skip
    scores = ScoresShape(chosen.need, chosen.store_bytes, 1, "cpu", rows=False)
    peaks = {r["stage"]: int(r["peak"]) / 2**30 for r in stage_sizes(run, scores)}
    measured = {"rollouts": 1.43, "scores": 5.36, "stats": 4.27, "masks": 2.01, "tokens": 5.45,
                "update_check": 4.92, "report": 1.35}  # fmt: skip
    for stage, gib in measured.items():
        assert abs(peaks[stage] / gib - 1) <= 0.25, (stage, peaks[stage], gib)


def test_plan_counts_the_task_prompts_and_lists_every_stage(capsys):
    assert main(["plan", "--config", "configs/tiny.yaml", "--device", "cpu"]) in (0, 1)
    out = capsys.readouterr().out
    assert "prompt length: 5 tokens (longest of the task's 8 prompts)" in out, out
    for stage in ("base_model", "rollouts", "scores", "stats", "masks", "tokens", "update_check", "report"):
        assert f"  {stage} " in out, stage
    assert "scores artifacts:" in out and "time: unknown" in out and "total disk" in out
