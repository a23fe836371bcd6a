"""The documentation site builds strictly (a broken link, a missing page or a reference
that does not resolve fails it), its API reference lists every public name of
``sandman_ray`` and every operation of the handle, its performance table is made from
the results files, and the README stays a page for users."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT

README_MAX_LINES = 150


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                            "-d", str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def anchors(page) -> set:
    """The last part of every dotted anchor of a built page."""
    return {a.rsplit(".", 1)[-1] for a in re.findall(r'id="([^"]+)"', page.read_text())}


def test_the_reference_lists_every_public_name(site):
    import sandman_ray
    seen = set()
    for page in (site / "reference").glob("*/index.html"):
        seen |= anchors(page)
    assert [name for name in sandman_ray.__all__ if name not in seen] == []


def test_the_reference_lists_every_operation_of_the_handle(site):
    from sandman_ray.host import DESCRIBED, FORWARDED, STREAMED
    seen = anchors(site / "reference" / "handle" / "index.html")
    assert [op for op in FORWARDED + DESCRIBED + STREAMED if op not in seen] == []


def test_the_performance_table_is_the_results_files(site):
    import json
    page = (site / "performance" / "index.html").read_text()
    fusion = json.loads((ROOT / "bench" / "results" / "fusion.json").read_text())
    rate = fusion["results"]["fusion"]["run_code"]["per_s_at_64"]
    assert "%.0f /s" % rate in page  # the row as run_all.table writes it
    assert "bench/results/latest.json" in page


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
