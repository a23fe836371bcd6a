"""Our sandboxes beside the ones a user would pick instead, on the same work, in one run.

For each peer and for our comparable isolation level (``bench/local.py``'s setups):

  create -> first ``exec true`` answered   one at a time (p50 of --creates), and a burst
                                            of --burst at once (time to 50 % and 100 %)
  ``exec true``                             p50 / p99 over --execs calls on a live sandbox
  idle memory                               PSS of every process that serves a sandbox
                                            (ours: daemon and bwrap, or daemon and conmon),
                                            and how many idle sandboxes fit in 8 GB
  fork                                      a live sandbox into 8 and 100 copies, beside
                                            sandlock's fork (bench/peer_forks.py)

Each peer row names the level of ours it stands beside and what the peer gives up or
adds; a peer that cannot run here says why (the error, measured), not a figure. Our
levels are taken apart (a create moment by moment: bench/stages.py; an idle sandbox's
memory and daemon, and what the kernel charges for parts of a sandbox:
bench/anatomy.py), and where a peer is ahead, a row says what it does without, with
those figures, and ours less it (bench/peer_gaps.py).

    python bench/peers.py [--peers podman,...] [--creates 20] [--burst 100] [--execs 1000]
"""

import argparse
import asyncio
import concurrent.futures
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local import (  # noqa: E402  (bench/local.py)
    SETUPS, busybox_rootfs, measure, pct, pss_by_process)
import anatomy  # noqa: E402  (bench/anatomy.py)
import peer_forks  # noqa: E402  (bench/peer_forks.py)
import peer_gaps  # noqa: E402  (bench/peer_gaps.py)
import stages  # noqa: E402  (bench/stages.py)
from common import CACHE  # noqa: E402  (bench/common.py)

ROOT = Path(__file__).resolve().parent.parent
EIGHT_GB_KB = 8 * 1024 * 1024
FORKS = (8, 100)  # copies of a live sandbox, beside sandlock's fork


class Peer:
    """A sandbox system measured beside ours: ``create`` returns once the sandbox
    answered its first ``exec true``."""

    name = ""
    ours = "local"  # the setup of ours it stands beside (bench/local.py SETUPS)
    trade = ""      # what it gives up or adds against ours

    def setup(self) -> None:
        """Raise with the reason when the peer cannot run here."""

    def teardown(self) -> None:
        pass

    def create(self):
        raise NotImplementedError

    def exec_true(self, box) -> None:
        raise NotImplementedError

    def destroy(self, box) -> None:
        raise NotImplementedError

    def pids(self, box) -> List[int]:
        return []


def _run(argv: List[str], what: str, timeout: float = 120) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError("%s: %s exited %d: %s" % (what, argv[0], done.returncode,
                                                     done.stderr.strip()[-500:]))
    return done.stdout


class Podman(Peer):
    """``podman run -d`` and ``podman exec``: containers and no sandbox service."""

    name = "podman run -d + exec"
    ours = "docker"
    trade = ("no daemon inside (its idle sandbox is conmon and a sleep: less memory), so "
             "each command is a new podman process; no pool, lease, reset or API; runc, "
             "no user namespace of its own")
    image = "localhost/sandman-bench/peer-busybox:1"

    def setup(self) -> None:
        if shutil.which("podman") is None:
            raise RuntimeError("podman is not installed")
        tar = subprocess.run(["tar", "-C", str(busybox_rootfs()), "-c", "."], capture_output=True,
                             check=True).stdout
        done = subprocess.run(["podman", "import", "-", self.image], input=tar,
                              capture_output=True)
        if done.returncode != 0:
            raise RuntimeError("podman import: %s" % done.stderr.decode().strip()[-500:])

    def teardown(self) -> None:
        subprocess.run(["podman", "rmi", "-f", self.image], capture_output=True)

    def create(self):
        name = "sandman-peer-" + uuid.uuid4().hex[:10]
        _run(["podman", "run", "-d", "--rm", "--network", "none", "--name", name, self.image,
              "sleep", "1000000"], "podman run")
        self.exec_true(name)
        return name

    def exec_true(self, box) -> None:
        _run(["podman", "exec", box, "true"], "podman exec")

    def destroy(self, box) -> None:
        _run(["podman", "rm", "-f", "-t", "0", box], "podman rm")

    def pids(self, box) -> List[int]:
        out = _run(["podman", "inspect", "--format", "{{.State.Pid}} {{.State.ConmonPid}}",
                    box], "podman inspect").split()
        return [int(p) for p in out if p.isdigit() and int(p) > 0]


class Sandlock(Peer):
    """PyPI ``sandlock``: Landlock and seccomp user notification, no root. A sandbox
    runs one process: here a shell, which each command is a line to."""

    name = "sandlock (Landlock + seccomp)"
    ours = "local"
    trade = ("no namespaces (the host's pids, network stack and kernel behind Landlock "
             "and a seccomp filter); one process per sandbox, no exec into it (commands "
             "here are lines to a shell it runs); its supervisor runs in the caller's "
             "process (not counted in its PSS); no pool, lease or reset")

    def setup(self) -> None:
        importlib.import_module("sandlock")  # the bench extra installs it
        self.rootfs = str(busybox_rootfs())

    def create(self):
        from sandlock import Sandbox, StdioMode
        box = Sandbox(chroot=self.rootfs, fs_readable=["/"], fs_writable=["/tmp"])
        proc = box.popen(["/bin/sh"], stdin=StdioMode.PIPED, stdout=StdioMode.PIPED,
                         stderr=StdioMode.PIPED)
        self.exec_true(proc)
        return proc

    def exec_true(self, box) -> None:
        box.stdin.write(b"/bin/true; echo rc=$?\n")
        box.stdin.flush()
        line = box.stdout.readline()
        if line != b"rc=0\n":
            raise RuntimeError("sandlock: /bin/true answered %r" % line)

    def destroy(self, box) -> None:
        box.kill()
        box.wait()

    def pids(self, box) -> List[int]:
        from sandman_ray.daemon.sandmand.spawn import descendants
        return [box.pid] + descendants(box.pid) if box.pid else []


class GVisorBindings(Peer):
    """PyPI ``gvisor``: ``Sandbox()`` (runsc run --detach) and ``exec`` (runsc exec)."""

    name = "gvisor (Python bindings)"
    ours = "local-gvisor"
    trade = ("no image: its root is the host's /bin, /usr and /lib read-only; one runsc "
             "exec (a new runsc process) per command; no pool, lease, reset or snapshot")

    def setup(self) -> None:
        importlib.import_module("gvisor")  # the bench extra installs it
        if shutil.which("runsc") is None:
            raise RuntimeError("runsc is not installed")

    def create(self):
        from gvisor import Sandbox
        box = Sandbox(network="none")
        self.exec_true(box)
        return box

    def exec_true(self, box) -> None:
        box.exec("/bin/true")  # raises gvisor.Error on a non-zero exit

    def destroy(self, box) -> None:
        box.close()

    def pids(self, box) -> List[int]:
        """Its runsc processes (the sandbox, whose sentry holds the guest's memory, and
        the gofer): those whose command line names the sandbox's id."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as fh:
                    if box._id.encode() in fh.read():  # (the bindings keep it private)
                        found.append(int(pid))
            except OSError:
                continue
        return found


class RaySandbox(Peer):
    """Ray's own ``ray.experimental.sandbox``: an actor per sandbox, gVisor inside,
    one ``runsc exec`` per command; its images become EROFS root filesystems."""

    name = "Ray's sandbox (ray.experimental.sandbox)"
    ours = "local-gvisor"
    trade = "an actor per sandbox; one runsc exec per command; no pool, lease or reset"

    def setup(self) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="sandman-peer-ray-"))
        tar = self.work / "busybox.tar"
        subprocess.run(["tar", "-C", str(busybox_rootfs()), "-cf", str(tar), "."], check=True)
        self.image = str(tar)
        try:  # what it takes to run here, said by its own first create
            self.destroy(self.create())
        except Exception:
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def teardown(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def create(self):
        import ray
        from ray.experimental import sandbox
        box = sandbox.create(image=self.image, cpu=0, network="none",
                             env={"PATH": "/usr/bin:/bin"})
        try:
            self.exec_true(box)
        except Exception:
            ray.kill(box)
            raise
        return box

    def exec_true(self, box) -> None:
        import ray
        result = ray.get(box.exec.remote(["/bin/true"]))
        if result.exit_code != 0:
            raise RuntimeError("Ray's sandbox: /bin/true exited %d" % result.exit_code)

    def destroy(self, box) -> None:
        import ray
        try:
            ray.get(box.delete.remote())
        finally:
            ray.kill(box)


PEERS: Dict[str, Callable[[], Peer]] = {"podman": Podman, "sandlock": Sandlock,
                                        "gvisor": GVisorBindings, "ray-sandbox": RaySandbox}


def measure_peer(peer: Peer, creates: int, burst: int, execs: int) -> dict:
    """The rows of one peer, in the same shape as ours."""
    peer.destroy(peer.create())  # warm: images, caches
    single = []
    for _ in range(creates):
        started = time.perf_counter()
        box = peer.create()
        single.append(time.perf_counter() - started)
        peer.destroy(box)
    out = {"create_sequential": {"p50_ms": pct(single, 0.5) * 1e3,
                                 "p99_ms": pct(single, 0.99) * 1e3, "samples": creates}}
    started = time.perf_counter()

    def one():
        box = peer.create()
        return box, time.perf_counter() - started
    # the creating threads live until the sandboxes are gone: a peer's sandbox may die
    # with the thread that started it (PR_SET_PDEATHSIG follows the thread)
    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        made = list(pool.map(lambda _: one(), range(burst)))
        answered = [t for _, t in made]
        out["create_burst"] = {"n": burst, "usable_50_s": pct(answered, 0.5),
                               "usable_100_s": max(answered)}
        box = made[0][0]
        times = []
        for _ in range(execs):
            t = time.perf_counter()
            peer.exec_true(box)
            times.append(time.perf_counter() - t)
        out["exec_true"] = {"p50_ms": pct(times, 0.5) * 1e3, "p99_ms": pct(times, 0.99) * 1e3,
                            "samples": execs}
        by_name = pss_by_process([peer.pids(b) for b, _ in made])
        if any(by_name.values()):
            out["pss_kb_per_sandbox"] = sum(by_name.values())
            out["pss_kb_by_process"] = by_name
        list(pool.map(lambda m: peer.destroy(m[0]), made))
    return out


def why_not(exc: BaseException) -> str:
    """The root of ``exc``, said in one line: the innermost error's last line that names
    an error (a Ray actor's death carries its creation task's traceback)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", "%s: %s" % (type(exc).__name__, exc))
    named = [line.strip() for line in text.splitlines() if "Error" in line and ":" in line]
    return (named[-1] if named else text.strip().splitlines()[-1])[:400]


def ours(setup: str, creates: int, burst: int, execs: int) -> dict:
    """Our level ``setup`` (bench/local.py), measured the same way, then taken apart
    (bench/stages.py, bench/anatomy.py): a create moment by moment (where the launch is
    a process of ours) and an idle sandbox's memory and daemon."""
    args = SimpleNamespace(image=None, docker_image=None, creates=creates, bursts=[1, burst],
                           execs=execs, resets=1)
    provider, spec, pid_of, teardown = SETUPS[setup](args)

    async def measured():
        try:
            _, out = await measure(provider, spec, args, pid_of, shut_down=False)
            big = out["create_%d" % burst]
            mine = {"create_sequential": out["create_sequential"],
                    # a burst's creates all start at once: its p50 is when half answered
                    "create_burst": {"n": burst, "usable_50_s": big["p50_ms"] / 1e3,
                                     "usable_100_s": big["all_s"]},
                    "exec_true": out["exec_true"],
                    "pss_kb_per_sandbox": out["pss_kb_per_sandbox"]}
            if setup != "docker":  # (a Podman container's launch is Podman's processes)
                mine["create_stages"] = await stages.create_stages(
                    provider, spec, max(5, creates // 2), lambda info: info.details["pid"])
            mine["anatomy"] = await anatomy.anatomy(provider, spec, burst, pid_of)
            return mine
        finally:
            await provider.shutdown()
    try:
        return asyncio.run(measured())
    finally:
        if teardown:
            teardown()


def kernel_figures() -> dict:
    """What the kernel charges for parts of a sandbox, each a figure or why not."""
    figures = {"cgroup_v1_move_ms": anatomy.cgroup_move_ms,
               "namespaces_cpu_ms": lambda: anatomy.namespaces_cpu_ms(busybox_rootfs()),
               "interpreter_pss_kb": lambda: anatomy.interpreter_pss_kb(Path(CACHE) / "bundle")}
    out: dict = {}
    for name, measure_it in figures.items():
        try:
            out[name] = measure_it()
        except Exception as exc:  # noqa: BLE001 - said in its place
            out[name], out.setdefault("why_not", {})[name] = None, why_not(exc)
    return out


def peers(names: List[str], creates: int = 20, burst: int = 100, execs: int = 1000) -> dict:
    """Each peer of ``names`` and the levels of ours they stand beside."""
    out: Dict[str, dict] = {"ours": {}, "peers": {}, "kernel": kernel_figures()}
    for name in names:
        peer = PEERS[name]()
        row: dict = {"name": peer.name, "ours": peer.ours, "trade": peer.trade}
        try:
            peer.setup()
            try:
                row.update(measure_peer(peer, creates, burst, execs))
            finally:
                peer.teardown()
        except Exception as exc:  # noqa: BLE001 - the row says why it could not run
            row["could_not_run"] = why_not(exc)
        out["peers"][name] = row
        if peer.ours not in out["ours"]:
            out["ours"][peer.ours] = ours(peer.ours, creates, burst, execs)
        if "could_not_run" not in row and name in peer_gaps.DOES_WITHOUT:
            row["does_without"] = peer_gaps.DOES_WITHOUT[name](out["ours"][peer.ours], out, row)
    if "could_not_run" not in out["peers"].get("sandlock", {"could_not_run": ""}):
        try:
            out["forks"] = peer_forks.forks(FORKS, 3, str(busybox_rootfs()))
        except (Exception, SystemExit) as exc:  # (bench/common.wait_for gives up so)
            out["forks"] = {"could_not_run": why_not(exc)}
    return out


FIGURES = (("create -> first exec, one at a time (p50)", "create_sequential", "p50_ms", "ms"),
           ("create -> first exec, burst: 50 % usable", "create_burst", "usable_50_s", "s"),
           ("create -> first exec, burst: 100 % usable", "create_burst", "usable_100_s", "s"),
           ("exec true p50", "exec_true", "p50_ms", "ms"),
           ("exec true p99", "exec_true", "p99_ms", "ms"))


def ratio(ours_: float, theirs: float) -> str:
    return ("%.2fx" if ours_ / theirs >= 0.1 else "%.4fx") % (ours_ / theirs)


def rows(s: dict) -> List[tuple]:
    """(section, measure, value, note) rows: each peer's figure with ours beside it, and
    where theirs is ahead, ours less what the peer does without (bench/peer_gaps.py)."""
    out, shown = [], set()
    kernel = s.get("kernel", {})
    if kernel.get("cgroup_v1_move_ms") is not None:
        out.append(("peers", "the kernel: a thread moved into one cgroup v1 group and back",
                    "%.2f ms" % kernel["cgroup_v1_move_ms"], "what a launch's first process "
                    "pays to start in the sandbox's groups"))
    for name, why in kernel.get("why_not", {}).items():
        out.append(("peers", "the kernel: %s not measured" % name, "-", why[:120]))
    for name, peer in s["peers"].items():
        if "could_not_run" in peer:
            out.append(("peers", "%s: could not run here" % peer["name"],
                        "-", peer["could_not_run"][:120]))
            continue
        mine = s["ours"][peer["ours"]]
        if peer["ours"] not in shown:
            shown.add(peer["ours"])
            out += _ours_apart(peer["ours"], mine)
        without = peer.get("does_without", {})
        for label, group, key, unit in FIGURES + (
                ("idle PSS per sandbox (fit in 8 GB)", "pss_kb_per_sandbox", None, "MB"),):
            if key is None:
                if group not in peer:
                    continue
                theirs, ours_, figure = peer[group] / 1024, mine[group] / 1024, group
                fit = " (%d)" % (EIGHT_GB_KB // peer[group]), " (%d)" % (EIGHT_GB_KB // mine[group])
            else:
                theirs, ours_, figure = peer[group][key], mine[group][key], group + "." + key
                fit = ("", "")
            out.append(("peers", "%s: %s" % (peer["name"], label),
                        "%.2f %s%s" % (theirs, unit, fit[0]),
                        "ours (%s) %.2f %s%s: %s theirs" % (peer["ours"], ours_, unit, fit[1],
                                                            ratio(ours_, theirs))))
            if ours_ > theirs and without.get(figure):
                out.append(peer_gaps.less_row(unit, ours_, theirs, without[figure]))
        out.append(("peers", "%s: against ours" % peer["name"], "", peer["trade"]))
    if "could_not_run" in s.get("forks", {}):
        out.append(("peers", "forks: could not run here", "-",
                    s["forks"]["could_not_run"][:120]))
    elif "forks" in s and "local" in s["ours"]:
        out += peer_forks.rows(s["forks"], s["ours"]["local"]["anatomy"],
                               kernel.get("namespaces_cpu_ms"))
    return out


def _ours_apart(level: str, mine: dict) -> List[tuple]:
    """Our level taken apart: its create's moments, its idle sandbox's memory and its
    daemon's start."""
    out = []
    if "create_stages" in mine:
        out.append(("peers", "ours (%s): a create's moments, ms from its call" % level, "",
                    ", ".join("%s %.1f" % (name, at)
                              for name, at in mine["create_stages"]["stages_ms"])))
    a = mine.get("anatomy")
    if a:
        out.append(("peers", "ours (%s): idle PSS per sandbox by process" % level, "",
                    ", ".join("%s %.2f MB" % (name, kb / 1024)
                              for name, kb in a["pss_kb_by_process"].items()) +
                    (", the agent's share %.2f MB" % (a["agent_share_kb"] / 1024)
                     if a["agent_share_kb"] is not None else "")))
        out.append(("peers", "ours (%s): the daemon's start in a sandbox" % level,
                    "%.1f ms" % a["daemon_start_ms"],
                    "%.1f ms of CPU; the interpreter alone %.1f ms%s"
                    % (a["daemon_start_cpu_ms"], a["interpreter_start_ms"],
                       "; then resident %.2f MB by the sandbox's /proc"
                       % (a["daemon_kb_inside"]["VmRSS"] / 1024)
                       if "VmRSS" in a.get("daemon_kb_inside", {}) else "")))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    from common import run_alone  # noqa: E402  (bench/common.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--execs", type=int, default=1000)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        parser.error("unknown peers %s (known: %s)" % (unknown, ", ".join(PEERS)))
    os.environ.setdefault("SANDMAN_IMAGE_ROOTS", str(ROOT / ".cache" / "images"))
    return run_alone(lambda: peers(names, args.creates, args.burst, args.execs), rows, "peers")


if __name__ == "__main__":
    sys.exit(main())
