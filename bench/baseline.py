"""A reference commit's checkout, and its sections of ``make bench`` run from it.

A change that must not cost is measured beside the commit before it, in the same run:
the commit's code runs from a git worktree (``.cache/baseline/REF``, made once) in a
process of its own (its own Ray, its own daemon bundle), with the same arguments as
this checkout's turn. ``isolation.py --against`` and ``against.py`` use it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent


def baseline_tree(ref: str) -> Optional[Path]:
    """A worktree of commit ``ref`` (made once, detached), runnable as a package of its
    own; None where git or the commit is missing."""
    where = ROOT / ".cache" / "baseline" / ref
    if not (where / "bench" / "run_all.py").exists():
        done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force",
                               str(where), ref], capture_output=True, text=True)
        if done.returncode != 0:
            print("baseline: no worktree of %s: %s" % (ref, done.stderr.strip()),
                  file=sys.stderr)
            return None
    # a tree from before the daemon moved into the package had it at daemon/, mapped to
    # sandman_ray.daemon when installed; here a link does
    link = where / "sandman_ray" / "daemon"
    if (where / "daemon").is_dir() and not link.exists():
        link.symlink_to("../daemon")
    return where


def run_sections(tree: Path, sections: List[str], args: List[str] = ()) -> dict:
    """``tree``'s ``bench/run_all.py`` for ``sections`` (with ``args``), in a process of
    its own; its results by section. Its report goes to a file of its own (a run_all
    from before ``--results`` writes the worktree's own latest.json, not this one's)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    run_all = tree / "bench" / "run_all.py"
    report_file = tree / ".cache" / "against-turn.json"
    report_file.parent.mkdir(parents=True, exist_ok=True)
    report = ["--results", str(report_file)] if '"--results"' in run_all.read_text() else []
    done = subprocess.run([sys.executable, str(run_all), "--sections", ",".join(sections)] +
                          report + list(args),
                          cwd=str(tree), env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError("%s's sections %s failed: %s"
                           % (tree, ",".join(sections), done.stderr[-2000:]))
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]
