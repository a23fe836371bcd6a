"""The daemon runs on every Python from 3.8: checked for syntax with vermin, and run
for real (with its own codec: -I -S keeps site-packages and msgpack out) on each
interpreter this machine has."""

import glob
import os
import subprocess
import sys

import pytest

from conftest import DAEMON, ROOT, DaemonProcess


def test_daemon_source_needs_nothing_newer_than_python_3_8():
    vermin = os.path.join(os.path.dirname(sys.executable), "vermin")
    out = subprocess.run([vermin, "-t=3.8-", "--no-tips", "--violations", str(DAEMON)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def interpreters():
    found = {}
    for minor in range(8, 14):
        for pattern in ("/root/.pyenv/versions/3.%d.*/bin/python3.%d" % (minor, minor),
                        "/usr/bin/python3.%d" % minor):
            paths = sorted(glob.glob(pattern))
            if paths:
                found["3.%d" % minor] = paths[-1]
                break
    return found


INTERPRETERS = interpreters()


def test_at_least_the_oldest_and_a_current_python_are_available():
    assert "3.11" in INTERPRETERS
    if "3.8" not in INTERPRETERS:
        pytest.skip("no Python 3.8 on this machine; vermin still checks the syntax")


@pytest.mark.parametrize("version", sorted(INTERPRETERS))
def test_daemon_serves_on_python(version, tmp_path):
    d = DaemonProcess("unix:%s/v.sock" % tmp_path, python=INTERPRETERS[version],
                      python_flags=("-I", "-S"))
    try:
        with d.client() as c:
            assert c.info()["python"].startswith(version)
            assert c.exec("echo hi").stdout == b"hi\n"
            assert c.exec(["printf", "%s", "x" * 70000]).stdout == b"x" * 70000
            c.run("A=5")
            assert c.run("echo $A").stdout == b"5\n"
            c.write_file(str(tmp_path / "f"), os.urandom(100000))
            assert len(c.read_file(str(tmp_path / "f"))) == 100000
            assert c.put_archive(str(tmp_path / "t"), c.get_archive(str(tmp_path / "f"))) == 1
            r = c.exec("sleep 5", timeout=0.2)
            assert r.timed_out
    finally:
        d.stop()


# integration module -> the framework distribution it needs (pyproject's integrations extra)
FRAMEWORKS = {"swerex": "swe-rex", "minisweagent": "mini-swe-agent", "skyrl": "skyrl-gym"}


def test_the_integrations_extra_installs_each_framework_on_the_pythons_it_supports():
    """Each framework of the integrations extra carries a marker that holds on exactly
    the Pythons its own Requires-Python admits (3.8 to 3.14 compared one by one)."""
    import tomllib
    from importlib.metadata import metadata
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    with open(ROOT / "pyproject.toml", "rb") as fh:
        extra = tomllib.load(fh)["project"]["optional-dependencies"]["integrations"]
    pinned = {Requirement(line).name: Requirement(line) for line in extra}
    for name in ("mini-swe-agent", "skyrl-gym", "swe-rex", "verl"):
        wanted = SpecifierSet(metadata(name)["Requires-Python"])
        for minor in range(8, 15):
            version = "3.%d" % minor
            holds = pinned[name].marker.evaluate({"python_version": version,
                                                  "python_full_version": version + ".0"})
            assert holds == (version + ".0" in wanted), (name, version, str(wanted))


@pytest.mark.parametrize("module", sorted(FRAMEWORKS))
def test_an_integration_imported_on_a_python_its_framework_lacks_says_so(module):
    """On Python 3.9 (the package itself runs there) importing the integration is an
    ImportError that names the Pythons its framework supports, before anything else is
    imported."""
    if "3.9" not in INTERPRETERS:
        pytest.skip("no Python 3.9 on this machine")
    out = subprocess.run([INTERPRETERS["3.9"], "-S", "-c",
                          "import sandman_ray.integrations.%s" % module],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode != 0
    assert ("ImportError: sandman_ray.integrations.%s needs Python 3.10 or newer" % module
            in out.stderr) and "this is Python 3.9" in out.stderr, out.stderr
