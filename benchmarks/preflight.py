"""Preflight's cost on real model directories: its random two-layer copy at a 512-token vocabulary against the same
copy at the model's own vocabulary, interleaved in one process (``covgrad.scores.preflight.check_model``, every
parameter selected). Per directory and variant the median CPU and wall seconds over ``--reps``, and the ratio.

    python -m benchmarks.preflight models/smollm2-135m-instruct models/gemma3-270m
"""

from __future__ import annotations

import argparse
import statistics
import time

from covgrad.offline import offline_env

offline_env()

from covgrad.scores.preflight import _VOCAB, check_model  # noqa: E402


def timed(path: str, vocab: int | None) -> tuple[float, float]:
    """CPU and wall seconds of one ``check_model`` of ``path`` with the copy's vocabulary ``vocab``."""
    cpu, wall = time.process_time(), time.perf_counter()
    check_model(path, None, vocab=vocab)
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="Hugging Face model directories")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    head = f"copy at the model's vocabulary: CPU s / wall s | copy at {_VOCAB} tokens: CPU s / wall s"
    print(f"| model | {head} | CPU ratio |")
    print("|---|---:|---:|---:|")
    for path in args.paths:
        full, cut = [], []
        for _ in range(args.reps):
            full.append(timed(path, None))
            cut.append(timed(path, _VOCAB))
        f = [statistics.median(x) for x in zip(*full, strict=True)]
        c = [statistics.median(x) for x in zip(*cut, strict=True)]
        print(f"| {path} | {f[0]:.1f} / {f[1]:.1f} | {c[0]:.1f} / {c[1]:.1f} | {f[0] / c[0]:.1f} |")


if __name__ == "__main__":
    main()
