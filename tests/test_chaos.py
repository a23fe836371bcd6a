"""The fault suite as a test tier: every scenario of ``bench/chaos.py`` once, on a
real local Ray cluster with real sandboxes (see that file for what each one does).
It takes a few minutes, so ``make test`` leaves it out; ``make test-chaos`` runs it."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, require_bwrap


@pytest.mark.chaos
@pytest.mark.timeout(1200)
def test_every_fault_scenario_passes_and_leaks_nothing():
    require_bwrap()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--trials", "1"],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=1100,
                          stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, "no JSON summary; stderr ends with:\n%s" % proc.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert summary["failures"] == [] and proc.returncode == 0, proc.stdout[-4000:]
    assert [row["leaked"] for row in summary["scenarios"]] == [0] * len(summary["scenarios"])
    assert {row["scenario"] for row in summary["scenarios"]} >= {"driver_sigkill", "node_removed"}
