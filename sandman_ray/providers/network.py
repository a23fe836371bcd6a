"""Outbound network for LocalProvider sandboxes with ``network=True``.

Such a sandbox gets a network namespace of its own, made by the launch as host root
(so the host's user namespace owns it and no root inside a sandbox can change it), with
a user-mode stack in front: slirp4netns, attached by the node agent, gives it ``tap0``
(10.0.2.100/24, gateway 10.0.2.2, DNS 10.0.2.3) and makes its connections from the
host as ordinary sockets. Before slirp4netns attaches, the agent loads a filter into the
namespace's OUTPUT chain (``iptables-restore``; the legacy backend where the kernel has
it: ~2 ms here, against ~13 ms for nft): nothing goes to the host's loopback or to any
address of this host or of the Ray cluster's other nodes (Ray's GCS and dashboard
listen there), to link-local and
metadata addresses, or to private, shared and reserved ranges, unless the spec's
``network_allow`` names them. Refused connections fail at once (REJECT); nothing of
theirs leaves the namespace.

The agent sets the network up while the sandbox's daemon starts (the launch says when
the namespace exists), so it adds little to create -> first exec.
"""

import os
import select
import shutil
import subprocess
import tempfile
import threading
from typing import List, Optional, Sequence

from sandman_ray.errors import SandboxLost

TAP = "tap0"
DNS = "10.0.2.3"
RESOLV_CONF = "nameserver %s\n" % DNS
# Never reachable unless allowed: this host (also through slirp's gateway 10.0.2.2),
# link-local and cloud metadata (169.254.169.254), private, shared, benchmark,
# multicast and reserved ranges.
BLOCKED = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
           "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15",
           "224.0.0.0/4", "240.0.0.0/4")
READY_TIMEOUT_S = 10.0


def host_addresses() -> List[str]:
    """Every IPv4 address of this host (the kernel's LOCAL routes)."""
    found, last = set(), None
    with open("/proc/net/fib_trie") as fh:
        for line in fh:
            text = line.strip()
            if text.startswith("|--"):
                last = text[3:].strip()
            elif text == "/32 host LOCAL" and last:
                found.add(last)
    return sorted(found)


def ray_node_addresses() -> List[str]:
    """The IPv4 addresses of the Ray cluster's alive nodes."""
    import ipaddress
    import ray
    found = []
    for node in ray.nodes():
        address = node.get("NodeManagerAddress") or ""
        try:
            if node.get("Alive") and ipaddress.ip_address(address).version == 4:
                found.append(address)
        except ValueError:
            continue
    return found


def ruleset(allow: Sequence[str] = (), neighbours: Sequence[str] = (),
            serves: Optional[int] = None) -> str:
    """The sandbox namespace's filter table (iptables-restore input); ``neighbours``:
    the addresses of the other nodes of the Ray cluster, refused as this host's are;
    ``serves``: a TCP port the sandbox's daemon listens on, whose replies to the
    connections it accepted may go back (a connection the sandbox opens from that port
    is new, not established, and meets the rest of the filter)."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]",
             "-A OUTPUT -o lo -j ACCEPT",
             "-A OUTPUT -d %s/32 -p udp --dport 53 -j ACCEPT" % DNS,
             "-A OUTPUT -d %s/32 -p tcp --dport 53 -j ACCEPT" % DNS]
    if serves is not None:
        lines.append("-A OUTPUT -p tcp --sport %d -m conntrack --ctstate ESTABLISHED "
                     "-j ACCEPT" % serves)
    lines += ["-A OUTPUT -d %s -j ACCEPT" % cidr for cidr in allow]
    refused = list(BLOCKED) + ["%s/32" % a for a in sorted(set(host_addresses())
                                                           | set(neighbours))]
    for cidr in refused:
        lines.append("-A OUTPUT -d %s -p tcp -j REJECT --reject-with tcp-reset" % cidr)
        lines.append("-A OUTPUT -d %s -j REJECT" % cidr)
    return "\n".join(lines + ["COMMIT", ""])


# IPv6: nothing leaves but loopback (slirp4netns and Podman's network give none; a
# Docker bridge may)
RULES_V6 = ("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT DROP [0:0]\n"
            "-A OUTPUT -o lo -j ACCEPT\nCOMMIT\n")
# Both tables in one shell inside the namespace; a kernel without IPv6 needs no v6 rules.
_LOAD = '"$1" && { printf "%s" "$3" | "$2" || [ ! -e /proc/net/if_inet6 ]; }'
_lock_dir: Optional[str] = None


def _restore_tools() -> List[str]:
    found = []
    for names in (("iptables-legacy-restore", "iptables-restore"),
                  ("ip6tables-legacy-restore", "ip6tables-restore")):
        path = next((p for p in map(shutil.which, names) if p), None)
        if path is None:
            raise FileNotFoundError("%s is missing (Debian package iptables)" % names[1])
        found.append(path)
    return found


def load_filter(sandbox_id: str, netns: str, rules: str, userns: Optional[str] = None) -> None:
    """Load ``rules`` (and RULES_V6) into the network namespace at path ``netns``; from
    inside the user namespace at ``userns`` when that one owns it (an agent that is not
    root). Refused if ``netns`` is this process's own namespace (a pid that was reused
    after the sandbox died): the host's own filter must never be replaced."""
    global _lock_dir
    mine = os.stat("/proc/self/ns/net")
    theirs = os.stat(netns)
    if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
        raise SandboxLost("sandbox %s: %s is this host's own network namespace (the sandbox's "
                          "process is gone): no filter loaded" % (sandbox_id, netns))
    env = None
    if userns is not None:  # iptables' lock file, where no other user can take it first
        if _lock_dir is None:
            _lock_dir = tempfile.mkdtemp(prefix="sandman-xtables-")
        env = dict(os.environ, XTABLES_LOCKFILE=os.path.join(_lock_dir, "xtables.lock"))
    v4, v6 = _restore_tools()
    done = subprocess.run(["nsenter"] + (["--user=" + userns, "--preserve-credentials"]
                                         if userns else []) +
                          ["--net=" + netns, "/bin/sh", "-c", _LOAD, "sandman-filter", v4, v6,
                           RULES_V6], input=rules.encode(), capture_output=True, env=env)
    if done.returncode != 0:
        raise SandboxLost("sandbox %s: its network filter did not load: %s"
                          % (sandbox_id, done.stderr.decode(errors="replace")[-500:]))


class SandboxNetwork:
    """The filter and the slirp4netns process of one sandbox's network namespace."""

    def __init__(self, sandbox_id: str, allow: Sequence[str] = (),
                 neighbours: Sequence[str] = ()):
        self.sandbox_id, self.allow, self.neighbours = sandbox_id, tuple(allow), tuple(neighbours)
        self.slirp: Optional[subprocess.Popen] = None
        self.exit_w: Optional[int] = None  # closing it stops slirp4netns
        self.lock = threading.Lock()  # start runs on a worker thread, stop anywhere
        self.stopped = False

    def start(self, pid: int, cgroup_procs: Sequence[str] = (), own_userns: bool = False) -> None:
        """Filter, then connect, the network namespace of process ``pid``; answer once
        ``tap0`` is up. slirp4netns joins the sandbox's cgroups (so removing the
        sandbox, the janitor and ``leftovers`` find it) and exits when the agent does.
        ``own_userns``: the namespace belongs to ``pid``'s user namespace (an agent that
        is not root), which both join to act on it."""
        userns = "/proc/%d/ns/user" % pid if own_userns else None
        load_filter(self.sandbox_id, "/proc/%d/ns/net" % pid,
                    ruleset(self.allow, self.neighbours), userns)
        with self.lock:
            if self.stopped:  # the sandbox was stopped meanwhile
                raise SandboxLost("sandbox %s stopped before its network was up"
                                  % self.sandbox_id)
            self._attach(pid, cgroup_procs, userns)

    def _attach(self, pid: int, cgroup_procs: Sequence[str], userns: Optional[str]) -> None:
        exit_r, self.exit_w = os.pipe()
        ready_r, ready_w = os.pipe()
        try:
            # by path: given a pid it would also join that process's user namespace, in
            # which host root has no rights over this namespace. An agent that is not
            # root runs it in the namespace's own user namespace instead, where its
            # sandbox (a mount namespace of its own) can be made.
            enter = ["nsenter", "--user=" + userns, "--preserve-credentials"] if userns else []
            self.slirp = subprocess.Popen(
                enter + ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
                         "--enable-sandbox", "--enable-seccomp", "--exit-fd=%d" % exit_r,
                         "--ready-fd=%d" % ready_w, "--netns-type=path",
                         "/proc/%d/ns/net" % pid, TAP],
                pass_fds=(exit_r, ready_w), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        finally:
            os.close(exit_r)
            os.close(ready_w)
        try:
            for procs in cgroup_procs:
                with open(procs, "w") as fh:
                    fh.write(str(self.slirp.pid))
            if not select.select([ready_r], [], [], READY_TIMEOUT_S)[0] or \
                    os.read(ready_r, 16) != b"1":
                self.slirp.kill()
                self.slirp.wait()
                err = self.slirp.stderr.read().decode(errors="replace")[-500:]
                self._stop()
                raise SandboxLost("sandbox %s: slirp4netns did not bring its network up: %s"
                                  % (self.sandbox_id, err or "no output"))
        finally:
            os.close(ready_r)

    def stop(self) -> None:
        """Stop slirp4netns (the namespace goes with the sandbox's processes)."""
        with self.lock:
            self.stopped = True
            self._stop()

    def _stop(self) -> None:
        if self.exit_w is not None:
            os.close(self.exit_w)
            self.exit_w = None
        if self.slirp is not None:
            if self.slirp.poll() is None:
                self.slirp.kill()
            self.slirp.wait()
            if self.slirp.stderr:
                self.slirp.stderr.close()
            self.slirp = None
