"""``covgrad`` command line: run the pipeline, list, verify and clean artifacts, rebuild reports, diff checkpoints.

Every expected failure (bad input, damaged artifact, reward error) ends in one line on stderr naming
the cause and where, exit status 2; the full traceback goes to a log file that line names. The config
is read and validated before anything heavy (torch, Prefect) is imported. SIGINT and SIGTERM stop the
run and every child process (e.g. the temporary Prefect server); a rerun resumes.
"""

import argparse
import datetime as dt
import errno
import logging
import os
import pickle
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from covgrad.offline import offline_env

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def quiet_prefect() -> None:
    """Prefect logging for ``covgrad run``, set before prefect is imported: warnings only, except the
    flow run's own lines (one per stage). Task-run INFO lines (state changes, each stage's computed
    line, progress) still reach a worker's log and the API under a deployment, where this is not set."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "WARNING")
    # The temporary server is a subprocess writing to this terminal; stopping it races its event flush,
    # which then logs a ~150-line ERROR traceback of a cancelled database session; the server and its
    # database are discarded right after.
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
    # The same race can surface as sqlalchemy's pool logging the cancelled session (~30 lines) through the
    # root logger, which Prefect's settings cannot set per logger: a copy of Prefect's logging config that
    # only adds the sqlalchemy logger at CRITICAL.
    if "PREFECT_LOGGING_SETTINGS_PATH" not in os.environ:
        os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(_logging_settings())


def _logging_settings() -> Path:
    """Prefect's default ``logging.yml`` (read without importing prefect) with ``sqlalchemy`` at CRITICAL,
    written beside this invocation's log file."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("prefect is not installed; run `make install`")
    default = Path(spec.submodule_search_locations[0]) / "logging" / "logging.yml"
    config = yaml.safe_load(default.read_text())
    config["loggers"]["sqlalchemy"] = {"level": "CRITICAL"}
    path = log_path().with_suffix(".prefect-logging.yml")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


_LOG_PATH: Path | None = None


def log_path() -> Path:
    """This invocation's log file (created on first use): ``$COVGRAD_LOG_DIR`` or {tmp}/covgrad-logs."""
    global _LOG_PATH
    if _LOG_PATH is None:
        directory = Path(os.environ.get("COVGRAD_LOG_DIR") or Path(tempfile.gettempdir()) / "covgrad-logs")
        directory.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        _LOG_PATH = directory / f"covgrad-{stamp}-{os.getpid()}.log"
    return _LOG_PATH


class _NoFailures(logging.Filter):
    """Drops ERROR records and Prefect's "Finished in state Failed(...)" lines (they repeat the cause)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return False
        return not str(record.msg).startswith(("Finished in state Failed", "Finished in state Crashed"))


def stop_prefect_server() -> None:
    """Stop the temporary Prefect server ``covgrad run`` started, if any, after sending it the queued
    logs and events (so its shutdown message comes before covgrad's last line)."""
    module = sys.modules.get("prefect.server.api.server")
    if module is None or not module.SubprocessASGIServer._instances:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):  # send what is queued while the server still listens
        worker.drain_all(timeout=5)
    for server in list(module.SubprocessASGIServer._instances.values()):
        server.stop()


def route_errors_to_log() -> None:
    """Send every log record to the log file, and keep ERROR records (Prefect's task and flow failure
    tracebacks) off the terminal: the failure is reported once, in one line, by ``main``."""
    root = logging.getLogger()
    handler = logging.FileHandler(log_path(), delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    loggers = [root, *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for logger in loggers:
        for h in getattr(logger, "handlers", []):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.addFilter(_NoFailures())


def load_config(path: str | None, overrides: list[str]) -> Any:
    """Read a YAML config (default: the demo), apply ``--set`` overrides, validate."""
    from covgrad.config import PipelineConfig, apply_overrides, read_config_file

    data = read_config_file(path if path else DEMO_CONFIG)
    return PipelineConfig.model_validate(apply_overrides(data, overrides))


def cmd_run(args: argparse.Namespace) -> int:
    overrides = list(args.set or [])
    if args.root:
        overrides.append(f"root={args.root}")
    cfg = load_config(args.config, overrides)  # yaml + pydantic only: a typo is reported at once
    quiet_prefect()
    if args.entry:  # the process's own run: what it starts must not outlive it, even after a SIGKILL
        from flows.reaper import start_reaper

        start_reaper()
    from flows.stop import arm, disarm

    previous = arm()
    try:
        from flows.preflight import preflight
        from flows.runtime import check_prefect_runtime, check_root, server_start_error, start_server

        preflight(cfg, architecture=False)  # the flow repeats it whole: bad files fail before Prefect starts
        free = check_prefect_runtime()
        check_root(cfg)
        server_started = start_server(free)  # boots while the pipeline's modules import
        from flows.pipeline import covgrad_pipeline

        route_errors_to_log()
        try:
            server_started()
            result = covgrad_pipeline(cfg)
        except RuntimeError as exc:  # the temporary server's ports taken after the check
            busy = server_start_error(exc)
            if busy is None:
                raise
            raise busy from exc
    finally:
        disarm(previous)
    _print_summary(cfg, result)
    return 0


def _print_summary(cfg: Any, result: dict[str, Any]) -> None:
    """A few lines: the key numbers (``covgrad.report.document.summary_lines``), the stage counts and
    where the run index, the report and the full headline tables are."""
    from covgrad.report.document import summary_lines
    from storage.artifacts import ArtifactStore
    from storage.runs import read_run_index, run_index_url
    from storage.stores.reports import publish_report, report_numbers

    store = ArtifactStore(cfg.root)
    index = read_run_index(store, result["run"])
    entry = index["artifacts"].get("report")
    report = store.ref(entry["stage"], entry["key"]) if entry is not None else None
    data = report_numbers(store, report) if report is not None else None
    lines = summary_lines(data["numbers"], data["missing"]) if data is not None else []
    print()
    print("\n".join(lines))
    computed = [n for n, s in result["status"].items() if s == "computed"]
    print(
        f"run {result['run']} ({cfg.name}): {len(computed)} stage(s) computed, "
        f"{len(result['status']) - len(computed)} from cache"
    )
    print(f"results: {run_index_url(store, cfg.name)}")
    if report is not None and store.is_complete(report):
        if store.local and not os.access(store.base, os.W_OK):  # a read-only root: the artifact's own copy
            print(f"report:  {store.path(report, 'report.html')} (read-only root; tables: headline.md beside it)")
        else:
            print(f"report:  {publish_report(store, report, cfg.name)} (tables: headline.md beside it)")


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the scores stage's shards and the device memory each worker needs, with the task's real
    prompt lengths, then every other stage's disk and peak host memory (``flows.runplan``)."""
    import torch

    from covgrad.devices import device_memory
    from flows.shards import plan_for_config

    cfg = load_config(args.config, list(args.set or []))
    if args.shape is not None or args.ranks is not None:
        return _plan_fsdp(args, cfg)
    cuda = torch.cuda.is_available()
    gpu = (cuda or args.device_memory is not None) and cfg.model.device != "cpu"
    device = args.device or ("cuda" if gpu else "cpu")
    workers = args.workers or (torch.cuda.device_count() if device == "cuda" and cuda else 1)
    if args.device_memory is not None:
        memory = int(args.device_memory * 1e9)
    elif device == "cuda" and not cuda:
        raise ValueError("no CUDA device is visible here; give --device-memory GB to plan for one")
    else:
        memory = device_memory(torch.device(device))
    prompt_tokens, source = args.prompt_tokens, "--prompt-tokens"
    if prompt_tokens is None:
        prompt_tokens, source = _prompt_tokens(cfg)
    lines, chosen = plan_for_config(cfg, workers, memory, device, prompt_tokens)
    print(f"prompt length: {prompt_tokens} tokens ({source})")
    print("\n".join(lines))
    print("\n".join(_run_lines(cfg, prompt_tokens, chosen, device)))
    return 0 if chosen.fits else 1  # 1: the plan does not fit the devices


def _plan_fsdp(args: argparse.Namespace, cfg: Any) -> int:
    """The model-sharded scores plan (``covgrad.distributed.plan``) of ``--shape`` on ``--ranks`` devices of
    ``--device-memory`` GB, with the config's selection, batch, response length and state dtype."""
    from covgrad.distributed import SHAPES, FsdpWork, fsdp_plan

    if args.shape is None:
        raise ValueError(f"--ranks plans a model-sharded run of a --shape; give --shape {' or '.join(SHAPES)}")
    if args.device_memory is None:
        raise ValueError("--shape plans for devices you name; give --device-memory GB (e.g. 141 or 80)")
    ranks = args.ranks or 8
    if ranks < 1:
        raise ValueError(f"--ranks {ranks} must be at least 1")
    shape = SHAPES[args.shape]
    samplers = cfg.rollouts.samplers.values()
    prompt = args.prompt_tokens or 128
    work = FsdpWork(
        B=cfg.scores.groups_per_batch * max(s.group_size for s in samplers),
        L=prompt + max(s.max_new_tokens for s in samplers),
        N=cfg.task.n_prompts * max(s.group_size for s in samplers),
        state_dtype=cfg.scores.state_dtype,
        device=args.device or "cuda",
    )
    layout = shape.layout(cfg.model.params)
    chosen = fsdp_plan(shape, layout, work, ranks, int(args.device_memory * 1e9))
    print(
        f"model: {args.shape} shape ({shape.dtype_bytes * 8}-bit weights); batch: B = {work.B} samples of "
        f"L = {work.L} tokens ({prompt} prompt{'' if args.prompt_tokens else ', assumed'} + responses); "
        f"state {work.state_dtype}; attention {work.attention}"
    )
    print("\n".join(chosen.lines()))
    if not chosen.fits:
        print(chosen.reason())
    return 0 if chosen.fits else 1  # 1: the plan does not fit the devices


def _prompt_tokens(cfg: Any) -> tuple[int, str]:
    """The longest prompt of the task in the policy's tokens, and where that number comes from (128,
    assumed, when the tokenizer cannot be read without loading the model)."""
    from storage.stores.prompts import load_problems, prompt_lengths

    problems = load_problems(cfg.task)  # the prompts only: a plan imports no reward code
    counted = prompt_lengths(cfg.model.path, problems, cfg.model.max_length)
    if counted is None or not counted[0]:
        return 128, "assumed: no tokenizer.json to count the task's prompts"
    return max(counted[0]), f"longest of the task's {len(counted[0])} prompts"


def _run_lines(cfg: Any, prompt_tokens: int, chosen: Any, device: str) -> list[str]:
    """Every stage of the run in order, the scores stage from the shard plan ``chosen`` on ``device``:
    disk and peak host memory each (``flows.runplan``), the total disk, and the time (unknown)."""
    from covgrad.distributed import ModelShape
    from covgrad.layout import select_parameters
    from covgrad.tokens import resolve_modes, row_names
    from flows.runplan import RunShape, ScoresShape, human, stage_sizes
    from flows.shards import meta_model
    from storage.stores.prompts import load_problems
    from tasks.specs import plan

    model = meta_model(cfg)
    shape = ModelShape.of(model)
    prompts = len(load_problems(cfg.task))
    samplers = cfg.rollouts.samplers
    steps = plan(cfg)
    instances = list(steps)
    samples = {n: prompts * s.group_size for n, s in samplers.items()}
    T = max(s.max_new_tokens for s in samplers.values())
    tok = cfg.tokens
    modes = resolve_modes(tok.modes, T, shape.vocab, tok.exact_budget) if "tokens" in instances else []
    run = RunShape(
        P=select_parameters(model, cfg.model.params).P,
        n_params=shape.n_params,
        dtype_bytes=shape.dtype_bytes,
        vocab=shape.vocab,
        samples=samples,
        T={n: s.max_new_tokens for n, s in samplers.items()},
        mu={n: (s.store_mu, s.mu_topk) for n, s in samplers.items()},
        L=prompt_tokens + T,
        stats_instances=sum(i.startswith("stats.") for i in instances),
        n_qs=len(cfg.masks.qs),
        tokens="tokens" in instances,
        update_check="update_check" in instances,
        demo=cfg.model.path is None,
        tokens_samples=min(tok.max_samples, max(samples.values())),
        tokens_modes=len(modes),
        tokens_rows=len(row_names(modes)) if modes else 0,
    )
    scores = ScoresShape(
        job_bytes=chosen.need,
        store_bytes=chosen.store_bytes,
        artifacts=len(steps.scores),
        device=device,
        rows=any(n.rows for n in chosen.needs),
    )
    rows = stage_sizes(run, scores)
    out = ["every stage (disk when complete, peak host memory; time: unknown, it depends on the device):"]
    out += [
        f"  {r['stage']:13s} disk {human(int(r['disk'])):>10s}   peak {human(int(r['peak'])):>10s}"
        + (f"   ({r['note']})" if r["note"] else "")
        for r in rows
    ]
    out.append(f"  total disk: {human(sum(int(r['disk']) for r in rows))}")
    return out


def cmd_report(args: argparse.Namespace) -> int:
    import fsspec

    from storage.artifacts import ArtifactStore, join_url
    from storage.runs import read_run_index
    from storage.stores.reports import rebuilt_report_dir, write_report
    from tasks.report import render_run

    store = ArtifactStore(args.root)
    index = read_run_index(store, args.run)
    report = render_run(store, index)
    for name in report.missing:
        a = index["artifacts"][name]
        print(f"covgrad: stage {name} ({a['stage']}/{a['key']}) is missing or incomplete; skipped", file=sys.stderr)
    out = args.out or rebuilt_report_dir(store, index.get("name") or args.run)
    fs_out, base = fsspec.core.url_to_fs(out)
    write_report(fs_out, base, report)
    print(report.headline_markdown())
    print(f"report:  {join_url(out, 'report.html')}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """One line per artifact: stage, key, state, the runs whose index uses it, size, created, config."""
    from storage.artifacts import ArtifactStore
    from storage.runs import runs_of

    store = ArtifactStore(args.root)
    rows = store.list_artifacts()
    if not rows:
        print(f"no artifacts under {args.root}")
        return 0
    runs = runs_of(store)
    print(f"{'stage':14s} {'key':26s} {'state':9s} {'run':16s} {'size':>10s}  {'created':25s} config")
    for r in rows:
        state = "damaged" if r["damaged"] else "complete" if r["complete"] else "partial"
        used = ",".join(runs.get((r["stage"], r["key"]), [])) or "-"
        print(
            f"{r['stage']:14s} {r['key']:26s} {state:9s} {used:16s} {_size(r['bytes']):>10s}  "
            f"{r['created']:25s} {r['config']}"
        )
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """One line per run, newest first: name, key, date, complete stages, the headline finding."""
    from storage.artifacts import ArtifactStore
    from storage.runs import list_runs
    from storage.stores.reports import rebuilt_report_dir

    store = ArtifactStore(args.root)
    rows = list_runs(store)
    if not rows:
        print(f"no runs under {args.root}")
        return 0
    print(f"{'name':16s} {'key':26s} {'date':25s} {'stages':7s} headline")
    for r in rows:
        print(f"{r['name']:16s} {r['run']:26s} {r['written']:25s} {r['stages']:7s} {r['headline'] or '-'}")
        if args.reports:
            print(f"{'':16s} report: {rebuilt_report_dir(store, r['name'])}/report.html")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_gc(args: argparse.Namespace) -> int:
    from storage.artifacts import ArtifactStore
    from storage.runs import referenced_keys

    store = ArtifactStore(args.root)
    keep = referenced_keys(store)
    doomed = []
    for r in store.list_artifacts():
        if r["complete"] and not r["damaged"] and (r["stage"], r["key"]) in keep:
            continue
        if store.busy(store.ref(r["stage"], r["key"])):
            print(f"kept {r['stage']}/{r['key']}: a live run is writing it")
        else:
            doomed.append(r)
    if not doomed:
        print("nothing to remove")
        return 0
    for r in doomed:
        why = "partial" if not r["complete"] else "damaged" if r["damaged"] else "unreferenced"
        print(f"remove {r['stage']}/{r['key']} ({why}, {_size(r['bytes'])})")
    if not args.yes:
        if not sys.stdin.isatty():
            print("nothing removed: not a terminal; pass --yes to delete without asking")
            return 0
        answer = input(f"delete these {len(doomed)} artifact(s)? [y/N] ").strip().lower()
        if answer != "y":
            print("nothing removed")
            return 0
    removed = 0
    for r in doomed:
        if store.clear_if_idle(store.ref(r["stage"], r["key"])):
            removed += 1
        else:
            print(f"kept {r['stage']}/{r['key']}: a live run is writing it")
    print(f"removed {removed} artifact(s)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every file of the run's (or, with ``--all``, every) complete artifact against its manifest."""
    from storage.artifacts import ArtifactStore
    from storage.runs import read_run_index

    store = ArtifactStore(args.root)
    if args.all == (args.run is not None):
        raise ValueError("covgrad verify needs a run name or key, or --all (not both)")
    if args.all:
        refs = [store.ref(r["stage"], r["key"]) for r in store.list_artifacts() if r["complete"]]
    else:
        artifacts = read_run_index(store, args.run)["artifacts"]
        refs = sorted({(a["stage"], a["key"]) for a in artifacts.values()})
        refs = [store.ref(stage, key) for stage, key in refs]
    damaged = 0
    for ref in refs:
        if store.marker(ref) is None:
            print(f"missing {ref.stage}/{ref.key}: not complete")
            damaged += 1
            continue
        problems = store.damage(ref, full=True)
        damaged += bool(problems)
        for p in problems:
            print(f"damaged {ref.stage}/{ref.key}: {p}")
    print(f"verified {len(refs)} artifact(s) under {store.root}: {damaged} damaged")
    return 1 if damaged else 0


def cmd_diff(args: argparse.Namespace) -> int:
    import json

    from covgrad.models import check_finite_weights
    from covgrad.updates import diff_state_dicts
    from storage.checkpoints import load_state_dict

    before, after = load_state_dict(args.before), load_state_dict(args.after)
    check_finite_weights(before.items(), f"checkpoint BEFORE {args.before!r}")
    check_finite_weights(after.items(), f"checkpoint AFTER {args.after!r}")
    masks = layout = None
    if args.masks:
        from storage.identity import artifact_location, check_computed_on
        from storage.stores.masks import load_masks

        masks, layout = load_masks(args.masks, args.q)
        what = f"the masks {args.masks} were not computed on BEFORE {args.before}"
        fix = "pass as BEFORE the checkpoint the masks' run analysed, or compute masks for BEFORE"
        if check_computed_on(*artifact_location(args.masks), before, what, fix) is None:
            print(f"covgrad diff: {args.masks} records no model identity; BEFORE is not checked", file=sys.stderr)
    result = diff_state_dicts(before, after, atol=args.atol, masks=masks, layout=layout)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print(f"{'tensor':50s} {'numel':>10s} {'changed(bf16/dtype)':>20s} {'changed(|d|>atol)':>18s}")
    for row in result["tensors"]:
        print(f"{row['name']:50s} {row['numel']:>10d} {row['frac_exact']:>20.4f} {row['frac_abs']:>18.4f}")
    tot = result
    print(f"{'global (numel-weighted)':50s} {tot['numel']:>10d} {tot['frac_exact']:>20.4f} {tot['frac_abs']:>18.4f}")
    cast = sorted({(r["before_dtype"], r["dtype"]) for r in result["tensors"] if r["before_dtype"] != r["dtype"]})
    for src, dst in cast:
        print(f"compared in AFTER's {dst}: BEFORE's {src} tensors rounded to {dst} first")
    for m in result["mismatched"]:
        print(f"not compared: {m}")
    for name, sets in result.get("overlap", {}).items():
        e = sets["exact"]
        print(f"changed vs {name}: precision {e['precision']:.3f} recall {e['recall']:.3f} jaccard {e['jaccard']:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from covgrad.config import config_help

    offline_env()
    default_root = os.environ.get("COVGRAD_ROOT") or "runs"
    parser = argparse.ArgumentParser(prog="covgrad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser(
        "run",
        help="run the covgrad-pipeline flow",
        description="Run (or reuse) every stage of one analysis.",
        epilog="config keys (YAML sections or --set KEY=VALUE) with their schema defaults; the default --config,\n"
        "configs/demo.yaml, sets some of them:\n\n" + "\n".join(config_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML config (default: the built-in demo)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p.add_argument("--root", help="artifact root (local path or fsspec URL; default: the config's root)")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser(
        "plan",
        help="print the scores shards, per-worker device memory and store size",
        description="Size the scores stage of a config: shards, device memory per worker, store size.",
        formatter_class=defaults,
    )
    p.add_argument("--config", help="YAML config (default: the built-in demo)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--workers", type=int, help="devices (dask workers); unset: the visible GPUs, else 1")
    p.add_argument("--device-memory", type=float, metavar="GB", help="memory per device in GB (1e9 bytes)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="unset: cuda if visible or --device-memory is set")
    p.add_argument("--prompt-tokens", type=int, help="prompt length for L (unset: the task's longest prompt, counted)")
    p.add_argument(
        "--shape",
        choices=["llama-3-70b", "qwen2.5-72b"],
        help="plan the model-sharded (FSDP) scores run of this model shape instead of the config's model",
    )
    p.add_argument("--ranks", type=int, help="with --shape: devices the model is sharded over (default 8)")
    p.set_defaults(fn=cmd_plan)
    root_help = "artifact root (local path or fsspec URL; env COVGRAD_ROOT)"
    p = sub.add_parser(
        "report",
        help="rebuild a run's report from its stores (no model needed)",
        description="Render a run's report again from its stores alone into the run's report location "
        "({root}/_reports/{run name}/, where `covgrad run` puts it too), or into --out.",
        formatter_class=defaults,
    )
    p.add_argument("run", help="run key or name")
    p.add_argument("--root", default=default_root, help=root_help)
    p.add_argument("--out", help="output directory (default: {root}/_reports/{run name})")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser(
        "runs",
        help="list runs: name, key, date, complete stages, headline",
        description="List the runs under a root, newest first, with the headline finding of each run's report.",
        formatter_class=defaults,
    )
    p.add_argument("--root", default=default_root, help=root_help)
    p.add_argument("--reports", action="store_true", help="print each run's report location too")
    p.set_defaults(fn=cmd_runs)
    p = sub.add_parser(
        "ls",
        help="list artifacts under a root, with the runs that use each",
        description="List every artifact: stage, key, state, the runs whose index uses it, size, created, config.",
        formatter_class=defaults,
    )
    p.add_argument("--root", default=default_root, help=root_help)
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser(
        "gc",
        help="remove partial and unreferenced artifacts",
        description="Remove partial, damaged and unreferenced artifacts after listing them (asks unless --yes).",
        formatter_class=defaults,
    )
    p.add_argument("--root", default=default_root, help=root_help)
    p.add_argument("--yes", action="store_true", help="do not ask before deleting")
    p.set_defaults(fn=cmd_gc)
    p = sub.add_parser(
        "verify",
        help="check every checksum of a run's (or all) artifacts; exit 1 on damage",
        description="Re-hash every file of a run's (or every) complete artifact against its manifest.",
        formatter_class=defaults,
    )
    p.add_argument("run", nargs="?", help="run key or name")
    p.add_argument("--all", action="store_true", help="every complete artifact under the root")
    p.add_argument("--root", default=default_root, help=root_help)
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser(
        "diff",
        help="update sparsity between two checkpoints",
        description="Fraction of parameters changed between two checkpoints (bf16 value and |Δ| > atol), "
        "per tensor and numel-weighted, optionally against the top-q masks of a masks artifact; checkpoints of "
        "different floating dtypes are compared in AFTER's (BEFORE rounded to it).",
        formatter_class=defaults,
    )
    p.add_argument("before", help="checkpoint before (model directory or state-dict file)")
    p.add_argument("after", help="checkpoint after")
    p.add_argument("--atol", type=float, default=1e-5, help="|Δ| above which a parameter counts as changed")
    p.add_argument(
        "--masks", help="a masks artifact directory to compare the changed set with (computed on BEFORE, else refused)"
    )
    p.add_argument("--q", type=float, default=0.01, help="top-q fraction of the masks to compare")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(fn=cmd_diff)
    args = parser.parse_args(argv)
    # As the process's entry point (the console script, argv None) covgrad stops the temporary server
    # before its last line; called in-process (tests, notebooks) the server belongs to the caller.
    entry = argv is None
    args.entry = entry
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        return fail(exc, 2, entry)
    except Exception as exc:  # one line either way, the traceback in the log
        known = known_failure(exc)
        if known is not None:
            return fail(exc, 2, entry, known)
        if isinstance(exc, OSError):  # an unwritable root or a full disk is expected; any other OSError is a bug
            return fail(exc, 2 if exc.errno in _WRITE_ERRNOS else 1, entry)
        return fail(exc, 1, entry)  # a bug


def known_failure(exc: BaseException) -> str | None:
    """The one line (what failed, how to proceed) of an expected failure that is not a ValueError, FileNotFoundError
    or KeyError, or None for a bug: weights that ``torch.load(weights_only=True)`` refuses (an UnpicklingError
    anywhere in the chain), a rank group's failure (:func:`rank_failure`), or a fork server of ``multiprocessing``
    that died under a launch (an EOFError or a refused connection raised in its code)."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, pickle.UnpicklingError):
            from storage.inputs import pickle_message

            return pickle_message(_loaded_file(e), e)
        e = e.__cause__ or e.__context__
    launch = sys.modules.get("covgrad.distributed.launch")  # not imported: no rank group ran
    if launch is not None and isinstance(exc, launch.RankFailedError):
        return rank_failure(str(exc))
    if isinstance(exc, (EOFError, ConnectionError)) and _raised_in_multiprocessing(exc):
        return (
            f"a worker process's fork server (multiprocessing) ended under the run ({type(exc).__name__}: {exc}); "
            "it was killed or ran out of memory: rerun to resume from the checkpoints"
        )
    return None


# the exceptions a rank may raise on bad input, as its failure line names them (``rank 1 of 2 failed: ValueError: …``)
_RANK_INPUT_ERRORS = {"ValueError", "FileNotFoundError", "KeyError", "UnpicklingError"}
# what a rank raises when a peer rank or a whole torchrun node vanished: gloo's and nccl's closed connections,
# torch.distributed's store and network errors, a collective's timeout
_LOST_PEER = re.compile(
    r"Dist(Backend|Network|Store)Error|EOFError|Connection(Reset|Aborted|Refused)Error|BrokenPipeError|"
    r"TimeoutError|connection (closed|reset|refused)|broken pipe|timed out",
    re.IGNORECASE,
)


def rank_failure(line: str) -> str | None:
    """The line of a ``covgrad.distributed.launch.RankFailedError`` as the error to report, or None (a bug) when it
    names a rank that raised anything but bad input or a lost peer. A rank killed by a signal or ended with an exit
    code, a torchrun that failed (its rendezvous, or a killed node), and a rank that lost its peers are expected:
    the line, with how to proceed where it does not say."""
    raised = re.match(r"rank \d+ .*? failed: ([\w.]+): ", line)
    lost = _LOST_PEER.search(line) is not None
    if raised is not None and raised[1].rsplit(".", 1)[-1] not in _RANK_INPUT_ERRORS and not lost:
        return None
    if "rerun" in line or (raised is not None and not lost):
        return line
    return f"{line}; a rank or node of the group was lost: rerun to resume from the checkpoints"


def _loaded_file(exc: BaseException) -> str | None:
    """The file ``torch.load`` was reading when it raised ``exc`` (its frame's ``f``), or None."""
    tb = exc.__traceback__
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "load" and code.co_filename.endswith(os.path.join("torch", "serialization.py")):
            f = tb.tb_frame.f_locals.get("f")
            found = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", found)
        tb = tb.tb_next
    return found


def _raised_in_multiprocessing(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is code of a ``multiprocessing`` package (the standard
    library's or torch's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}multiprocessing{os.sep}" in tb.tb_frame.f_code.co_filename


_WRITE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST}


def describe_os_error(exc: OSError) -> str:
    """One line for a failed write: what failed, the path (when the system names it) and what to do."""
    where = f" {exc.filename}" if exc.filename else " (the system named no file)"
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full writing{where}: {why}; free space there or pass --root on another disk"
    return f"cannot write{where}: {why}; make the root writable or pass --root to a writable directory"


def fail(exc: BaseException, status: int, stop_server: bool = True, text: str | None = None) -> int:
    """Write the traceback to the log file and one line naming the cause (``text``, else the exception's first
    line) to stderr; return ``status``. With ``stop_server`` the temporary Prefect server this process started is
    stopped first."""
    from covgrad.config import format_validation_error

    if stop_server:
        stop_prefect_server()
    path = log_path()
    with open(path, "a") as f:
        f.write("".join(traceback.format_exception(exc)))
    if text is None:
        lines = format_validation_error(exc).strip().splitlines() if isinstance(exc, Exception) else []
        text = lines[0] if lines else type(exc).__name__
        if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
            text = describe_os_error(exc)
        if isinstance(exc, KeyError) and not lines[1:]:
            text = f"missing key {text}"
    kind = "error" if status == 2 else f"internal error ({type(exc).__name__})"
    print(f"covgrad: {kind}: {text} (traceback: {path})", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
