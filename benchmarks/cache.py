"""Rerun cost: the ``covgrad-pipeline`` flow twice with one config in one process, against a temporary
Prefect API (``prefect_test_harness``, started before the clock). The second run should find every
stage cached and take well under a quarter of the first.

    python -m benchmarks.cache                 # configs/tiny.yaml, tokens and update check off
    python -m benchmarks.cache --config demo   # configs/demo.yaml
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import torch

from flows.cli import DEMO_CONFIG, load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="tiny, demo or a YAML path")
    parser.add_argument("--root", help="artifact root (default: a new temporary directory)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = str(DEMO_CONFIG.parent / f"{args.config}.yaml") if args.config in ("tiny", "demo") else args.config
    overrides = list(args.set)
    if args.config == "tiny":
        overrides += ["tokens.enabled=false", "update_check.enabled=false"]
    root = args.root or tempfile.mkdtemp(prefix="covgrad-cache-")
    cfg = load_config(path, [*overrides, f"root={root}"])

    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import covgrad_pipeline

    with prefect_test_harness(server_startup_timeout=120):
        times, results = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            results.append(covgrad_pipeline(cfg))
            times.append(time.perf_counter() - t0)
    for i, (t, r) in enumerate(zip(times, results, strict=True), start=1):
        counts = {s: list(r["status"].values()).count(s) for s in ("computed", "cached")}
        print(f"run {i}: {t:8.2f} s  {counts['computed']} computed, {counts['cached']} cached")
    print(f"rerun / first = {times[1] / times[0]:.3f}  (goal < 0.25)  root {root}")


if __name__ == "__main__":
    main()
