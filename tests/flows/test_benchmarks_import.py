"""Every benchmark script imports: they are not run by the suite, so an API they call that moves or goes
away would otherwise only show when someone next measures."""

import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted(p.stem for p in (Path(__file__).parents[2] / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports(name: str):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"


GPU_IMAGE_LACKS = ("zarr", "numcodecs", "dask", "distributed", "prefect", "pydantic", "pydantic_settings")


@pytest.mark.slow
def test_gpu_check_runs_without_the_pipeline_packages(tmp_path: Path):
    """``scripts/gpu_check.sh --dry-run`` with zarr, dask, prefect and pydantic unimportable (the GPU image
    has none of them): the cuda tests, benchmarks.scores, benchmarks.regimes and benchmarks.inrun import, the tests
    skip here, the script exits 0."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).parents[2]
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        f"LACKS = {GPU_IMAGE_LACKS!r}\n"
        "class Lacks(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in LACKS:\n"
        "            raise ImportError(f'not on the GPU image: {name}')\n"
        "sys.meta_path.insert(0, Lacks())\n"
    )
    probe = tmp_path / "py"
    probe.write_text(f'#!/bin/sh\nPYTHONPATH="{shim}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    probe.chmod(0o755)
    env = {**os.environ, "PY": str(probe), "OUT": str(tmp_path / "out")}
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=repo, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "skipped" in (tmp_path / "out" / "cuda_tests.txt").read_text()
    check = subprocess.run(
        [str(probe), "-c", "import benchmarks.scores, benchmarks.regimes, benchmarks.inrun; import zarr"],
        cwd=repo,
        env={**env, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
    )
    assert "not on the GPU image: zarr" in check.stderr  # the shim works: the benchmarks imported before it
