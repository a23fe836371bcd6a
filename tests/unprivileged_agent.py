"""Run by tests/test_escape_network.py as an unprivileged user (not root): what a LocalProvider
agent that is not root does for a sandbox (bwrap.SandboxProcess, unprivileged), then
the attacks from inside, through the daemon's client. Prints one JSON object: what
each attack printed, and what the host saw.

    python tests/unprivileged_agent.py WORK_DIR LISTENER_PORT [NODE_ADDRESS ...]

With SANDMAN_PROBE (a path) and SANDMAN_PROBE_CHECKS set, it runs only the escape
probe with those checks in one sandbox, and prints its report.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from sandman_ray import DaemonClient
from sandman_ray.bundle import ensure_bundle
from sandman_ray.image_builders import build_busybox_rootfs
from sandman_ray.images import PreparedImage
from sandman_ray.providers.local.bwrap import SandboxProcess, secure_root
from sandman_ray.spec import SandboxSpec
from sandbox_pids import daemon_under


def sandbox(name, image, bundle, state, **spec):
    process = SandboxProcess(name, image, bundle, state / name,
                             SandboxSpec(image=image.image, **spec), view_root=state,
                             unprivileged=True)
    process.launch()
    process.wait_ready_blocking(30)
    return process, DaemonClient(process.address, process.token, default_timeout=60)


def sh(client, cmd: str) -> str:
    r = client.exec(["/bin/sh", "-c", cmd])
    return (r.stdout + r.stderr).decode()


def probe(client, path: str, checks) -> dict:
    """The escape probe's report in a sandbox (tests/test_escape_bench.py)."""
    with open(path, "rb") as fh:
        client.write_file("/tmp/.sandman-probe", fh.read(), mode=0o755)
    r = client.exec(["/tmp/.sandman-probe"] + list(checks), timeout=120)
    return {"text": r.stdout.decode(), "status": sh(client, "cat /proc/self/status"),
            "mountinfo": sh(client, "cat /proc/self/mountinfo"),
            "release_agents": sh(client, "ls /sys/fs/cgroup/*/release_agent "
                                         "/sys/fs/cgroup/release_agent 2>/dev/null; true")}


def main() -> None:
    work, port = Path(sys.argv[1]), int(sys.argv[2])
    cache, state = secure_root(work / "cache"), secure_root(work / "state")
    bundle = ensure_bundle(cache / "bundle")
    rootfs = build_busybox_rootfs(cache / "images" / "busybox")
    busybox = PreparedImage("dir:%s" % rootfs, rootfs)
    host = PreparedImage("host", None)
    out = {"agent_uid": os.geteuid()}
    if os.environ.get("SANDMAN_PROBE"):  # only the probe, in a busybox sandbox
        box, client = sandbox("u-probe", busybox, bundle, state)
        try:
            out["probe"] = probe(client, os.environ["SANDMAN_PROBE"],
                                 os.environ["SANDMAN_PROBE_CHECKS"].split())
        finally:
            client.close()
            box.remove()
        print(json.dumps(out))
        return
    # more processes of the agent's uid than the sandbox's pids limit: they must not
    # count against it
    others = [subprocess.Popen(["sleep", "120"]) for _ in range(80)]
    box, client = sandbox("u-busybox", busybox, bundle, state, disk=32 * 2 ** 20, pids=64)
    try:
        out["forks"] = sh(client, "for i in 1 2 3 4 5; do /bin/true || echo failed; done; "
                                  "echo forked")
        pid = daemon_under(box.proc.pid)
        with open("/proc/%d/status" % pid) as fh:
            out["daemon_ids"] = [line.split()[1:] for line in fh
                                 if line.startswith(("Uid:", "Gid:"))]
        out["id"] = sh(client, "id -u; id -g")
        out["proc_sys"] = sh(client, "echo '|/tmp/pwn' > /proc/sys/kernel/core_pattern; "
                                     "echo rc=$?")
        out["setuid"] = sh(client, "cp /bin/busybox /tmp/suid && chmod 4755 /tmp/suid && "
                                   "echo made")
        st = os.stat("/proc/%d/root/tmp/suid" % pid)
        out["setuid_on_host"] = [st.st_uid, oct(st.st_mode)]
        out["mknod"] = sh(client, "mknod /tmp/mem c 1 1; echo rc=$?")
        out["unshare"] = sh(client, "unshare -U true; echo rc=$?; unshare -m true; echo rc=$?")
        out["disk"] = sh(client, "dd if=/dev/zero of=/tmp/fill bs=1M count=100 2>&1; "
                                 "echo rc=$?; rm -f /tmp/fill")
        out["fork_bomb"] = sh(client, "for i in $(seq 100); do sleep 30 >/dev/null 2>&1 & "
                                      "done; echo done; kill -9 -1 2>/dev/null")
        out["still"] = sh(client, "echo still answering")
    finally:
        client.close()
        box.remove()
        for other in others:
            other.kill()
            other.wait()
    box, client = sandbox("u-host", host, bundle, state)
    try:
        out["shadow"] = sh(client, "".join("cat %s; echo rc=$?; " % path for path in
                                           os.environ["SANDMAN_SECRETS"].split()))
        out["kill_host"] = sh(client, "kill -0 %d; echo rc=$?" % os.getppid())
    finally:
        client.close()
        box.remove()
    try:
        box, client = sandbox("u-net", busybox, bundle, state, network=True)
    except Exception as exc:  # no /dev/net/tun for this user: the error must say so
        out["network_error"] = str(exc)
    else:
        try:
            targets = ["10.0.2.2", "127.0.0.1"] + sys.argv[3:]
            out["network"] = sh(client, "for h in %s; do if echo | nc -w 2 $h %d >/dev/null "
                                        "2>&1; then echo open $h; else echo closed $h; fi; "
                                        "done" % (" ".join(targets), port))
            out["lift_filter"] = sh(client, "ip addr add 10.0.2.50/24 dev tap0; echo rc=$?; "
                                            "ip route del default; echo rc=$?")
        finally:
            client.close()
            box.remove()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
