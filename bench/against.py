"""Sections of ``make bench`` of this checkout beside a reference commit's, in one run.

A change that should cost nothing (a refactor, a move) is measured against the commit
before it: each turn runs the sections whole, in a process of its own, from REF's
worktree (``bench/baseline.py``) or from this checkout, in the order REF, this, this,
REF, ... so that a drift of the machine falls on both sides. Each figure (every p50
of ``noop`` and ``cycle``, time to 50 % and 100 % usable of each ``burst``) is the
median of its side's turns; the noise of a figure is how far its own turns spread
(the larger side's max over min), and a ratio inside that spread is within noise.

    python bench/against.py REF [--sections noop,cycle,burst] [--turns 3]

Prints a table and a JSON line; the report goes to ``bench/results/against.json``.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baseline  # noqa: E402  (bench/baseline.py)
from reports import write_report  # noqa: E402  (bench/reports.py)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "against.json"
FIGURES = ("p50_ms", "usable_50_s", "usable_100_s")  # what is compared, where a row has it


def figures(results: dict) -> Dict[str, float]:
    """``section / row / figure`` -> value, for every FIGURES key of every row."""
    out = {}
    for section, rows in results.items():
        for row, values in rows.items():
            if not isinstance(values, dict):
                continue
            for key in FIGURES:
                if isinstance(values.get(key), (int, float)):
                    out["%s / %s / %s" % (section, row, key)] = float(values[key])
    return out


def order(turns: int) -> List[str]:
    """REF, this, this, REF, REF, this, ...: each side as often first as second."""
    pairs = [("ref", "this") if i % 2 == 0 else ("this", "ref") for i in range(turns)]
    return [side for pair in pairs for side in pair]


def compare(turns: Dict[str, List[Dict[str, float]]]) -> Dict[str, dict]:
    """Per figure: each side's median, this over REF, the noise and the verdict."""
    out = {}
    for name in sorted(set(turns["ref"][0]) & set(turns["this"][0])):
        seen = {side: [t[name] for t in runs if name in t] for side, runs in turns.items()}
        median = {side: statistics.median(v) for side, v in seen.items()}
        noise = max(max(v) / min(v) - 1.0 if min(v) > 0 else 0.0 for v in seen.values())
        ratio = median["this"] / median["ref"] if median["ref"] > 0 else float("nan")
        out[name] = {"ref": median["ref"], "this": median["this"], "ratio": ratio,
                     "noise": noise, "within_noise": abs(ratio - 1.0) <= noise,
                     "turns": seen}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the commit to measure beside this checkout")
    parser.add_argument("--sections", default="noop,cycle,burst")
    parser.add_argument("--turns", type=int, default=3, help="turns of each side")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--section-args", default="--rounds 1",
                        help="arguments for run_all.py on both sides (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2: the noise is read from the turns")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    tree = baseline.baseline_tree(args.ref)
    if tree is None:
        print("against: no worktree of %s" % args.ref, file=sys.stderr)
        return 2
    started = time.monotonic()
    turns: Dict[str, List[Dict[str, float]]] = {"ref": [], "this": []}
    for side in order(args.turns):
        where = tree if side == "ref" else ROOT
        print("against: %s turn %d of %d" % (side, len(turns[side]) + 1, args.turns),
              file=sys.stderr, flush=True)
        turns[side].append(figures(baseline.run_sections(where, sections,
                                                         args.section_args.split())))
    compared = compare(turns)
    print("%-70s %10s %10s %7s %7s  %s"
          % ("figure", args.ref[:10], "this", "ratio", "noise", "verdict"))
    for name, row in compared.items():
        print("%-70s %10.3f %10.3f %6.2fx %6.0f%%  %s" % (
            name[:70], row["ref"], row["this"], row["ratio"], row["noise"] * 100,
            "within noise" if row["within_noise"] else
            ("slower" if row["ratio"] > 1 else "faster")))
    ratios = [r["ratio"] for r in compared.values() if r["ratio"] > 0]
    report = {"bench": "against", "ref": args.ref, "sections": sections, "turns": args.turns,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "duration_s": round(time.monotonic() - started, 1),
              "geomean_ratio": statistics.geometric_mean(ratios) if ratios else None,
              "within_noise": sum(r["within_noise"] for r in compared.values()),
              "figures": len(compared), "compared": compared}
    print("geometric mean of the ratios: %.3fx; %d of %d figures within noise"
          % (report["geomean_ratio"] or 0, report["within_noise"], report["figures"]))
    write_report(report, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
