"""Code-repair tasks for the rollout example: small buggy repositories, the edits an
agent may apply, and the observation features a policy sees.

Each task is a one-module repository with its own test script. The module holds one
function from a bug family with one seeded bug; names, data and expected values are
drawn at random, so no two tasks are the same text. The agent fixes it by choosing one
of ``EDITS`` (a rewrite of the first place a pattern matches); only the right family's
edit makes the tests pass. The test script prints one line per failing case
(``FAIL case: got=... expected=...`` or ``ERROR Type: message``), which is what the
policy learns to read.

The same file serves the driver, the rollout workers, the gymnasium environment and
the tests.
"""

import random
import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

from sandman_ray.client import tar_of

REPO_DIR = "/tmp/repo"  # where a task's repository is put in its sandbox (writable in every image)
# -B: no bytecode cache, which an edit of the same size in the same second leaves stale
TEST_COMMAND = "python3 -B test_task.py"


@dataclass(frozen=True)
class Edit:
    """One candidate edit: replace the first match of ``pattern`` with ``replacement``."""

    name: str
    pattern: str
    replacement: str

    def applies(self, source: str) -> bool:
        return re.search(self.pattern, source) is not None

    def apply(self, source: str) -> str:
        return re.sub(self.pattern, self.replacement, source, count=1)


EDITS: Tuple[Edit, ...] = (
    Edit("drop '- 1' from a loop bound", r" - 1\)", ")"),
    Edit("'<' to '<='", r"<(?!=)", "<="),
    Edit("'>' to '<'", r">(?!=)", "<"),
    Edit("start an accumulator at 1", r"= 0\n", "= 1\n"),
    Edit("'-' to '+'", r" - (?!1\))", " + "),
    Edit("'/' to '//'", r" / ", " // "),
    Edit("'+' to '-'", r" \+ ", " - "),
    Edit("'*' to '+'", r" \* ", " + "),
)

# family -> (function template with the bug, how to compute the right answer)
FAMILIES: Dict[str, str] = {
    "loop_bound": (
        "def {fn}({xs}):\n"
        "    {acc} = 0\n"
        "    for i in range(len({xs}) - 1):\n"
        "        {acc} = {acc} + {xs}[i]\n"
        "    return {acc}\n"),
    "strict_compare": (
        "def {fn}({xs}, limit):\n"
        "    {acc} = 0\n"
        "    for x in {xs}:\n"
        "        if x < limit:\n"
        "            {acc} = {acc} + 1\n"
        "    return {acc}\n"),
    "inverted_compare": (
        "def {fn}({xs}):\n"
        "    best = {xs}[0]\n"
        "    for x in {xs}[1:]:\n"
        "        if x > best:\n"
        "            best = x\n"
        "    return best\n"),
    "accumulator_init": (
        "def {fn}({xs}):\n"
        "    {acc} = 0\n"
        "    for x in {xs}:\n"
        "        {acc} = {acc} * x\n"
        "    return {acc}\n"),
    "wrong_operator": (
        "def {fn}({xs}):\n"
        "    {acc} = 0\n"
        "    for x in {xs}:\n"
        "        {acc} = {acc} - x\n"
        "    return {acc}\n"),
    "float_division": (
        "def {fn}({xs}):\n"
        "    {acc} = 0\n"
        "    for x in {xs}:\n"
        "        {acc} = {acc} + x\n"
        "    return {acc} / len({xs})\n"),
}

# Lines of a helper function placed after the one with the bug: they never run in the
# tests, but each offers one more edit, so the edits that apply do not give the bug away.
DECOY_LINES = (
    "    last = {xs}[len({xs}) - 1]\n",
    "    low = min({xs}) < 0\n",
    "    high = max({xs}) > 100\n",
    "    count = 0\n",
    "    span = max({xs}) - min({xs})\n",
    "    half = len({xs}) / 2\n",
    "    size = len({xs}) + 1\n",
    "    double = len({xs}) * 2\n",
)

FIX = {"loop_bound": 0, "strict_compare": 1, "inverted_compare": 2, "accumulator_init": 3,
       "wrong_operator": 4, "float_division": 5}


def _expected(family: str, data: List[int], limit: int) -> int:
    if family == "loop_bound" or family == "wrong_operator":
        return sum(data)
    if family == "strict_compare":
        return sum(1 for x in data if x <= limit)
    if family == "inverted_compare":
        return min(data)
    if family == "accumulator_init":
        product = 1
        for x in data:
            product *= x
        return product
    return sum(data) // len(data)


TEST_SCRIPT = '''import sys
from {module} import {fn}

CASES = {cases!r}
failed = 0
for args, expected in CASES:
    try:
        got = {fn}(*args)
    except Exception as exc:
        print("ERROR %s: %s" % (type(exc).__name__, exc))
        failed += 1
        continue
    if got != expected or type(got) is not type(expected):
        print("FAIL case: got=%r expected=%r" % (got, expected))
        failed += 1
print("%d passed, %d failed" % (len(CASES) - failed, failed))
sys.exit(1 if failed else 0)
'''


@dataclass(frozen=True)
class Task:
    """A buggy repository: ``files`` maps relative paths to contents."""

    task_id: str
    family: str
    module_path: str
    files: Dict[str, str]

    def tar(self) -> bytes:
        """The repository as a tar stream, for ``put_archive`` into ``REPO_DIR``."""
        return tar_of(self.files)


def make_task(seed: int) -> Task:
    """A task drawn from ``seed`` (the same seed gives the same task)."""
    rng = random.Random(seed)
    family = sorted(FAMILIES)[rng.randrange(len(FAMILIES))]
    fn = rng.choice(["total", "score", "reduce_items", "combine", "fold", "tally"]) \
        + "_%d" % rng.randrange(1000)
    names = {"fn": fn, "xs": rng.choice(["xs", "values", "items", "nums"]),
             "acc": rng.choice(["acc", "result", "out", "running"])}
    module = "lib_%s" % rng.choice(["core", "util", "calc", "stats"])
    cases = []
    for _ in range(3):
        # positive numbers above 1: no case where the buggy code is right by accident
        data = [rng.randrange(2, 9) for _ in range(rng.randrange(3, 6))]
        limit = rng.choice(data)
        if family == "strict_compare":
            data.append(limit)  # twice: starting the count at 1 must not pass by luck
        if family == "float_division" and sum(data) % len(data) == 0:
            data[0] += 1
        args = [data, limit] if family == "strict_compare" else [data]
        cases.append((args, _expected(family, data, limit)))
    decoys = rng.sample(DECOY_LINES, rng.randrange(2, 6))
    helper = ("\n\ndef describe({xs}):\n" + "".join(decoys)
              + "    return locals()\n").format(**names)
    files = {module + ".py": FAMILIES[family].format(**names) + helper,
             "test_task.py": TEST_SCRIPT.format(module=module, fn=fn, cases=cases)}
    return Task("task-%d" % seed, family, module + ".py", files)


# ------------------------------------------------------------------ observations
TEST_SIGNALS = ("got_less", "got_greater", "got_zero", "got_negated", "got_float", "error")
FEATURES = TEST_SIGNALS + tuple("function offers " + e.name for e in EDITS) + ("bias",)
FAIL_LINE = re.compile(r"FAIL case: got=(\S+) expected=(\S+)")


def test_signals(output: str) -> Dict[str, bool]:
    """What the failing cases in a test run's output say about the bug."""
    signals = dict.fromkeys(TEST_SIGNALS, False)
    for line in output.splitlines():
        if line.startswith("ERROR "):
            signals["error"] = True
        match = FAIL_LINE.match(line)
        if not match:
            continue
        try:
            got, expected = float(match.group(1)), float(match.group(2))
        except ValueError:
            signals["error"] = True
            continue
        signals["got_float"] |= "." in match.group(1) and "." not in match.group(2)
        signals["got_zero"] |= got == 0 and expected != 0
        signals["got_negated"] |= got == -expected and got != 0
        signals["got_less"] |= got < expected
        signals["got_greater"] |= got > expected
    return signals


def function_under_test(source: str) -> str:
    """The module's first function: the one its tests call."""
    return source.split("\n\n\ndef ", 1)[0]


def features(source: str, test_output: str) -> List[float]:
    """The policy's observation: test signals, which edits would touch the function
    under test, a bias."""
    signals = test_signals(test_output)
    function = function_under_test(source)
    return ([float(signals[name]) for name in TEST_SIGNALS]
            + [float(edit.applies(function)) for edit in EDITS] + [1.0])


def edit_mask(source: str) -> List[bool]:
    """Which edits change ``source`` (the others are not offered)."""
    return [edit.applies(source) for edit in EDITS]
