"""The escape suite (see test_escape.py): what a sandbox with network=True may not
reach, one range at a time, and the same refusals against raw frames (a packet socket
writes past every socket's output chain: the interface's egress chain holds them)."""

import ipaddress
import re
import subprocess
import uuid

import pytest

from conftest import LOCAL_CACHE, LOCAL_STATE, Sandbox, run
from escape_kit import daemon_pid, listener, provider  # noqa: F401 - fixtures
from sandman_ray.providers.network import BLOCKED, host_addresses, node_routes

# A TCP handshake made of hand-written frames on tap0 (a packet socket): ARP for slirp's
# gateway, then a SYN to ADDRESS:PORT; prints "synack" if the peer answered, "silence"
# if nothing came, or "no packet socket" with the error.
RAW_SYN = r"""
import os, random, socket, struct, sys, time
dst, port = sys.argv[1], int(sys.argv[2])
try:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
except OSError as exc:
    print("no packet socket", exc.errno); sys.exit(0)
s.bind(("tap0", 0)); s.settimeout(0.2)
mine = s.getsockname()[4]
me, gw = socket.inet_aton("10.0.2.100"), socket.inet_aton("10.0.2.2")
def csum(data):
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16: total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, mine, me, b"\0" * 6, gw)
s.send(b"\xff" * 6 + mine + b"\x08\x06" + arp)
gwmac, deadline = None, time.time() + 3
while gwmac is None and time.time() < deadline:
    try: frame = s.recv(2048)
    except socket.timeout: continue
    if frame[12:14] == b"\x08\x06" and frame[20:22] == b"\x00\x02": gwmac = frame[22:28]
if gwmac is None:
    print("no arp answer"); sys.exit(0)
sport, seq, target = random.randint(20000, 60000), random.getrandbits(32), socket.inet_aton(dst)
tcp = struct.pack("!HHIIBBHHH", sport, port, seq, 0, 5 << 4, 0x02, 65535, 0, 0)
tcp = tcp[:16] + struct.pack("!H", csum(me + target + struct.pack("!BBH", 0, 6, 20) + tcp)) + tcp[18:]
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 1, 0, 64, 6, 0, me, target)
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
try: s.send(gwmac + mine + b"\x08\x00" + ip + tcp)
except OSError as exc: print("send refused", exc.errno)
deadline = time.time() + 3
while time.time() < deadline:
    try: frame = s.recv(2048)
    except socket.timeout: continue
    if frame[12:14] == b"\x08\x00" and frame[23] == 6 and frame[26:30] == target:
        if struct.unpack("!H", frame[34:36])[0] == port and frame[47] & 0x12 == 0x12:
            print("synack"); sys.exit(0)
print("silence")
"""


def node_address() -> str:
    return next(a for a in host_addresses() if not a.startswith("127."))


@pytest.fixture(scope="module")
def host_root_provider(local_provider):
    """LocalProvider(user_namespaces=False): root inside is host root (with the reduced
    capability set), so it holds what it keeps over the network namespace too."""
    import sandman_ray as sandman
    p = sandman.LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                              user_namespaces=False).bind("raw-%s" % uuid.uuid4().hex[:6])
    yield p
    run(p.shutdown())


def raw_syn(sb, address: str, port: int) -> str:
    sb.client.write_file("/tmp/raw_syn.py", RAW_SYN)
    r = sb.client.exec(["python3", "/tmp/raw_syn.py", address, str(port)], timeout=30)
    assert r.exit_code == 0, r
    return r.stdout.decode().strip()


def test_raw_frames_reach_nothing_of_the_host_where_root_is_host_root(host_root_provider,
                                                                     listener):
    """Root inside is host root (user_namespaces=False) with network=True: it keeps no
    CAP_NET_RAW and no packet socket opens, so a hand-made handshake to a listener on
    the node never starts, and the listener saw nothing."""
    from sandman_ray.spec import SandboxSpec
    port, accepted = listener
    before = len(accepted)
    with Sandbox(host_root_provider, SandboxSpec(network=True)) as sb:
        out = raw_syn(sb, node_address(), port)
    assert out.startswith("no packet socket"), out
    assert len(accepted) == before


def test_raw_frames_asked_for_are_still_held_by_the_interfaces_filter(host_root_provider,
                                                                      listener):
    """A spec that asks for NET_RAW gets packet sockets; the frames they write to the
    node's address die at the interface's egress chain (its counter says so), while the
    same frames to an address the spec allows complete their handshake through slirp
    to the host's listener: the filter, not a broken path, is what stops them."""
    from sandman_ray.spec import SandboxSpec
    port, accepted = listener
    node = node_address()
    before = len(accepted)
    spec = SandboxSpec(network=True, capabilities=["NET_RAW"])
    with Sandbox(host_root_provider, spec) as sb:
        dropped = egress_drops(sb)
        out = raw_syn(sb, node, port)  # a dropped frame may fail its send (ENOBUFS)
        assert out.splitlines()[-1] == "silence", out
        assert egress_drops(sb) > dropped
    assert len(accepted) == before
    allowed = SandboxSpec(network=True, capabilities=["NET_RAW"], network_allow=[node])
    with Sandbox(host_root_provider, allowed) as sb:
        assert raw_syn(sb, node, port) == "synack"
    assert len(accepted) == before + 1


def counters(sb) -> dict:
    """The packets each refusing rule of the sandbox's filter counted."""
    rules = subprocess.run(["nsenter", "--net=/proc/%d/ns/net" % daemon_pid(sb), "nft",
                            "list", "ruleset"], capture_output=True, text=True).stdout
    found = {}
    for line in rules.splitlines():
        match = re.search(r"@refused (.*)counter packets (\d+)", line)
        if match:
            kind = "drop" if line.rstrip().endswith("drop") else "reject"
            found[kind] = found.get(kind, 0) + int(match.group(2))
    assert set(found) == {"drop", "reject"}, rules
    return found


def egress_drops(sb) -> int:
    return counters(sb)["drop"]


@pytest.fixture(scope="module")
def network_box(provider):
    from sandman_ray.spec import SandboxSpec
    with Sandbox(provider, SandboxSpec(network=True)) as sb:
        yield sb


def ranges():
    """(name, an address in it) of every refused range: BLOCKED, and this node's
    gateways and on-link subnets and its own address. (127.0.0.0/8 inside is the
    sandbox's own loopback; the host's is reached only through slirp's gateway, in
    10.0.0.0/8.)"""
    def inside(cidr):
        network = ipaddress.IPv4Network(cidr)
        return str(network.network_address + 1 if network.num_addresses > 1
                   else network.network_address)
    return [(cidr, inside(cidr)) for cidr in BLOCKED if cidr != "127.0.0.0/8"] + [
        ("route %s" % cidr, inside(cidr)) for cidr in node_routes()] + [
        ("this node", node_address())]


SEND = ("python3 -c 'import socket, sys\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try: s.sendto(b\"x\", (sys.argv[1], 9)); print(\"sent\")\n"
        "except OSError as e: print(\"refused\", e.errno)' %s")


@pytest.mark.parametrize("name,address", ranges())
def test_each_refused_range_is_refused(network_box, name, address):
    """One datagram to an address of the range: the output chain refuses it (its
    counter grows by one, and the sender hears at once), never slirp."""
    before = counters(network_box)
    out = network_box.client.exec(["/bin/sh", "-c", SEND % address], timeout=30)
    after = counters(network_box)
    assert out.exit_code == 0, out
    assert after["reject"] == before["reject"] + 1, (name, out.stdout, before, after)
