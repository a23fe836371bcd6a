"""How a bench command ends: its report as a JSON file and as its last line (which a
caller, ``baseline.run_sections`` among them, reads)."""

import json
from pathlib import Path


def write_report(report: dict, path) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
