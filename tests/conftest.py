"""Shared fixtures: offline settings before anything imports prefect or transformers, one thread,
a tiny pipeline configuration, one tiny pipeline run per session (``tiny_run``: computed once, read or
copied by the stage, fault, report and CLI tests) and an opt-in Prefect test server (``prefect_server``; its
URL for CLI subprocesses: ``cli_api``).

Tiers: ``make test-fast`` (``-m "not slow and not integration"``, two xdist workers), ``make test`` (everything)."""

from covgrad.offline import offline_env

offline_env()  # covgrad.offline imports only os, so this runs before prefect or transformers loads


import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.pipeline import NO_OPTIONAL, run_planned, tiny_config  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(root, plan) of one uninterrupted tiny pipeline (``NO_OPTIONAL``), every stage computed by its task
    body, with its run index. Read-only: a test that changes artifacts copies ``root`` first."""
    from storage.artifacts import ArtifactStore
    from storage.runs import write_run_index
    from tasks.specs import plan

    root = tmp_path_factory.mktemp("tiny-run") / "root"
    cfg = tiny_config(str(root), **NO_OPTIONAL)
    results = run_planned(cfg)
    assert {r.computed for r in results.values()} == {True}
    p = plan(cfg)
    write_run_index(ArtifactStore(cfg.root), cfg, p.run_key, {n: r.ref for n, r in results.items()})
    return root, p


@pytest.fixture(scope="session")
def prefect_server():
    """A temporary Prefect API (SQLite) for tests that run flows; started once per session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def cli_api(prefect_server) -> str:
    """PREFECT_API_URL of the session's test server, for ``covgrad run`` subprocesses whose subject is not
    Prefect's temporary server: such a run then starts no server process and imports no server code (about
    12 of a cached tiny run's 30 CPU seconds). The temporary server keeps its own tests (signals, orphans,
    ports, read-only state, the cached run's output)."""
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())
