"""The layers' never-list (DESIGN.md section 3), read from the import graph of the source tree:

- covgrad never imports storage, tasks, flows, prefect, zarr or fsspec;
- storage never imports tasks or flows;
- tasks never import flows, and a task module imports no other task module except the shared ones
  (``tasks.common``, ``tasks.specs``).

Every import counts wherever it is in a file (lazy imports inside functions, ``TYPE_CHECKING`` blocks),
and the graph has no cycle. The check runs on any tree, so a test plants a violation of each rule in a
copy and sees it named.
"""

import ast
import shutil
from pathlib import Path

from tests.helpers.pipeline import REPO

PACKAGES = ("covgrad", "storage", "tasks", "flows")
NEVER = {
    "covgrad": ("storage", "tasks", "flows", "prefect", "zarr", "fsspec"),
    "storage": ("tasks", "flows"),
    "tasks": ("flows",),
}
SHARED_TASK_MODULES = ("tasks.common", "tasks.specs", "tasks.jobs")


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
            banned = next((p for p in NEVER.get(layer, ()) if _within(name, p)), None)
            if banned is not None:
                out.add(f"{module} imports {name}: {layer} never imports {banned}")
            shared = module in SHARED_TASK_MODULES or any(_within(name, s) for s in SHARED_TASK_MODULES)
            if layer == "tasks" and _within(name, "tasks") and name in graph and not shared:
                out.add(f"{module} imports {name}: a task module imports another task module")
    return out


IMPORTS = imports(REPO)


def test_the_tree_keeps_the_never_list():
    found = violations(IMPORTS)
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


def test_a_planted_violation_of_each_rule_is_named(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert not violations(imports(tmp_path))
    planted = {
        "covgrad/planted_a.py": "def f():\n    import zarr\n",
        "covgrad/planted_b.py": "from storage.artifacts import ArtifactStore\n",
        "covgrad/planted_c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prefect import flow\n",
        "storage/planted.py": "from tasks.common import StageResult\n",
        "tasks/planted.py": "from tasks.masks import masks_task\nfrom flows.pipeline import run_stages\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).write_text(text)
    assert violations(imports(tmp_path)) == {
        "covgrad.planted_a imports zarr: covgrad never imports zarr",
        "covgrad.planted_b imports storage.artifacts: covgrad never imports storage",
        "covgrad.planted_c imports prefect: covgrad never imports prefect",
        "storage.planted imports tasks.common: storage never imports tasks",
        "tasks.planted imports tasks.masks: a task module imports another task module",
        "tasks.planted imports flows.pipeline: tasks never imports flows",
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
