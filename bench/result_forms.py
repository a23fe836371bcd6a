"""What a Ray actor call costs by the form of what it returns:

    python bench/result_forms.py [--rounds 40] [--calls 50]

One actor (``num_cpus=0``) answers four methods that each return an ``exec true``
outcome, already made, in a different form:

  int         its exit code, as the yardstick of ``make bench`` returns (Bare in run_all);
  list        its nine fields in a list (msgpack all the way);
  dict        the same as a dict;
  ExecResult  the NamedTuple that ``sb.exec.remote()`` returns.

Ray encodes int, list and dict with msgpack and sends any instance of a class, a
NamedTuple of an importable module included, through cloudpickle. The forms are
called in shuffled blocks of ``--calls`` (one untimed call first) for ``--rounds``
rounds; reported are each form's p50 and p99 and its p50 over the int's.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sandman_ray.results import ExecResult  # noqa: E402

import progress  # noqa: E402  (bench/progress.py)

RESULT = ExecResult(0, b"", b"", 0.0009, False, None, False, True, False)


@ray.remote(num_cpus=0)
class Answers:
    def int(self):
        return RESULT.exit_code

    def list(self):
        return list(RESULT)

    def dict(self):
        return RESULT._asdict()

    def ExecResult(self):
        return RESULT


def measure(rounds: int = 40, calls: int = 50) -> dict:
    actor = Answers.remote()
    forms = ["int", "list", "dict", "ExecResult"]
    times = {form: [] for form in forms}
    for form in forms:
        ray.get(getattr(actor, form).remote())
    for _ in progress.steps(range(rounds), "result forms"):
        random.shuffle(forms)
        for form in forms:
            method = getattr(actor, form)
            ray.get(method.remote())
            for _ in range(calls):
                started = time.perf_counter()
                ray.get(method.remote())
                times[form].append(time.perf_counter() - started)
    ray.kill(actor)
    floor = statistics.median(times["int"])
    return {form: {"p50_ms": round(statistics.median(t) * 1e3, 3),
                   "p99_ms": round(sorted(t)[int(len(t) * 0.99)] * 1e3, 3),
                   "vs_int": round(statistics.median(t) / floor, 3)}
            for form, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        result = measure(args.rounds, args.calls)
    finally:
        ray.shutdown()
    print("%-11s %8s %8s %7s" % ("returns", "p50 ms", "p99 ms", "vs int"))
    for form in ("int", "list", "dict", "ExecResult"):
        row = result[form]
        print("%-11s %8.3f %8.3f %6.2fx" % (form, row["p50_ms"], row["p99_ms"], row["vs_int"]))
    print(json.dumps({"result_forms": result}))


if __name__ == "__main__":
    main()
