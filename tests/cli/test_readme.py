"""The README and docs/ as written: every command in their fenced bash blocks names a real subcommand, flag,
config key, make target, module and path; the README stays a front door (≤ 15,000 bytes, a layout entry
for every top-level folder); every docs/ table is headed by the command that reproduces it and its machine.

Commands are checked, not run: ``covgrad <sub> ...`` (also ``python -m flows.cli <sub> ...``) against
``python -m flows.cli <sub> --help``, its ``--set KEY=VALUE`` keys against the key listing of
``covgrad run --help``; ``make <target>`` against the Makefile's targets; ``python -m X`` by finding X (and,
in the slow tier, running ``python -m benchmarks.<name> --help`` for its flags); a path by its existence.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
README_LIMIT = 15_000

# Keys renamed to the section of the stages they drive: the old names must not appear in the docs.
from covgrad.config import MOVED as RENAMED  # noqa: E402
from covgrad.offline import OFFLINE_ENV  # noqa: E402

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
# configs/..., scripts/..., notebooks/..., docs/... mentioned anywhere (not inside an absolute path or URL)
REPO_PATH = re.compile(
    r"(?<![\w/.:-])((?:configs|scripts|notebooks|docs|benchmarks|covgrad|storage|tasks|flows)/[\w./-]*[\w/])(?![\w/-]|\.\w|…)"
)  # whole names only; one followed by "…" is a prefix (a tracker tag), not a path
TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
SEPARATORS = {"&&", "||", ";", "|"}
PYTHONS = {"python", "python3", "python3.11", "python3.12"}


def fenced(path: Path, language: str) -> list[str]:
    """The bodies of ``path``'s fenced code blocks in ``language`` ("" for blocks without one)."""
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def commands(block: str) -> list[list[str]]:
    """Each simple command of a bash block as argv: continuation lines joined, comments, ``$`` prompts and
    leading ``VAR=value`` assignments dropped, ``&&``/``;``/``|`` chains split."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["$"]:
            words = words[1:]
        current: list[str] = []
        for word in [*words, ";"]:
            if word not in SEPARATORS:
                current.append(word)
                continue
            while current and re.fullmatch(r"[A-Za-z_]\w*=.*", current[0]):
                current.pop(0)
            if current:
                out.append(current)
            current = []
    return out


def program(argv: list[str]) -> str:
    return argv[0].rsplit("/", 1)[-1]


@cache
def cli_help(*sub: str) -> str:
    """``python -m flows.cli [sub] --help`` as printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **OFFLINE_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *sub, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def subcommands() -> set[str]:
    choices = re.search(r"\{([\w,-]+)\}", cli_help())
    assert choices, cli_help()
    return set(choices.group(1).split(","))


def config_keys() -> list[str]:
    """The dotted keys ``covgrad run --help`` lists (``KEY = default`` lines and ``KEY  (default: ...)`` maps)."""
    keys = []
    for line in cli_help("run").splitlines():
        m = re.match(r"^([a-z_][\w.<>]*)(?: = |  \(default: )", line)
        if m:
            keys.append(m.group(1))
    assert len(keys) > 40, "covgrad run --help lists no config keys"
    return keys


def is_config_key(key: str) -> bool:
    listed = [re.compile(re.escape(k).replace(re.escape("<name>"), r"[^.]+") + r"\Z") for k in config_keys()]
    return any(p.match(key) for p in listed)


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


def problems(argv: list[str]) -> list[str]:
    """What is wrong with one command (empty when it checks out or is not covgrad's to check)."""
    name = program(argv)
    if name in PYTHONS and argv[1:2] == ["-m"]:
        module = argv[2]
        try:  # the module's file is found (its parent packages import); the slow test below runs each one
            spec = importlib.util.find_spec(module)
        except ImportError as exc:
            return [f"python -m {module}: {type(exc).__name__}: {exc}"]
        if spec is None:
            return [f"python -m {module}: no such module"]
        if module == "flows.cli":
            return problems(["covgrad", *argv[3:]])
        return []
    if name in PYTHONS or name in {"bash", "sh", "source", "."}:
        script = next((a for a in argv[1:] if not a.startswith("-")), None)
        if script is not None and not (REPO / script).exists():
            return [f"{' '.join(argv)}: no file {script}"]
        return []
    if name == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        return [f"make {t}: no such Makefile target" for t in targets if t not in makefile_targets()]
    if name != "covgrad":
        return []
    sub = argv[1] if len(argv) > 1 else ""
    if sub not in subcommands():
        return [f"covgrad {sub}: no such subcommand (known: {sorted(subcommands())})"]
    flags = set(re.findall(r"(?<![\w-])--[\w-]+", cli_help(sub)))
    found = []
    words = argv[2:]
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        flag, _, inline = word.partition("=")
        if flag not in flags:
            found.append(f"covgrad {sub} {flag}: not in `covgrad {sub} --help`")
        if flag == "--set":
            value = inline or (words[i + 1] if i + 1 < len(words) else "")
            key = value.partition("=")[0]
            if not is_config_key(key):
                found.append(f"covgrad {sub} --set {key}=...: not a config key of `covgrad run --help`")
    return found


def doc_commands(path: Path) -> list[list[str]]:
    """Every command of ``path``: its bash blocks and the backticked command of each ``Command:`` line."""
    found = [argv for block in fenced(path, "bash") for argv in commands(block)]
    for m in re.finditer(r"^Command: `([^`]+)`", path.read_text(), re.M):
        found += commands(m.group(1))
    return found


def test_readme_is_a_front_door():
    size = README.stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes, the limit is {README_LIMIT}: move detail to docs/"
    text = README.read_text()
    for words in ("load average", "an earlier run", "re-measured"):
        assert words not in text.lower(), f"README.md carries measurement narrative: {words!r}"
    for doc in DOCS:
        assert f"(docs/{doc.name})" in text, f"README.md does not link docs/{doc.name}"


def test_readme_commands_name_real_subcommands_flags_keys_targets_and_paths():
    argvs = [argv for block in fenced(README, "bash") for argv in commands(block)]
    assert len(argvs) >= 8, argvs
    names = {program(a) for a in argvs}
    assert {"covgrad", "make"} <= names, names
    assert {"demo", "test", "test-fast"} <= {a[1] for a in argvs if program(a) == "make"}
    found = [p for argv in argvs for p in problems(argv)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_commands_name_real_subcommands_flags_keys_targets_and_paths(doc: Path):
    found = [p for argv in doc_commands(doc) for p in problems(argv)]
    assert not found, "\n".join(found)


# Prints {module: its --help text} for the modules named in argv, all in one interpreter (one torch import).
HELPS = r"""
import contextlib, io, json, runpy, sys
helps = {}
for module in sys.argv[1:]:
    out, sys.argv = io.StringIO(), [module, "--help"]
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    helps[module] = out.getvalue()
print(json.dumps(helps))
"""


@pytest.mark.slow
def test_benchmark_commands_use_real_flags():
    """``python -m benchmarks.<name> --flag`` lines: the benchmark imports, and its ``--help`` lists each flag."""
    argvs = [a for p in [README, *DOCS] for a in doc_commands(p)]
    runs = [a for a in argvs if program(a) in PYTHONS and a[1:2] == ["-m"] and a[2].startswith("benchmarks.")]
    assert runs
    env = {**os.environ, "PYTHONPATH": str(REPO), **OFFLINE_ENV}
    modules = sorted({argv[2] for argv in runs})
    cmd = [sys.executable, "-c", HELPS, *modules]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    helps = json.loads(done.stdout.splitlines()[-1])
    for argv in runs:
        module = argv[2]
        assert "usage:" in helps[module], f"python -m {module} --help printed no usage: {helps[module]!r}"
        flags = set(re.findall(r"(?<![\w-])--[\w-]+", helps[module]))
        unknown = [w.partition("=")[0] for w in argv[3:] if w.startswith("--") and w.partition("=")[0] not in flags]
        assert not unknown, f"python -m {module}: {unknown} not in its --help"


def test_docs_and_readme_use_the_renamed_keys():
    for path in [README, *DOCS]:
        text = path.read_text()
        for old, new in RENAMED.items():
            assert old not in text, f"{path.name} names {old}; the key is {new}"


def exists(path: str) -> bool:
    return (REPO / path).exists()


def test_paths_mentioned_exist():
    for path in [README, *DOCS]:
        missing = sorted({p for p in REPO_PATH.findall(path.read_text()) if not exists(p)})
        assert not missing, f"{path.name} names paths that do not exist: {missing}"


def test_layout_names_every_top_level_folder_and_file_group():
    text = README.read_text()
    section = text.split("## Layout", 1)[1]
    tree = fenced_from(section)
    entries = {line.split()[0].split("/")[0] for line in tree.splitlines() if line and not line[0].isspace()}
    for entry in entries:
        assert (REPO / entry).exists(), f"README layout names {entry}, which does not exist"
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    top = {f.split("/")[0] for f in listed.stdout.splitlines()} - {"README.md", ".gitignore"}
    assert top, "git ls-files listed nothing"
    assert not top - entries, f"README layout omits {sorted(top - entries)}"


def fenced_from(text: str) -> str:
    """The first fenced block of ``text``."""
    m = FENCE.search(text)
    assert m, "no fenced block"
    return m.group(2)


def test_readme_python_imports_exist():
    """Every ``from X import Y`` of the README's Python snippets names a module and an attribute that exist."""
    blocks = fenced(README, "python")
    assert blocks
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


# A measured number in a table cell: a decimal, or an integer with a unit of time, memory or ratio.
MEASURED = re.compile(r"(?<![\w.])\d+\.\d+|(?<![\w.])\d+\s?(s|ms|min|GiB|MiB|GB|MB|KiB|x|×|%)(?!\w)")


def table_rows(lines: list[str], i: int) -> list[str]:
    """The body rows of the table whose header is ``lines[i]``."""
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def unheaded_tables(text: str) -> list[str]:
    """The tables of measurements (a cell holds a measured number) of a markdown text, by line number, with no
    ``Command: `...` `` line or no ``Machine:`` line between them and the heading or table before them.
    Tables of definitions (formulas, field names) need no command."""
    lines = text.splitlines()
    found, start = [], 0  # start: first line after the last heading or table
    for i, line in enumerate(lines):
        table_starts = line.startswith("|") and i + 1 < len(lines) and TABLE_RULE.match(lines[i + 1])
        measured = table_starts and any(MEASURED.search(row) for row in table_rows(lines, i))
        if measured and not (i > 0 and lines[i - 1].startswith("|")):
            head = lines[start:i]
            if not any(re.match(r"Command: `[^`]+`", h) for h in head):
                found.append(f"line {i + 1}: no Command: line")
            if not any(h.startswith("Machine: ") for h in head):
                found.append(f"line {i + 1}: no Machine: line")
        if line.startswith(("#", "|")):
            start = i + 1
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_docs_table_is_headed_by_its_command_and_machine(doc: Path):
    found = unheaded_tables(doc.read_text())
    assert not found, f"{doc.name}: " + "; ".join(found)


def test_command_checker_refuses_what_does_not_exist():
    """The checks above fail on a planted mistake of each kind."""
    assert problems(["covgrad", "nosuch"])
    assert problems(["covgrad", "run", "--no-such-flag"])
    assert problems(["covgrad", "run", "--set", "scores.no_such_key=1"])
    assert problems(["make", "no-such-target"])
    assert problems([".venv/bin/python", "-m", "benchmarks.no_such_module"])
    assert problems(["bash", "scripts/no_such_script.sh"])
    assert not problems(["covgrad", "run", "--set", "rollouts.samplers.policy.group_size=16"])
    assert not problems(["covgrad", "run", "--set=model.params=null", "--root", "r"])
    assert exists("flows/shards.py")
    assert not exists("configs/no_such.yaml")
    table = "| a | b |\n|---|---|\n| 1.5 | 2 s |\n"
    assert unheaded_tables("# T\n\n" + table) == ["line 3: no Command: line", "line 3: no Machine: line"]
    assert unheaded_tables("# T\n\n| field | meaning |\n|---|---|\n| `x_t` | A_t − b_t |\n") == []
    assert unheaded_tables("Command: `covgrad ls`\nMachine: any\n\n" + table + "\n" + table) == [
        "line 8: no Command: line",
        "line 8: no Machine: line",
    ]
    assert commands("A=1 B=2 covgrad ls --root r && make test  # note") == [
        ["covgrad", "ls", "--root", "r"],
        ["make", "test"],
    ]
