"""``covgrad run``'s SIGINT/SIGTERM handler (flows/stop.py) against Prefect's flow-run SIGTERM handler."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from flows.stop import arm, disarm, rearm, stop_children
from tests.helpers.pipeline import REPO

# A SIGTERM delivered while a finalizer runs, inside Prefect's flow-run signal scope: Prefect's handler raises
# TerminationSignal there, which Python drops ("Exception ignored in"), so the process goes on and exits 0.
SCRIPT = """
import os, signal, sys, time
from prefect.utilities.engine import capture_sigterm
from flows.stop import arm, rearm

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs here, inside __del__

arm()
with capture_sigterm():
    if sys.argv[1] == "rearm":
        rearm()
    Finalized()
    time.sleep(0.5)
print("went on")
"""


@pytest.mark.parametrize(("how", "code"), [("rearm", 128 + signal.SIGTERM), ("prefect", 0)])
def test_sigterm_in_a_finalizer_stops_the_run_once_rearmed(how: str, code: int) -> None:
    """With :func:`rearm` the handler ends the process (143, one line, the flow does not go on); with
    Prefect's handler alone the signal is lost in the finalizer and the process goes on to exit 0 (the case
    that made a SIGTERMed run finish)."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    if how == "rearm":
        assert "covgrad: stopped by SIGTERM; finished batches are kept, rerun to resume" in proc.stderr
        assert "went on" not in proc.stdout
    else:
        assert "went on" in proc.stdout and "Exception ignored" in proc.stderr


def test_rearm_only_where_covgrad_run_armed() -> None:
    """Not armed (a deployment's worker): :func:`rearm` leaves the handler alone; armed: it installs
    :func:`stop_children` for both signals; disarm restores what was there."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    rearm()
    assert {s: signal.getsignal(s) for s in before} == before
    previous = arm()
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a flow engine's own handler would replace
        rearm()
        assert signal.getsignal(signal.SIGTERM) is stop_children
        assert signal.getsignal(signal.SIGINT) is stop_children
    finally:
        disarm(previous)
    assert {s: signal.getsignal(s) for s in before} == before
