"""Outbound network for LocalProvider sandboxes with ``network=True``.

Such a sandbox gets a network namespace of its own, made by the launch as host root
(so the host's user namespace owns it and no root inside a sandbox can change it), with
a user-mode stack in front: slirp4netns, attached by the node agent, gives it ``tap0``
(10.0.2.100/24, gateway 10.0.2.2, DNS 10.0.2.3) and makes its connections from the
host as ordinary sockets. Before slirp4netns attaches, the agent makes ``tap0`` (a
persistent tap device, which slirp4netns then opens) and loads one nftables ruleset
into the namespace (``nft -f``, ~8 ms here, while the daemon starts):

- an ``output`` chain (inet): what a socket sends to a refused address is rejected at
  once (a TCP reset, an ICMP error), so a refused connection fails fast;
- an ``egress`` chain on the namespace's interfaces (netdev): every frame that leaves
  them, however it was made, is checked again and dropped if refused. Packet sockets
  (``AF_PACKET``, even with ``PACKET_QDISC_BYPASS``) and raw sockets skip the output
  chain; they cannot skip this one, so a sandbox that holds CAP_NET_RAW (a spec that
  asks for it) still reaches nothing it may not.

Refused unless the spec's ``network_allow`` names them: this host's loopback and every
address of this host and of the Ray cluster's other nodes (Ray's GCS and dashboard
listen there), the node's on-link subnets and gateways (read from its routes when the
agent starts), and every special-purpose range that is not a public destination
(BLOCKED: private, shared, link-local and metadata, documentation, benchmarking,
multicast and reserved). Nothing but loopback leaves over IPv6, and only ARP and IPv4
leave an interface at all.
"""

import os
import select
import shutil
import subprocess
import threading
from typing import List, Optional, Sequence

from sandman_ray.errors import SandboxLost

TAP = "tap0"
DNS = "10.0.2.3"
RESOLV_CONF = "nameserver %s\n" % DNS
# Never reachable unless allowed (IANA's IPv4 special-purpose registry, every entry that
# is not a public destination, and multicast): this host (also through slirp's gateway
# 10.0.2.2, in 10/8), link-local and cloud metadata (169.254.169.254), private, shared,
# documentation, benchmarking, multicast and reserved ranges.
BLOCKED = (
    "0.0.0.0/8",          # "this network"
    "10.0.0.0/8",         # private (slirp's own 10.0.2.0/24 among them)
    "100.64.0.0/10",      # shared address space (carrier-grade NAT)
    "127.0.0.0/8",        # loopback
    "169.254.0.0/16",     # link-local, cloud metadata
    "172.16.0.0/12",      # private
    "192.0.0.0/24",       # IETF protocol assignments
    "192.0.2.0/24",       # documentation, TEST-NET-1
    "192.88.99.0/24",     # 6to4 relay anycast (deprecated)
    "192.168.0.0/16",     # private
    "198.18.0.0/15",      # benchmarking
    "198.51.100.0/24",    # documentation, TEST-NET-2
    "203.0.113.0/24",     # documentation, TEST-NET-3
    "224.0.0.0/4",        # multicast
    "240.0.0.0/4",        # reserved, and the limited broadcast address
)
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


def node_routes(path: str = "/proc/net/route") -> List[str]:
    """The node's on-link subnets and gateways, as CIDRs, from its IPv4 routes: the
    machines next to it (its router, its neighbours on the same link) that a sandbox
    must not reach. The default route's destination (everywhere) is not one."""
    import ipaddress
    import socket
    import struct
    found = set()
    with open(path) as fh:
        for line in fh.readlines()[1:]:
            fields = line.split()
            if len(fields) < 8:
                continue
            dest, gateway, mask = (socket.inet_ntoa(struct.pack("<I", int(f, 16)))
                                   for f in (fields[1], fields[2], fields[7]))
            if gateway != "0.0.0.0":
                found.add(gateway + "/32")
            elif mask != "0.0.0.0":
                found.add(str(ipaddress.IPv4Network("%s/%s" % (dest, mask), strict=False)))
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


def refused(neighbours: Sequence[str] = ()) -> List[str]:
    """Every CIDR a sandbox of this node may not reach, merged: BLOCKED, this host's
    addresses, ``neighbours`` (the other nodes of the Ray cluster, this node's
    routes)."""
    return collapsed(list(BLOCKED) + list(host_addresses()) + list(neighbours))


def collapsed(cidrs: Sequence[str]) -> List[str]:
    """``cidrs`` (addresses or networks) as the fewest networks that cover them: what an
    nftables interval set takes (its elements may not overlap)."""
    import ipaddress
    return [str(n) for n in ipaddress.collapse_addresses(
        ipaddress.IPv4Network(c, strict=False) for c in cidrs)]


def ruleset(allow: Sequence[str] = (), neighbours: Sequence[str] = (),
            serves: Optional[int] = None, devices: Sequence[str] = (TAP,)) -> str:
    """The sandbox namespace's filter (``nft -f`` input); ``neighbours``: addresses or
    CIDRs refused as this host's are (the cluster's other nodes, the node's routes);
    ``serves``: a TCP port the sandbox's daemon listens on, whose replies to the
    connections it accepted may go back (in the egress chain, which has no connection
    tracking: a segment from that port that is not a bare SYN; a sandbox cannot open
    a connection from it); ``devices``: the namespace's interfaces. Each table holds
    the set ``refused`` (and ``allowed``, what ``allow`` opens); the refusing rules
    count what they refused (``nft list ruleset`` in the namespace)."""
    sets = ["  set refused { type ipv4_addr; flags interval; elements = { %s } }"
            % ", ".join(refused(neighbours))]
    if allow:
        sets.append("  set allowed { type ipv4_addr; flags interval; elements = { %s } }"
                    % ", ".join(collapsed(allow)))
    dns = ["ip daddr %s udp dport 53 accept" % DNS, "ip daddr %s tcp dport 53 accept" % DNS]
    out = ["table inet sandman {"] + sets + [
        "  chain output {", "    type filter hook output priority 0; policy accept;",
        "    oif lo accept", "    meta nfproto ipv6 drop"] + ["    " + r for r in dns]
    if serves is not None:
        out.append("    tcp sport %d ct state established accept" % serves)
    if allow:
        out.append("    ip daddr @allowed accept")
    out += ["    ip daddr @refused meta l4proto tcp counter reject with tcp reset",
            "    ip daddr @refused counter reject", "  }", "}"]
    if devices:
        out += ["table netdev sandman {"] + sets + [
            "  chain egress {",
            "    type filter hook egress devices = { %s } priority 0; policy drop;"
            % ", ".join(devices), "    meta protocol arp accept",
            "    meta protocol != ip drop"] + ["    " + r for r in dns]
        if serves is not None:
            out.append("    tcp sport %d tcp flags & (syn | ack) != syn accept" % serves)
        if allow:
            out.append("    ip daddr @allowed accept")
        out += ["    ip daddr @refused counter drop", "    accept", "  }", "}"]
    return "\n".join(out) + "\n"


# In the namespace: the tap device slirp4netns will open (when asked), then the ruleset.
_LOAD = '[ -z "$2" ] || ip tuntap add dev "$2" mode tap || exit 1; exec "$1" -f -'
_nft: Optional[str] = None


def _nft_tool() -> str:
    global _nft
    if _nft is None:
        _nft = shutil.which("nft") or next(
            (p for p in ("/usr/sbin/nft", "/sbin/nft") if os.path.exists(p)), None)
        if _nft is None:
            raise FileNotFoundError("nft is missing (Debian package nftables)")
    return _nft


def load_filter(sandbox_id: str, netns: str, rules: str, userns: Optional[str] = None,
                make_tap: bool = False) -> None:
    """Load ``rules`` into the network namespace at path ``netns``; from inside the user
    namespace at ``userns`` when that one owns it (an agent that is not root);
    ``make_tap``: make the tap device slirp4netns will open first (the egress chain
    names it). Refused if ``netns`` is this process's own namespace (a pid that was
    reused after the sandbox died): the host's own filter must never be replaced."""
    mine = os.stat("/proc/self/ns/net")
    theirs = os.stat(netns)
    if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
        raise SandboxLost("sandbox %s: %s is this host's own network namespace (the sandbox's "
                          "process is gone): no filter loaded" % (sandbox_id, netns))
    done = subprocess.run(["nsenter"] + (["--user=" + userns, "--preserve-credentials"]
                                         if userns else []) +
                          ["--net=" + netns, "/bin/sh", "-c", _LOAD, "sandman-filter",
                           _nft_tool(), TAP if make_tap else ""],
                          input=rules.encode(), capture_output=True)
    if done.returncode != 0:
        raise SandboxLost("sandbox %s: its network filter did not load: %s"
                          % (sandbox_id, done.stderr.decode(errors="replace")[-500:]))


def interfaces(netns: str) -> List[str]:
    """The interfaces of the network namespace at ``netns`` but loopback."""
    done = subprocess.run(["nsenter", "--net=" + netns, "ip", "-o", "link", "show"],
                          capture_output=True, text=True)
    names = [line.split(":")[1].strip().split("@")[0] for line in done.stdout.splitlines()
             if line.count(":") >= 2]
    return [name for name in names if name != "lo"]


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
                    ruleset(self.allow, self.neighbours), userns, make_tap=True)
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
