"""MkDocs hooks of the documentation site (mkdocs.yml).

``<!-- api: MODULE [MODULE ...] -->`` in a page becomes mkdocstrings' entry of each
public name of ``sandman_ray`` (its ``_EXPORTS``) that those modules define, in that
order, so the reference lists every exported name and no list of them is kept by hand.

``<!-- bench-table: FILE[#SECTION,...] [...] -->`` in a page becomes the table that
``make bench`` printed for those results files (``bench/results/*.json``; of each, the
sections named, or all of them), made by the
benchmark suite's own ``run_all.table`` from the figures the files hold, never copied
by hand; under it, the machine and the time of the run.
"""

import argparse
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"<!-- bench-table: ([^>]+?) -->")
API = re.compile(r"<!-- api: ([^>]+?) -->")


def api_entries(modules) -> str:
    """mkdocstrings' directives for the exports of ``sandman_ray`` from ``modules``
    (the package is installed where the site is built: make docs, make test)."""
    import sandman_ray
    out = []
    for module in modules:
        for name in sandman_ray._EXPORTS[module]:
            found = getattr(importlib.import_module(module), name)  # (a lazy export's
            where = (found.__module__ if inspect.isclass(found) or inspect.isfunction(found)
                     else module)  # definition is found where it is written)
            out.append("::: %s.%s\n" % (where, name))
    return "\n".join(out)


def _cell(value) -> str:
    return str(value).replace("|", "\\|")


def bench_table(names) -> str:
    """The rows of the results files ``names`` (paths from the repository's root) as
    a Markdown table, then a line per file on where and when it ran."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import run_all
    finally:
        sys.path.remove(str(ROOT / "bench"))
    lines = ["| section | measure | result | |", "| --- | --- | ---: | --- |"]
    runs = []
    for spec in names:
        name, _, sections = spec.partition("#")
        report = json.loads((ROOT / name).read_text())
        args = argparse.Namespace(**report.get("args", {}))
        results = report["results"]
        if sections:
            missing = [s for s in sections.split(",") if s not in results]
            if missing:
                raise ValueError("%s has no section %s" % (name, ", ".join(missing)))
            results = {s: results[s] for s in sections.split(",")}
        for row in run_all.table(results, args):
            lines.append("| %s |" % " | ".join(_cell(v) for v in row))
        machine = report.get("machine", {})
        runs.append("`%s`%s: %s, %s CPUs (%s), %s GB, %s, Python %s, Ray %s, %s." % (
            name, " (%s)" % sections.replace(",", ", ") if sections else "",
            report.get("time", "?"), machine.get("cpus", "?"),
            machine.get("cpu_model", "?"), machine.get("memory_gb", "?"),
            machine.get("os", "?"), machine.get("python", "?"), machine.get("ray", "?"),
            "%.0f s" % report["duration_s"] if "duration_s" in report else "?"))
    return "\n".join(lines) + "\n\n" + "\n".join("- " + r for r in runs) + "\n"


def on_page_markdown(markdown, page, config, files):
    markdown = API.sub(lambda m: api_entries(m.group(1).split()), markdown)
    return MARK.sub(lambda m: bench_table(m.group(1).split()), markdown)
