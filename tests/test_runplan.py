"""``covgrad plan`` for the whole run: the arithmetic of ``flows.runplan`` and the printed stage list."""

from flows.cli import main
from flows.runplan import RunShape, stage_sizes

SHAPE = RunShape(
    P=1000, n_params=2000, dtype_bytes=4, vocab=50, samples={"policy": 16, "stale": 16}, T={"policy": 3, "stale": 3},
    mu={"policy": ("none", 8), "stale": ("full", 8)}, L=10, stats_instances=3, n_qs=4, tokens=True,
    update_check=True, demo=True,
)  # fmt: skip


def test_stage_sizes_follow_the_schema_arithmetic():
    rows = {r["stage"]: r for r in stage_sizes(SHAPE)}
    assert list(rows) == ["base_model", "rollouts", "stats", "masks", "tokens", "update_check", "report"]
    assert rows["rollouts"]["disk"] == 2 * 16 * (4 * 10 + 9 * 3 + 40) + 16 * 3 * 50 * 4  # μ in full for stale
    assert rows["stats"]["disk"] == 7 * 8 * 1000 * 3
    assert rows["masks"]["disk"] == 6 * 4 * 1000
    assert rows["base_model"]["disk"] == 2000 * 4 * 2 and rows["base_model"]["peak"] == 2000 * 20
    assert rows["report"]["peak"] == 2 * 4 * 200 * 1000 + 2 * 8 * 16 * 16


def test_plan_counts_the_task_prompts_and_lists_every_stage(capsys):
    assert main(["plan", "--config", "configs/tiny.yaml", "--device", "cpu"]) in (0, 1)
    out = capsys.readouterr().out
    assert "prompt length: 5 tokens (longest of the task's 8 prompts)" in out, out
    for stage in ("base_model", "rollouts", "stats", "masks", "tokens", "update_check", "report"):
        assert f"  {stage} " in out, stage
    assert "scores artifacts:" in out and "time: unknown" in out and "total disk" in out
