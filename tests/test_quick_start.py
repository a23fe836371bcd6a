"""The README's quick start, run as a new user runs it: a wheel built from this
checkout, installed in a virtual environment of its own, the quick start's code block
copied from README.md and run from a directory outside the repository, on a Ray it
starts itself, with the LocalProvider's default roots (a new machine builds the default
image there on first use). The environment takes the wheel's dependencies (Ray and the
rest) from the test environment's site-packages rather than from PyPI, and nothing of
the checkout is on its path."""

import re
import subprocess
import sys
import sysconfig

import pytest

from conftest import ROOT


def quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(r"## Quick start\n\n```python\n(.*?)```", text, re.S)
    assert found, "README.md has a quick start in a python block"
    return found.group(1)


@pytest.mark.timeout(900)
def test_the_readme_quick_start_runs_from_a_wheel_outside_the_repository(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
                            str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("sandman_ray-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    # the dependencies, not the checkout: a path added by a .pth file is no site
    # directory, so the test environment's editable install of the checkout is not seen
    with open("%s/dependencies.pth" % site, "w") as fh:
        fh.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {"PATH": "%s:/usr/sbin:/usr/bin:/sbin:/bin" % (venv / "bin"), "HOME": str(tmp_path),
           "LANG": "C.UTF-8"}
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True,
                               env=env, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]

    away = tmp_path / "elsewhere"
    away.mkdir()
    where = subprocess.run([str(python), "-c", "import sandman_ray; print(sandman_ray.__file__)"],
                           cwd=away, capture_output=True, text=True, env=env, check=True)
    assert where.stdout.startswith(site), where.stdout  # the wheel's, not the checkout's

    (away / "quick.py").write_text(quick_start() + '\nsandman.shutdown_pool("default")\n')
    ran = subprocess.run([str(python), "quick.py"], cwd=away, capture_output=True, text=True,
                         env=env, timeout=600)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "b'hi\\n'" in ran.stdout, ran.stdout
