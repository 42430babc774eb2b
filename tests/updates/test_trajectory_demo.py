"""configs/demo.yaml's trajectory: one short whole run that leaves every other artifact key of the demo as it was."""

import yaml

from covgrad.config import PipelineConfig
from tasks.specs import plan
from tests.helpers.pipeline import REPO


def test_the_demo_adds_one_short_trajectory_and_keeps_the_other_keys():
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    t = PipelineConfig.model_validate(demo).trajectory
    assert (t.enabled, t.steps, t.optimizer, t.precision, t.regime, t.data) == (
        True,
        32,
        "adam",
        "bf16",
        "rl",
        "on_policy",
    )
    without = {k: v for k, v in demo.items() if k != "trajectory"}
    p0, p1 = plan(PipelineConfig.model_validate(without)), plan(PipelineConfig.model_validate(demo))
    assert set(p1) - set(p0) == {"trajectory"}
    assert {n: p0[n].ref.key for n in p0 if n != "report"} == {n: p1[n].ref.key for n in p0 if n != "report"}
    assert p0["report"].ref.key != p1["report"].ref.key  # the report shows the trajectory
    assert p1["trajectory"].upstream["regimes"] == p1["regimes"].ref  # regime rl is the demo's regimes entry rl
