"""Running a tiny pipeline up to a stage."""

from tasks.specs import plan
from tests.helpers.pipeline import run_planned

POLICY_ONLY = {"rollouts.samplers": {"policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 16}}}


def run_upto(cfg, target: str) -> dict:
    """Run ``target`` and the planned steps it depends on, in plan order, by calling the task bodies."""
    steps = plan(cfg)
    names = {s.ref.key: n for n, s in steps.items()}
    needed, stack = set(), [target]
    while stack:
        name = stack.pop()
        if name not in needed:
            needed.add(name)
            stack.extend(names[r.key] for r in steps[name].upstream.values())
    return {n: r.ref for n, r in run_planned(cfg, needed).items()}
