"""Stage specs are what each stage computes from and what its key covers; tasks see specs, never the config
(the import graph's rules are tests/flows/test_layering.py's).

The key-coverage test is derived, not listed: it walks every leaf field of ``PipelineConfig``, changes it,
and checks that the artifact keys that change are exactly those of the stages whose (hashed) spec changed
and of everything below them in the plan.
"""

import inspect
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from covgrad.config import PipelineConfig
from tasks.specs import STAGES, Plan, StageSpec, plan

REPO = Path(__file__).resolve().parents[2]


def leaves(model: BaseModel, prefix: tuple = ()) -> list[tuple[tuple, Any, Any]]:
    """(path, value, annotation) of every leaf field of a config model: sections and the samplers dict are
    walked into, tuples element by element."""
    out = []
    for name, field in type(model).model_fields.items():
        value, path = getattr(model, name), (*prefix, name)
        if isinstance(value, BaseModel):
            out += leaves(value, path)
        elif isinstance(value, dict) and all(isinstance(v, BaseModel) for v in value.values()):
            for key, sub in value.items():
                out += leaves(sub, (*path, key))
        elif isinstance(value, tuple):
            out += [((*path, i), v, type(v)) for i, v in enumerate(value)]
        else:
            out.append((path, value, field.annotation))
    return out


def _literals(annotation: Any) -> list[Any]:
    """The options of a Literal or optional Literal annotation (none for other types)."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return [x for arg in get_args(annotation) for x in _literals(arg)]
    return []


def candidates(value: Any, annotation: Any, strings: list[str]) -> list[Any]:
    """Other values to try for a leaf, most ordinary first; the first one the config accepts is used."""
    options = _literals(annotation)
    if options:
        return [o for o in options if o != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1]
    if isinstance(value, float):
        return [value / 2, (value + 1) / 2, value * 2 + 1]
    if isinstance(value, list):
        return [value[:-1]] if len(value) > 1 else [value * 2]
    if value is None:
        return [*strings, ["probe"], 0.5]
    return [s for s in strings if s != value] + [f"{value}x"]


def changed(data: dict, path: tuple, value: Any) -> dict:
    out = json.loads(json.dumps(data))
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value  # a list node: one element of a tuple field
    return out


def _upstream_names(p: Plan) -> dict[str, set[str]]:
    by_key = {s.ref.key: n for n, s in p.items()}
    return {n: {by_key[r.key] for r in s.upstream.values()} for n, s in p.items()}


def _expected(p0: Plan, p1: Plan) -> set[str]:
    """Instances (planned in both) whose hashed spec or upstream instances changed, and everything below."""
    up0, up1 = _upstream_names(p0), _upstream_names(p1)
    out: set[str] = set()
    for n in p1:  # DAG order: upstreams first
        if n not in p0:
            continue
        own = p0[n].spec.hashed() != p1[n].spec.hashed() or up0[n] != up1[n]
        if own or up1[n] & out:
            out.add(n)
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two base configs that between them let every leaf change validly: the demo (three samplers, the
    stale checkpoint) and a user model with a JSONL task and imported rollouts, scored by two torchrun machines, with
    an external run's trajectory."""
    tmp = tmp_path_factory.mktemp("specs")
    dirs = []
    for name in ("model-a", "model-b"):
        d = tmp / name
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        dirs.append(str(d))
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["root"] = str(tmp / "root")
    demo["trajectory"] = {"enabled": True}  # a disabled stage's leaves are in no planned spec
    # a regime whose every leaf can change, and a name trajectory.regime can take
    demo["regimes"] = {"stale": {"kind": "distill_sampled", "teacher": "stale", "max_length": 4, "kl_beta": 0.5}}
    user = {
        "root": str(tmp / "root"),
        "model": {"path": dirs[0], "max_length": 2048},  # set: it can change
        "task": {"kind": "jsonl", "path": "task.jsonl", "reward": "m:f"},
        "rollouts": {
            "samplers": {
                "policy": {},
                "engine": {"import_path": "e.jsonl", "on_policy": True},
                "other": {"import_path": "o.jsonl", "mu_model": dirs[1]},
            }
        },
        # two torchrun machines: the fields only a torchrun group has can change
        "scores": {"launcher": "torchrun", "ranks": 2, "nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400"},
        # an external run, whose history only it can have
        "trajectory": {"enabled": True, "checkpoints": "series"},
    }
    strings = [*dirs, "m:g", "stale", "engine", "tcp://127.0.0.1:1", "127.0.0.1:29401"]
    return [PipelineConfig.model_validate(d).model_dump(mode="json") for d in (demo, user)], strings


def test_every_config_leaf_changes_exactly_the_keys_of_the_specs_that_hold_it(bases):
    """For every leaf of PipelineConfig: the keys that change are those of the stages whose spec holds it
    (placement fields aside) and of their descendants; only ``root`` and the trackers (locations: where artifacts
    are stored, where ``covgrad run`` logs their scalars) are in no spec."""
    datas, strings = bases
    tried: dict[str, str] = {}
    in_no_spec = set()
    for data in datas:
        cfg0 = PipelineConfig.model_validate(data)
        p0 = plan(cfg0)
        for path, value, annotation in leaves(cfg0):
            label = ".".join(map(str, path))
            if label in tried:
                continue
            for new in candidates(value, annotation, strings):
                try:
                    cfg1 = PipelineConfig.model_validate(changed(data, path, new))
                except ValidationError:
                    continue
                p1 = plan(cfg1)
                expected = _expected(p0, p1)
                keys = {n for n in p1 if n in p0 and p0[n].ref.key != p1[n].ref.key}
                assert keys == expected, f"{label}: {value!r} -> {new!r}: keys changed {keys}, specs say {expected}"
                if not expected and set(p0) == set(p1):
                    in_no_spec.add(label)
                tried[label] = f"{value!r} -> {new!r}"
                break
    every = {".".join(map(str, path)) for data in datas for path, _, _ in leaves(PipelineConfig.model_validate(data))}
    missed = {_field(x) for x in every} - {_field(x) for x in tried}
    assert not missed, f"leaves no candidate value could change: {sorted(missed)}"
    assert in_no_spec == {"root", "trackers.tensorboard", "trackers.wandb", "trackers.mlflow", "trackers.trackio"}, (
        in_no_spec
    )


def _field(label: str) -> str:
    """A leaf's field: a sampler field is covered when it could be changed on some sampler (``on_policy``
    needs ``import_path``)."""
    return re.sub(r"^rollouts\.samplers\.[^.]+\.", "rollouts.samplers.*.", label)


def test_tokens_key_covers_the_parameter_selection(bases):
    """The stale-cache bug this layout fixes: tokens reads model.params, so its key changes with it."""
    data = bases[0][0]
    before = plan(PipelineConfig.model_validate(data))
    after = plan(PipelineConfig.model_validate(changed(data, ("model", "params"), ["model.layers.0.*"])))
    assert before.tokens.ref.key != after.tokens.ref.key
    assert before.tokens.spec.params is None and after.tokens.spec.params == ["model.layers.0.*"]


def test_placement_fields_change_no_artifact_key_below_the_report(bases):
    """Device, checkpoint cadence, parameter blocks and the dask scheduler never change a byte: the specs
    record them, the keys leave them out (the report's spec holds the whole config it renders)."""
    data = bases[0][0]
    before = plan(PipelineConfig.model_validate(data))
    for path, value in (
        (("model", "device"), "cpu"),
        (("scores", "checkpoint_batches"), 3),
        (("scores", "shards"), [1, 2]),
        (("dask", "address"), "tcp://127.0.0.1:1"),
    ):
        after = plan(PipelineConfig.model_validate(changed(data, path, value)))
        assert [n for n in before if before[n].ref.key != after[n].ref.key] == ["report"], path


def _stage_tasks() -> dict[str, Any]:
    import importlib
    import pkgutil

    from prefect import Task

    import tasks

    out = {}
    for info in pkgutil.iter_modules(tasks.__path__):  # the stage modules and the shared ones (they hold no task)
        module = importlib.import_module(f"tasks.{info.name}")
        out |= {v.name: v for v in vars(module).values() if isinstance(v, Task)}
    return out


def test_stage_tasks_take_a_spec_and_upstream_refs_never_the_config():
    """Each stage task's signature is (ref, spec: <Stage>Spec, upstream): the config cannot come back."""
    from storage.artifacts import ArtifactRef

    tasks = _stage_tasks()
    assert len(tasks) == len(STAGES), sorted(tasks)
    for name, task in tasks.items():
        params = list(inspect.signature(task.fn).parameters)
        hints = typing.get_type_hints(task.fn)
        assert params == ["ref", "spec", "upstream"], (name, params)
        assert hints["ref"] is ArtifactRef and hints["upstream"] == dict[str, ArtifactRef], name
        spec = hints["spec"]
        assert issubclass(spec, StageSpec) and task.name == spec.STAGE, (name, spec)
        assert PipelineConfig not in hints.values(), name


def test_stage_order_is_the_plans_and_the_flow_has_a_task_per_stage():
    """The stages (``Plan``'s stage fields, in DAG order) are the stage specs in the order specs.py defines
    them; ``flows.pipeline.TASKS`` has one task per stage; and the plan lists each step after its upstreams."""
    import flows.pipeline

    assert list(STAGES) == [cls.STAGE for cls in StageSpec.__subclasses__()]
    assert sorted(t.name for t in flows.pipeline.TASKS) == sorted(STAGES)
    assert len((REPO / "flows" / "pipeline.py").read_text().splitlines()) <= 90


def test_the_plan_runs_upstream_first(bases):
    for data in bases[0]:
        p = plan(PipelineConfig.model_validate(data))
        seen: set[str] = set()
        for name, step in p.items():
            assert {r.key for r in step.upstream.values()} <= seen, name
            seen.add(step.ref.key)
        order = [STAGES.index(step.spec.STAGE) for step in p.values()]
        assert order == sorted(order)
