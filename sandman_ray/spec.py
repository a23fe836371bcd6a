"""What a sandbox should be: plain dataclasses, validated on construction."""

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Tuple, Union

# What a spec may ask for by name (SandboxSpec.capabilities), and what each lifts.
CAPABILITIES = {
    "NET_RAW": "raw IP and packet sockets (ping without ICMP sockets, tcpdump); keeps "
               "CAP_NET_RAW; the network filter still holds on the sandbox's interface",
    "IO_URING": "io_uring_setup, io_uring_enter and io_uring_register",
    "AIO": "Linux native AIO (io_setup, io_submit, io_getevents and the rest): its "
           "contexts come from the node's fs.aio-max-nr, which no limit holds per "
           "sandbox, so one sandbox that asks for it can take them all",
}


def check_capabilities(names: Iterable[str]) -> Tuple[str, ...]:
    """``names`` as a sorted tuple; ValueError naming one that is not in CAPABILITIES."""
    out = set()
    for name in names:
        if name not in CAPABILITIES:
            raise ValueError("SandboxSpec.capabilities: %r is not one of %s"
                             % (name, ", ".join(sorted(CAPABILITIES))))
        out.add(name)
    return tuple(sorted(out))


_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
          "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}


_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


# The shortest idle timeout a lease may have: a process tells its pool which of its
# leases it used at most ~2 s after the call (sandman_ray.touches: a note per lease and
# second, a round per second), so a shorter timeout could end a lease in use.
MIN_IDLE_TIMEOUT_S = 5.0


def check_pool_name(name) -> str:
    """A pool's name goes into actor names, directories, cgroups and Kubernetes labels:
    1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    if not isinstance(name, str) or not _POOL_NAME.match(name):
        raise ValueError("pool name %r: use 1 to 63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit" % (name,))
    return name


def check_snapshot_name(name) -> str:
    """A snapshot's name goes into paths and image references: the rules of a pool's."""
    if not isinstance(name, str) or not _POOL_NAME.match(name):
        raise ValueError("snapshot name %r: use 1 to 63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit" % (name,))
    return name


def number_in(value, low: float, high: float, *, integer: bool = False,
              above: bool = False) -> bool:
    """Whether ``value`` is a number (an int with ``integer``; never a bool) from
    ``low`` (above it, with ``above``) to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return (low < value if above else low <= value) and value <= high


def parse_bytes(value: Union[int, str, None], what: str = "memory") -> Optional[int]:
    """``512Mi``, ``1G``, ``1.5Gi`` or an int of bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("%s must be bytes or a size such as '512Mi', not %r" % (what, value))
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*", str(value), re.I)
        if not match:
            raise ValueError("%s must be bytes or a size such as '512Mi', not %r" % (what, value))
        number = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if number <= 0:
        raise ValueError("%s must be positive, got %r" % (what, value))
    return number


def _networks(allow) -> Tuple[str, ...]:
    """``allow`` as normalized IPv4 networks; ValueError naming a bad one."""
    out = []
    for cidr in allow:
        try:
            out.append(str(ipaddress.IPv4Network(cidr, strict=False)))
        except (ValueError, TypeError):
            raise ValueError("SandboxSpec.network_allow: %r is not an IPv4 address or CIDR"
                             % (cidr,)) from None
    return tuple(out)


# The most pseudo-terminals a spec may ask for: the host's kernel.pty.max is 4096 by
# default, and every sandbox of the node shares it.
MAX_PTYS = 1024
# Open files per process (the hard RLIMIT_NOFILE; the soft one starts at 1024 or below,
# for programs that select()): the kernel's own hard limit for a process nobody
# configured (INR_OPEN_MAX). Every LocalProvider sandbox gets a spec's ``nofile`` or
# this; with its pids, it is what a sandbox may hold of the node's fs.file-max
# (providers/local/host_tables.py checks the pool's worst case against it).
DEFAULT_NOFILE = 4096
MAX_NOFILE = 1 << 20  # the kernel's default fs.nr_open: no process may hold more
# The soft limit a sandbox starts with, under its hard one: descriptors above 1024
# break programs that select() (FD_SETSIZE); one that needs more raises its own.
NOFILE_SOFT = 1024

# Images the LocalProvider builds itself from Debian's packages, on first use on each
# node, and caches (sandman_ray.image_builders): ``builtin:debian`` is Debian 12 minbase
# with python3, the default image of every spec; ``builtin:code`` adds C and C++
# compilers, for SandboxFusion's programs (service/fusion.py).
BUILTIN_IMAGES = ("debian", "code")
DEFAULT_IMAGE = "builtin:debian"
# ``acquire(node=ANYWHERE)``: wherever the provider places the sandbox, not on the
# caller's node by preference
ANYWHERE = "anywhere"


def parse_image(image: str) -> Tuple[str, str, str]:
    """(kind, location, tag) of an image string; ValueError naming the problem."""
    if image == "host":
        return "host", "", ""
    if image.startswith("builtin:"):
        name = image[len("builtin:"):]
        if name not in BUILTIN_IMAGES:
            raise ValueError("image %r: the built-in images are %s"
                             % (image, ", ".join("builtin:" + n for n in BUILTIN_IMAGES)))
        return "builtin", name, ""
    if image.startswith("snapshot:"):  # a pool's snapshot (sandman_ray.snapshot)
        pool, sep, name = image[len("snapshot:"):].partition("/")
        if not sep or not _POOL_NAME.match(pool) or not _POOL_NAME.match(name):
            raise ValueError("image %r: a snapshot is named snapshot:<pool>/<name>" % image)
        return "snapshot", pool + "/" + name, ""
    for kind in ("dir", "oci", "docker-archive"):
        if image.startswith(kind + ":"):
            rest = image[len(kind) + 1:]
            tag = ""
            if kind == "oci":
                head, sep, tail = rest.rpartition(":")
                if sep and "/" not in tail:
                    rest, tag = head, tail
            if not rest.startswith("/"):
                raise ValueError("image %r: %s needs an absolute path" % (image, kind))
            return kind, rest, tag
    if "/" in image and not image.startswith("/") and " " not in image:
        return "registry", image, ""
    raise ValueError("image %r is not builtin:debian, host, dir:/path, oci:/path[:tag], "
                     "docker-archive:/path.tar, snapshot:<pool>/<name> or a registry reference" % image)


@dataclass(frozen=True)
class SandboxSpec:
    """A sandbox to acquire.

    image: what to run: ``builtin:debian`` (the default: Debian 12 minbase with python3,
        built and cached by each node on first use), ``dir:/rootfs``,
        ``oci:/layout[:tag]``, ``docker-archive:/image.tar``, a registry reference such
        as ``docker.io/library/python:3.12`` (needs skopeo and umoci), or ``host``: a
        read-only view of this machine's files (what any user may read), for trusted
        code; or a pool's snapshot, ``snapshot:<pool>/<name>`` (``sandman_ray.snapshot``).
    cpu: CPU cores the sandbox may use (a quota; None: no limit).
    memory: memory limit, bytes or a size such as ``"512Mi"`` (None: no limit).
    pids: most processes at once (None: no limit).
    disk: most bytes the sandbox's writable layer may hold, bytes or a size such as
        ``"2Gi"``; past it, writes fail with ENOSPC (None: the provider's default).
    env: variables set for the daemon and every command, over the image's own.
    workdir: the working directory of commands (default: the image's, else ``/``), made
        when the image has none there.
    network: False gives the sandbox only a loopback interface; True gives it outbound
        access of its own, through a user-mode stack, to public addresses only: never
        to this host, its neighbours, link-local or metadata addresses, nor private
        ranges (the LocalProvider; see providers/network.py).
    network_allow: IPv4 addresses or CIDRs a ``network=True`` sandbox may reach beyond
        that (a package mirror on the private network, say).
    user: ``"uid[:gid]"`` the daemon and its commands run as (default: the image's
        user, else root inside the sandbox).
    ttl_s: the lease ends this long after it began, and the sandbox is reclaimed
        (None: the pool's ``sandbox_ttl_s``).
    idle_timeout_s: the lease ends after this long without a call (at least 5 s;
        None: the pool's ``idle_timeout_s``).
    labels: free-form key/value pairs attached to the sandbox (listing, ownership).
    capabilities: kernel features the sandbox may use that every sandbox is refused
        otherwise, by name: ``"NET_RAW"`` (raw IP and packet sockets; the network
        filter still holds), ``"IO_URING"`` and ``"AIO"`` (native AIO, whose contexts
        the whole node shares) (providers/syscalls.py has the policy).
    ptys: most pseudo-terminals the sandbox may hold at once (its own devpts): the
        host's are shared by every sandbox of the node.
    nofile: most open files per process (its hard RLIMIT_NOFILE, at most 2**20; None:
        the pool's ``default_nofile``, else 4096). Times ``pids``, what the sandbox may
        hold of the node's open-file table. The LocalProvider's; a container's are its
        engine's default ulimits.
    """

    image: str = DEFAULT_IMAGE
    cpu: Optional[float] = None
    memory: Optional[Union[int, str]] = None
    pids: Optional[int] = None
    disk: Optional[Union[int, str]] = None
    env: Dict[str, str] = field(default_factory=dict)
    workdir: Optional[str] = None
    network: bool = False
    network_allow: Tuple[str, ...] = ()
    user: Optional[str] = None
    ttl_s: Optional[float] = None
    idle_timeout_s: Optional[float] = None
    labels: Dict[str, str] = field(default_factory=dict)
    capabilities: Tuple[str, ...] = ()
    ptys: int = 64
    nofile: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.image, str) or not self.image.strip():
            raise ValueError("SandboxSpec.image must be a non-empty string, got %r" % (self.image,))
        parse_image(self.image)
        if self.cpu is not None and (isinstance(self.cpu, bool) or not self.cpu > 0):
            raise ValueError("SandboxSpec.cpu must be a positive number of cores, got %r" % (self.cpu,))
        object.__setattr__(self, "memory", parse_bytes(self.memory, "SandboxSpec.memory"))
        object.__setattr__(self, "disk", parse_bytes(self.disk, "SandboxSpec.disk"))
        if self.pids is not None and (isinstance(self.pids, bool) or not isinstance(self.pids, int)
                                      or self.pids < 1):
            raise ValueError("SandboxSpec.pids must be a positive int, got %r" % (self.pids,))
        if not isinstance(self.env, dict):
            raise ValueError("SandboxSpec.env must map names to strings, got %r" % (self.env,))
        for key, value in self.env.items():
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise ValueError("SandboxSpec.env must map names to strings, got %r=%r" % (key, value))
        if self.workdir is not None and not str(self.workdir).startswith("/"):
            raise ValueError("SandboxSpec.workdir must be absolute, got %r" % (self.workdir,))
        if isinstance(self.network_allow, str):
            raise ValueError("SandboxSpec.network_allow must be a list of CIDRs, got the "
                             "string %r" % (self.network_allow,))
        object.__setattr__(self, "network_allow", _networks(self.network_allow))
        if self.network_allow and not self.network:
            raise ValueError("SandboxSpec.network_allow needs network=True")
        if self.user is not None and not re.fullmatch(r"[0-9]+(:[0-9]+)?", str(self.user)):
            raise ValueError("SandboxSpec.user must be 'uid' or 'uid:gid', got %r" % (self.user,))
        for name in ("ttl_s", "idle_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError("SandboxSpec.%s must be positive seconds, got %r" % (name, value))
        if self.idle_timeout_s is not None and self.idle_timeout_s < MIN_IDLE_TIMEOUT_S:
            raise ValueError("SandboxSpec.idle_timeout_s must be at least %g s, got %r"
                             % (MIN_IDLE_TIMEOUT_S, self.idle_timeout_s))
        for key, value in self.labels.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError("SandboxSpec.labels must map strings to strings, got %r=%r"
                                 % (key, value))
        if isinstance(self.capabilities, str):
            raise ValueError("SandboxSpec.capabilities must be a list of names, got the "
                             "string %r" % (self.capabilities,))
        object.__setattr__(self, "capabilities", check_capabilities(self.capabilities))
        if isinstance(self.ptys, bool) or not isinstance(self.ptys, int) or \
                not 1 <= self.ptys <= MAX_PTYS:
            raise ValueError("SandboxSpec.ptys must be an int from 1 to %d, got %r"
                             % (MAX_PTYS, self.ptys))
        if self.nofile is not None and (isinstance(self.nofile, bool) or not isinstance(
                self.nofile, int) or not 1 <= self.nofile <= MAX_NOFILE):
            raise ValueError("SandboxSpec.nofile must be an int from 1 to %d, got %r"
                             % (MAX_NOFILE, self.nofile))

    @classmethod
    def of(cls, spec: Union["SandboxSpec", str, Dict[str, object]]) -> "SandboxSpec":
        """A spec from a spec, an image string or a dict of fields (``from_dict``: a
        field it does not have is named); anything else is a TypeError."""
        if isinstance(spec, SandboxSpec):
            return spec
        if isinstance(spec, str):
            return cls(image=spec)
        if isinstance(spec, dict):
            return cls.from_dict(spec)
        raise TypeError("a sandbox's spec is a SandboxSpec, an image string or a dict of "
                        "SandboxSpec's fields, not %s" % type(spec).__name__)

    @classmethod
    def from_config(cls, image: Optional[str] = None,
                    spec: Optional[Dict[str, object]] = None) -> "SandboxSpec":
        """The sandbox a framework's config asks for: ``image`` (an image string) or
        ``spec`` (a dict of fields), not both; neither is the default image. A
        ValueError names what is wrong."""
        if image is not None and spec is not None:
            raise ValueError("give image or spec, not both (spec may hold the image)")
        if spec is not None:
            if not isinstance(spec, dict):
                raise ValueError("spec must be a dict of SandboxSpec fields, got %r" % (spec,))
            return cls.from_dict(spec)
        return cls(image=DEFAULT_IMAGE if image is None else image)

    def __hash__(self):
        # Cached: the pool hashes specs of every record on every tick (10,000 records
        # made hashing its main cost). Never pickled: str hashes differ per process.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.key(), self.ttl_s, self.idle_timeout_s,
                           tuple(sorted(self.labels.items()))))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state):
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def to_dict(self) -> Dict[str, object]:
        """The spec as plain JSON values; ``from_dict`` makes it again."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["env"], out["labels"] = dict(self.env), dict(self.labels)
        out["network_allow"] = list(self.network_allow)
        out["capabilities"] = list(self.capabilities)
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, object]) -> "SandboxSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            import difflib
            near = [m for u in unknown for m in difflib.get_close_matches(str(u), names, 1)]
            raise ValueError("SandboxSpec has no field %s%s" % (
                ", ".join(map(str, unknown)),
                " (did you mean %s?)" % ", ".join(near) if near else
                " (its fields: %s)" % ", ".join(sorted(names))))
        return cls(**data)

    def key(self) -> tuple:
        """What makes two sandboxes interchangeable (warm pools are kept per key)."""
        return (self.image, self.cpu, self.memory, self.pids, self.disk,
                tuple(sorted(self.env.items())), self.workdir, self.network,
                self.network_allow, self.user, self.capabilities, self.ptys, self.nofile)


def nofile_limits(spec: SandboxSpec) -> Tuple[int, int]:
    """The soft and hard RLIMIT_NOFILE of ``spec``'s sandbox (the LocalProvider's, under
    bubblewrap and gVisor)."""
    nofile = spec.nofile or DEFAULT_NOFILE
    return min(NOFILE_SOFT, nofile), nofile


# A pool's pacing of creates, unless its config or its provider (``Provider.pacing``)
# says otherwise: what a shared control plane (an API server, a container engine) takes.
DEFAULT_PACING = {"create_rate_per_s": 50.0, "create_burst": 50, "max_starting": 64}


@dataclass
class PoolConfig:
    """How a pool behaves.

    provider: where sandboxes run (default: LocalProvider on this Ray cluster).
    max_sandboxes: most sandboxes the pool keeps at once, in every state.
    warm: READY sandboxes to keep per spec, ``{image or SandboxSpec: count}``.
    create_rate_per_s, create_burst: the token bucket on creates (a shared cluster is
        never asked for more); the rate is cut on throttled or transient provider
        errors and grows back on successes, never above ``create_rate_per_s``.
    max_starting: most sandboxes being created at once.
        None for these three: the provider's ``pacing`` (50/s, 50, 64 for a provider
        with a shared control plane: Kubernetes, a container engine; more for the
        LocalProvider, whose creates go to the cluster's own nodes).
    ready_timeout_s: a sandbox whose daemon does not answer within this is replaced.
    lease_grace_s: a lease whose handle has not registered within this is reclaimed.
    sandbox_ttl_s: a lease is reclaimed this long after it began (None: never).
    idle_timeout_s: a lease is reclaimed after this long without a command (None: never).
    reuse: what a released sandbox becomes: ``reset`` (back to READY, when the provider
        can) or ``delete``.
    client_quota: most sandboxes one client may hold at once (None: no limit).
    sweep_interval_s: how often the watchdog checks handles, TTLs and idle leases.
    default_pids, default_memory, default_disk: the limits of every sandbox whose spec
        sets none (None: no limit). No sandbox can fork-bomb the node, eat its memory
        or fill its disk (Ray's logs and object spilling live there) unless its pool
        says so.
    default_nofile: open files per process of every sandbox whose spec sets none.
        ``max_sandboxes`` x ``default_pids`` x ``default_nofile`` is the most open files
        the pool's sandboxes may hold on a node, and ``max_sandboxes`` x
        ``default_pids`` their processes: a LocalProvider agent raises the node's
        fs.file-max, kernel.pid_max and kernel.threads-max to hold them beside the
        host's own, or refuses to start (providers/local/host_tables.py).
    pause_between_steps: the integrations (verl tool, SkyRL env, mini-swe-agent
        environment) pause a trajectory's sandbox after each step and resume it at
        the next (``SandboxHandle.pause``): no CPU while the model thinks.
    late_bind: an acquire's ``env``, ``workdir`` and ``labels`` are given to a warm
        sandbox as it is lent (its reset forgets them), so specs that differ only in
        those share one warm set: a task id in the environment costs no cold create.
        Where the provider cannot (``Provider.binds_late``), or False: they are part
        of what makes sandboxes interchangeable, and each distinct set is created
        for.
    """

    provider: object = None
    max_sandboxes: int = 256
    warm: Dict[object, int] = field(default_factory=dict)
    create_rate_per_s: Optional[float] = None
    create_burst: Optional[int] = None
    max_starting: Optional[int] = None
    ready_timeout_s: float = 60.0
    lease_grace_s: float = 30.0
    sandbox_ttl_s: Optional[float] = None
    idle_timeout_s: Optional[float] = None
    reuse: str = "reset"
    client_quota: Optional[int] = None
    sweep_interval_s: float = 0.5
    default_pids: Optional[int] = 4096
    default_memory: Optional[Union[int, str]] = "4Gi"
    default_disk: Optional[Union[int, str]] = "4Gi"
    default_nofile: int = DEFAULT_NOFILE
    pause_between_steps: bool = False
    late_bind: bool = True

    def __post_init__(self):
        def positive(name, integer=False, optional=False):
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
                    or (integer and not isinstance(value, int)):
                raise ValueError("PoolConfig.%s must be a positive %s, got %r"
                                 % (name, "int" if integer else "number", value))
        for name, value in getattr(self.provider, "pacing", DEFAULT_PACING).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for name in ("max_sandboxes", "create_burst", "max_starting"):
            positive(name, integer=True)
        for name in ("create_rate_per_s", "ready_timeout_s", "lease_grace_s", "sweep_interval_s"):
            positive(name)
        for name in ("sandbox_ttl_s", "idle_timeout_s"):
            positive(name, optional=True)
        positive("client_quota", integer=True, optional=True)
        positive("default_pids", integer=True, optional=True)
        positive("default_nofile", integer=True)
        if self.default_nofile > MAX_NOFILE:
            raise ValueError("PoolConfig.default_nofile must be at most %d, got %r"
                             % (MAX_NOFILE, self.default_nofile))
        self.default_memory = parse_bytes(self.default_memory, "PoolConfig.default_memory")
        self.default_disk = parse_bytes(self.default_disk, "PoolConfig.default_disk")
        if self.idle_timeout_s is not None and self.idle_timeout_s < MIN_IDLE_TIMEOUT_S:
            raise ValueError("PoolConfig.idle_timeout_s must be at least %g s, got %r"
                             % (MIN_IDLE_TIMEOUT_S, self.idle_timeout_s))
        if self.reuse not in ("reset", "delete"):
            raise ValueError("PoolConfig.reuse must be 'reset' or 'delete', got %r" % (self.reuse,))
        for name in ("pause_between_steps", "late_bind"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError("PoolConfig.%s must be True or False, got %r"
                                 % (name, getattr(self, name)))
        warm = {}
        for spec, count in dict(self.warm).items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError("PoolConfig.warm counts must be ints >= 0, got %r for %r"
                                 % (count, spec))
            slot = self.slot(SandboxSpec.of(spec))
            warm[slot] = warm.get(slot, 0) + count
        self.warm = warm
        if sum(warm.values()) > self.max_sandboxes:
            raise ValueError("PoolConfig.warm asks for %d sandboxes, more than max_sandboxes=%d"
                             % (sum(warm.values()), self.max_sandboxes))

    def limited(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with this pool's default limits where it sets none: what the pool
        creates, and the key its warm sets and waiters are matched by."""
        wanted = {"pids": self.default_pids, "memory": self.default_memory,
                  "disk": self.default_disk, "nofile": self.default_nofile}
        missing = {k: v for k, v in wanted.items() if getattr(spec, k) is None and v is not None}
        return dataclasses.replace(spec, **missing) if missing else spec

    @property
    def binds_late(self) -> bool:
        """Whether acquires' env, workdir and labels are bound as sandboxes are lent."""
        return self.late_bind and getattr(self.provider, "binds_late", False)

    def slot(self, spec: SandboxSpec) -> SandboxSpec:
        """The sandboxes that can serve ``spec`` (``limited``), as the pool creates them
        and keys its warm sets and waiters: without what is bound late, if it is."""
        spec = self.limited(spec)
        if self.binds_late and (spec.env or spec.workdir or spec.labels):
            spec = dataclasses.replace(spec, env={}, workdir=None, labels={})
        return spec
