"""Start and import time of the daemon: this checkout's package against the single-file
daemon of an earlier commit, side by side in one run.

Rows, each old against new, p50 and p90 (ms) over interleaved repetitions (every
repetition runs every row, old and new, alternating which goes first):
  import, checkout   ``python -I -S -c "import ..."``: the time, in the process, to import
                     what a daemon start imports (old: the module ``sandmand``; new:
                     ``sandmand.__main__`` and with it the whole package), compiled
                     modules from ``__pycache__``
  import, bundle zip the same with the bundle's interpreter, from its zipped stdlib (what
                     ``-m sandmand`` imports)
  import, launcher   what the bundle's launcher imports, as it does (new: the package from
                     lib/sandmand.pack)
  start, bundle      the bundle's launcher ``bin/sandmand``, from exec to the ready line
                     (``--listen unix:... --ready-fd N``, the token in SANDMAN_TOKEN)
  start, loader      the explicit loader form: old ``sandmand.py`` (compiled at every
                     start: the bundle is read-only in a sandbox), new ``sandmand.pyz``
  start, checkout    what the tests run: old ``python -I -S daemon/sandmand.py`` (a script
                     is compiled at every start), new ``python -I -S
                     sandman_ray/daemon/sandmand``
The bundle rows run the bundle's interpreter through its own dynamic loader
(``lib/ld-linux... --library-path lib bin/python3 -IS ...``), so the bundles need not be
mounted at /.sandman. Both bundles are built by their own checkout's builder. Prints a
table and one JSON line.

    python bench/daemon_start.py [--reps 200] [--old-rev 681ccb9]
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import progress  # bench/progress.py
from noop import percentile  # bench/noop.py

ROOT = Path(__file__).resolve().parent.parent
# the last commit whose daemon is one file, daemon/sandmand.py
OLD_REV = "681ccb9"
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "HOME": "/root", "LANG": "C.UTF-8", "SANDMAN_TOKEN": "bench-token-0123456789"}
IMPORT = ("import time; t = time.perf_counter(); import sys; sys.path[:0] = %r; "
          "n = len(sys.modules); import %s; print(time.perf_counter() - t, len(sys.modules) - n)")


def launcher_import(bundle: Path) -> str:
    """The bundle's launcher without its shebang and its last line (the call of main),
    timed as IMPORT times an import."""
    body = (bundle / "bin" / "sandmand").read_text().splitlines()[1:-1]
    return "\n".join(["import time, sys", "t = time.perf_counter()", "n = len(sys.modules)"]
                     + body + ["print(time.perf_counter() - t, len(sys.modules) - n)"])


def prepare(work: Path, old_rev: str) -> dict:
    """The old checkout and both bundles in ``work``; the argv of every row's two sides."""
    old_tree = work / "old-tree"
    old_tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", old_rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
    # its builder finds its daemon as sandman_ray.daemon, then at daemon/ (mapped when
    # installed); here a link does
    (old_tree / "sandman_ray" / "daemon").symlink_to("../daemon")
    for tree, dest in ((old_tree, work / "b-old"), (ROOT, work / "b-new")):
        subprocess.run([sys.executable, "-m", "sandman_ray.bundle", str(dest)], cwd=str(tree),
                       env=dict(os.environ, PYTHONPATH=str(tree)), check=True,
                       capture_output=True)
    python = os.path.realpath(sys.executable)

    def bundled(bundle: Path, *args: str) -> list:
        meta = json.loads((bundle / "BUNDLE.json").read_text())
        return [str(bundle / "lib" / meta["loader"]), "--library-path", str(bundle / "lib"),
                str(bundle / "bin" / "python3"), "-IS"] + list(args)
    old_daemon, new_daemon = (old_tree / "daemon" / "sandmand.py",
                              ROOT / "sandman_ray" / "daemon" / "sandmand")
    return {
        "import, checkout": (
            [python, "-I", "-S", "-c", IMPORT % ([str(old_daemon.parent)], "sandmand")],
            [python, "-I", "-S", "-c", IMPORT % ([str(new_daemon.parent)], "sandmand.__main__")]),
        "import, bundle zip": (bundled(work / "b-old", "-c", IMPORT % ([], "sandmand")),
                               bundled(work / "b-new", "-c", IMPORT % ([], "sandmand.__main__"))),
        "import, launcher": (bundled(work / "b-old", "-c", launcher_import(work / "b-old")),
                             bundled(work / "b-new", "-c", launcher_import(work / "b-new"))),
        "start, bundle": (bundled(work / "b-old", str(work / "b-old" / "bin" / "sandmand")),
                          bundled(work / "b-new", str(work / "b-new" / "bin" / "sandmand"))),
        "start, loader": (bundled(work / "b-old", "-B", str(work / "b-old" / "sandmand.py")),
                          bundled(work / "b-new", str(work / "b-new" / "sandmand.pyz"))),
        "start, checkout": ([python, "-I", "-S", str(old_daemon)],
                            [python, "-I", "-S", str(new_daemon)]),
    }


def import_time(argv: list) -> tuple:
    out = subprocess.run(argv, env=ENV, check=True, capture_output=True, text=True).stdout
    seconds, modules = out.split()
    return float(seconds), int(modules)


def start_time(argv: list, sock: Path) -> float:
    """Seconds from the start of the daemon process to its ready line; then stopped."""
    ready_r, ready_w = os.pipe()
    started = time.perf_counter()
    proc = subprocess.Popen(argv + ["--listen", "unix:%s" % sock, "--ready-fd", str(ready_w)],
                            pass_fds=(ready_w,), env=ENV, stdin=subprocess.DEVNULL)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as fh:
        line = fh.readline()
    elapsed = time.perf_counter() - started
    proc.terminate()
    proc.wait()
    if not line.startswith(b"unix:"):
        raise SystemExit("the daemon did not start: %s" % " ".join(argv))
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="per row and side (default 200)")
    parser.add_argument("--old-rev", default=OLD_REV, help="the commit to compare with")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sandman-start-"))
    try:
        rows = prepare(work, args.old_rev)
        samples = {(row, side): [] for row in rows for side in ("old", "new")}
        modules = {}
        for rep in progress.steps(range(args.reps + 3), "daemon start"):  # 3 warm-ups
            for row, argvs in rows.items():
                order = (0, 1) if rep % 2 else (1, 0)
                for index in order:
                    side = ("old", "new")[index]
                    if row.startswith("import"):
                        seconds, modules[(row, side)] = import_time(argvs[index])
                    else:
                        seconds = start_time(argvs[index], work / ("%s.sock" % side))
                    if rep >= 3:
                        samples[(row, side)].append(seconds)
        print("%-18s %11s %11s %11s %11s %9s" % ("", "old p50 ms", "old p90 ms",
                                                "new p50 ms", "new p90 ms", "new/old"))
        results = []
        for row in rows:
            old, new = samples[(row, "old")], samples[(row, "new")]
            figures = [percentile(s, q) * 1e3 for s in (old, new) for q in (0.5, 0.9)]
            ratio = figures[2] / figures[0]
            print("%-18s %11.2f %11.2f %11.2f %11.2f %9.3f" % ((row,) + tuple(figures) + (ratio,)))
            result = {"what": row, "old_p50_ms": round(figures[0], 3),
                      "old_p90_ms": round(figures[1], 3), "new_p50_ms": round(figures[2], 3),
                      "new_p90_ms": round(figures[3], 3), "new_over_old_p50": round(ratio, 3),
                      "samples": len(new)}
            if row.startswith("import"):
                result.update(old_modules=modules[(row, "old")], new_modules=modules[(row, "new")])
            results.append(result)
        print(json.dumps({"bench": "daemon_start", "old_rev": args.old_rev, "machine": {
            "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version()}, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "results": results}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
