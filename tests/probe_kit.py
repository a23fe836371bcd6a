"""The escape probe (tests/probes/escape_probe.c): built static once per source, copied
into a sandbox and run there, and run on the host as its calibration (every check
that reaches the kernel there can fail inside: a check the host cannot reach proves
nothing and is said to)."""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Iterable

import pytest

from conftest import CACHE, ROOT

SOURCE = ROOT / "tests" / "probes" / "escape_probe.c"
INSIDE = "/tmp/.sandman-probe"
# what a refused call answers: the errnos of seccomp's refusals and of a missing
# capability or kernel feature
DOORS = {"EPERM", "EACCES", "ENOSYS", "EAFNOSUPPORT", "EPROTONOSUPPORT", "ESOCKTNOSUPPORT"}


def probe_binary() -> Path:
    """The probe, built static with gcc (cached by the source's hash)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = CACHE / "probes" / ("escape_probe-%s" % digest)
    if not out.exists():
        if shutil.which("gcc") is None:
            pytest.fail("gcc is missing: make test installs it (apt-get install gcc libc6-dev)")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        done = subprocess.run(["gcc", "-static", "-O2", "-Wall", "-o", str(tmp), str(SOURCE)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        os.replace(tmp, out)
    return out


def parse(text: str) -> Dict[str, str]:
    """check -> "reached X" or "refused X", from the probe's lines."""
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            found[parts[0]] = "%s %s" % (parts[1], parts[2])
    return found


def in_sandbox(client, checks: Iterable[str]) -> Dict[str, str]:
    """Run the probe's ``checks`` in the sandbox of daemon ``client``; every check must
    have answered."""
    checks = list(checks)
    client.write_file(INSIDE, probe_binary().read_bytes(), mode=0o755)
    r = client.exec([INSIDE] + checks, timeout=60)
    found = parse(r.stdout.decode())
    assert r.exit_code == 0 and sorted(found) == sorted(checks), (r, found)
    return found


def raw_in_sandbox(client, numbers: Iterable[int]) -> Dict[int, str]:
    """Each system call number, made with arguments of -1: number -> errno name."""
    numbers = list(numbers)
    client.write_file(INSIDE, probe_binary().read_bytes(), mode=0o755)
    r = client.exec([INSIDE, "raw"] + [str(n) for n in numbers], timeout=60)
    found = dict(line.split() for line in r.stdout.decode().splitlines())
    assert r.exit_code == 0 and len(found) == len(numbers), r
    return {int(k): v for k, v in found.items()}


def on_host(args) -> str:
    """The probe run on the host as root, in a session of its own (no controlling
    terminal for vhangup to hang up)."""
    done = subprocess.run([str(probe_binary())] + list(args), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, start_new_session=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def host_reaches(checks: Iterable[str]) -> Dict[str, bool]:
    """check -> whether the call goes past the kernel's door on this host as root: only
    such a check can fail in a sandbox, and so prove anything."""
    return {name: verdict.startswith("reached")
            for name, verdict in parse(on_host(list(checks))).items()}
