"""The layers' never-list (DESIGN.md section 3), read from the import graph of the source tree:

- covgrad never imports storage, tasks, flows, prefect, zarr or fsspec;
- storage never imports tasks or flows, nor the engine's rank groups (``torch.distributed``) outside the model
  loader (``storage.models``): runners that start or join ranks live in ``tasks.jobs``;
- tasks never import flows, the runners (``tasks.jobs``) never import prefect, and a task module imports no other
  task module except the shared ones (``tasks.common``, ``tasks.specs``, ``tasks.jobs``);
- no function of storage or tasks takes a ``spec: Any``: a spec parameter names its spec class (runners in
  ``tasks.jobs`` import ``tasks.specs``; storage takes the plain fields it needs instead);
- the offline environment has one home per side: ``covgrad.offline`` for Python, ``scripts/env.sh`` for the
  shell, which exports the same values.

Every import counts wherever it is in a file (lazy imports inside functions, ``TYPE_CHECKING`` blocks),
and the graph has no cycle. The check runs on any tree, so a test plants a violation of each rule in a
copy and sees it named.
"""

import ast
import os
import shutil
import subprocess
from pathlib import Path

from covgrad.offline import OFFLINE_ENV
from tests.helpers.pipeline import REPO

PACKAGES = ("covgrad", "storage", "tasks", "flows")
NEVER = {
    "covgrad": ("storage", "tasks", "flows", "prefect", "zarr", "fsspec"),
    "storage": ("tasks", "flows", "torch.distributed"),
    "tasks": ("flows",),
    "tasks.jobs": ("prefect",),
}
ALLOWED = {("storage.models", "torch.distributed")}  # the rank-aware policy load (load_rank_policy)
SHARED_TASK_MODULES = ("tasks.common", "tasks.specs", "tasks.jobs")
TYPED_SPECS = ("storage", "tasks")  # the layers whose spec parameters name their spec class


def imports(root: Path) -> dict[str, set[str]]:
    """Module -> every module it imports (``a.b`` of ``import a.b`` and of ``from a.b import c``, and
    ``a.b.c`` when that is a module of the tree), for each Python file of the packages under ``root``."""
    files = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for pkg in PACKAGES
        for p in sorted((root / pkg).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names} & set(files)
        graph[module] = found - {module}
    return graph


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def violations(graph: dict[str, set[str]]) -> set[str]:
    """One line per broken rule: ``<module> imports <name>: <rule>``."""
    out = set()
    for module, names in graph.items():
        layer = module.split(".")[0]
        for name in sorted(names):
            for part in (p for p in NEVER if _within(module, p)):
                banned = next((b for b in NEVER[part] if _within(name, b)), None)
                if banned is not None and (module, banned) not in ALLOWED:
                    out.add(f"{module} imports {name}: {part} never imports {banned}")
            shared = any(_within(module, s) or _within(name, s) for s in SHARED_TASK_MODULES)
            if layer == "tasks" and _within(name, "tasks") and name in graph and not shared:
                out.add(f"{module} imports {name}: a task module imports another task module")
    return out


def untyped_specs(root: Path) -> set[str]:
    """One line per parameter ``spec`` annotated ``Any`` in a function of the storage and tasks packages under
    ``root``: ``<module>.<function> takes spec: Any``."""
    out = set()
    for pkg in TYPED_SPECS:
        for path in sorted((root / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    hint = arg.annotation
                    text = hint.value if isinstance(hint, ast.Constant) else ast.unparse(hint) if hint else ""
                    if arg.arg == "spec" and text in ("Any", "typing.Any"):
                        out.add(f"{module}.{node.name} takes spec: Any")
    return out


IMPORTS = imports(REPO)


def test_the_tree_keeps_the_never_list():
    found = violations(IMPORTS)
    assert not found, sorted(found)


def test_spec_parameters_name_their_spec_class():
    found = untyped_specs(REPO)
    assert not found, sorted(found)


def test_no_import_cycle():
    graph = {m: {n for n in names if n in IMPORTS} for m, names in IMPORTS.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, f"import cycle: {' -> '.join([*stack, m, n])}"
            if n not in state:
                visit(n, [*stack, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_shell_exports_the_offline_environment():
    """``scripts/env.sh``, sourced in a bare environment, exports every variable of ``covgrad.offline.OFFLINE_ENV``
    with its value."""
    bare = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    script = f"source {REPO / 'scripts' / 'env.sh'} && env -0"
    done = subprocess.run(["bash", "-c", script], env=bare, capture_output=True, text=True, check=True)
    exported = dict(line.split("=", 1) for line in done.stdout.split("\0") if "=" in line)
    assert {k: exported.get(k) for k in OFFLINE_ENV} == OFFLINE_ENV


def test_a_planted_violation_of_each_rule_is_named(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert not violations(imports(tmp_path))
    untyped = untyped_specs(tmp_path)  # the tree's own (test_spec_parameters_name_their_spec_class names them)
    planted = {
        "covgrad/planted_a.py": "def f():\n    import zarr\n",
        "covgrad/planted_b.py": "from storage.artifacts import ArtifactStore\n",
        "covgrad/planted_c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prefect import flow\n",
        "storage/planted.py": "from tasks.common import StageResult\n",
        "storage/planted_ranks.py": "def f():\n    import torch.distributed as dist\n",
        "storage/planted_spec.py": "from typing import Any\ndef f(store, spec: Any) -> None:\n    pass\n",
        "tasks/planted.py": "from tasks.masks import masks_task\nfrom flows.pipeline import run_stages\n",
        "tasks/jobs/planted.py": "from prefect import task\n",
        "tasks/jobs/planted_spec.py": "def g(root: str, *, spec: 'Any') -> None:\n    pass\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).write_text(text)
    assert violations(imports(tmp_path)) == {
        "covgrad.planted_a imports zarr: covgrad never imports zarr",
        "covgrad.planted_b imports storage.artifacts: covgrad never imports storage",
        "covgrad.planted_c imports prefect: covgrad never imports prefect",
        "storage.planted imports tasks.common: storage never imports tasks",
        "storage.planted_ranks imports torch.distributed: storage never imports torch.distributed",
        "tasks.planted imports tasks.masks: a task module imports another task module",
        "tasks.planted imports flows.pipeline: tasks never imports flows",
        "tasks.jobs.planted imports prefect: tasks.jobs never imports prefect",
    }
    assert untyped_specs(tmp_path) - untyped == {
        "storage.planted_spec.f takes spec: Any",
        "tasks.jobs.planted_spec.g takes spec: Any",
    }


def test_no_test_module_imports_another():
    """Shared references and builders live in tests/helpers; a test module never imports another test module."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(REPO)} imports {n}"
                for n in names
                if n.startswith("tests.conftest") or n.split(".")[-1].startswith("test_")
            ]
    assert not found, found
