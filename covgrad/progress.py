"""Progress of a long loop: a terminal bar and periodic plain lines with items done, rate and ETA."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm


class Progress:
    """A long loop's progress: a terminal bar (stage name, k of n, rate) when stderr is a terminal (or
    COVGRAD_PROGRESS=1), and every ``every`` seconds one plain line with items done, rate and ETA, handed to
    ``report`` (the stage log) and, when stderr is not a terminal (``covgrad run > log 2>&1``), written to
    stderr too, so a job's output file shows that a long stage is alive, how far it got and when it ends."""

    def __init__(self, stage: str, total: int, unit: str, every: float, report: Callable[[str], None]) -> None:
        tty = sys.stderr.isatty()
        show = tty or os.environ.get("COVGRAD_PROGRESS") == "1"
        self.bar = tqdm(total=total, desc=stage, unit=unit, disable=not show, leave=False, dynamic_ncols=True)
        self.plain = not tty and not show  # the bar is off: plain lines go to stderr too
        self.stage, self.total, self.unit, self.every, self.report = stage, total, unit, every, report
        self.done = 0
        self.start = self.last = time.monotonic()

    def line(self, now: float) -> str:
        """``stage: k/n unit (p%), r unit/s, ETA t s, s so far`` at time ``now`` (monotonic seconds; ETA
        unknown before the first unit)."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else float("nan")
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        left = f"ETA {eta:.0f} s" if eta == eta else "ETA unknown"
        done = f"{self.done}/{self.total} {self.unit} ({pct:.0f}%)"
        return f"{self.stage}: {done}, {rate:.3g} {self.unit}/s, {left}, {elapsed:.0f} s so far"

    def update(self, n: int = 1) -> None:
        """Count ``n`` more finished units; report a line when ``every`` seconds passed since the last one."""
        if n <= 0:
            return
        self.bar.update(n)
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every and self.done < self.total:
            self.last = now
            text = self.line(now)
            self.report(text)
            if self.plain:  # a write, not print(): Prefect's log_prints would turn a print into a task-log line
                sys.stderr.write(f"covgrad progress: {text}\n")
                sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
