"""What a DockerProvider container is: the engine's reference of its image, its
configuration (mounts, limits, the capabilities and seccomp profile of the policy of
record), the checks that this engine can run it as the provider promises, and its
seal (no nested user namespaces, the network filter) before its daemon is reachable.
``DockerAgent`` (agent.py) makes containers with it."""

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Dict, Tuple

from sandman_ray.daemon.sandmand.spawn import DEFAULT_PATH
from sandman_ray.errors import SandboxLost
from sandman_ray.providers.base import fatal, transient
from sandman_ray.providers.docker.engine import container_name, engine_facts, snapshot_reference
from sandman_ray.providers.syscalls import docker_profile, kept_capabilities
from sandman_ray.spec import SandboxSpec, parse_image

NODE_LABEL = "sandman.node"
AGENT_LABEL = "sandman.agent"   # the incarnation of the agent that created the container
SOCKET_DIR = "/run/sandman"
TCP_PORT = 7000                 # where the daemon listens inside the container (tcp)
IDS_PER_CONTAINER = 65536       # host ids of a container's user namespace (Podman)
# Podman's slirp4netns: the host's loopback (10.0.2.2) and IPv6 off; the filter does the rest
PODMAN_NETWORK = "slirp4netns:allow_host_loopback=false,enable_ipv6=false"
NO_SUBIDS = ("Podman has no subordinate ids for the user 'containers', which "
             "DockerProvider(user_namespace='auto') needs: add a line such as "
             "'containers:2147483648:1073741824' to /etc/subuid and /etc/subgid (the "
             "Makefile's set-up does), or pass user_namespace='host' for trusted code only")
# The engine's own default profile, which the refusals are added to: containers-common's
# (Podman's; Debian's golang-github-containers-common), as Podman looks it up.
BASE_PROFILES = ("/etc/containers/seccomp.json", "/usr/share/containers/seccomp.json")


class ContainerSpecs:
    """The DockerAgent's part that turns a spec into a container (a mixin: the state,
    ``pool``, ``transport``, ``facts``, ``runtime``, ``engine``, ``state`` ..., is the
    agent's)."""

    def _seccomp(self, spec: SandboxSpec) -> str:
        """The ``seccomp=`` value for ``spec``: a profile file of this agent's (Podman
        reads a path, on its own host), or the profile itself (Docker reads the JSON)."""
        caps = frozenset(spec.capabilities)
        gvisor = self.runtime == "runsc"
        profile = docker_profile(_base_profile(), caps, gvisor=gvisor)
        if not self.facts.podman:
            return json.dumps(profile, separators=(",", ":"))
        path = self.state / ("seccomp-%s%s.json" % ("-".join(sorted(caps)) or "default",
                                                   "-runsc" if gvisor else ""))
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(profile))
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        return str(path)

    def _image_of(self, spec: SandboxSpec) -> str:
        """The engine's reference of the spec's image: a registry or local reference
        as it is, ``snapshot:<pool>/<name>`` (the form every provider takes) as this
        pool's snapshot reference."""
        kind, location, _ = parse_image(spec.image)
        if spec.image.startswith("snapshot:"):
            pool, _, name = spec.image[len("snapshot:"):].partition("/")
            if pool != self.pool:
                raise fatal("image %r: a sandbox of pool %s runs only that pool's snapshots"
                            % (spec.image, self.pool))
            location = snapshot_reference(self.pool, name)
        elif kind != "registry":
            raise fatal("image %r: the DockerProvider runs images its engine has or can pull "
                        "(a reference such as docker.io/library/debian:12 or localhost/name:tag)"
                        % spec.image)
        if self.transport == "tcp" and not spec.network:
            raise fatal("image %r: transport='tcp' needs SandboxSpec(network=True); a container "
                        "without a network cannot publish its daemon's port" % spec.image)
        return location

    @staticmethod
    def launch_environment(spec: SandboxSpec, image_env) -> Tuple[Dict[str, str], bytes]:
        """The container's own environment and the sandbox's. The engine gives the
        container's first process (the daemon) the image's variables under ours: each
        is set empty for it (an empty LD_PRELOAD, GLIBC_TUNABLES or GCONV_PATH does
        nothing), PATH is the default. The sandbox's (the image's, the spec's over it)
        follows the token in its file, for the commands the daemon starts."""
        own = {entry.partition("=")[0]: "" for entry in image_env or ()}
        own["PATH"] = DEFAULT_PATH
        env = dict(entry.partition("=")[::2] for entry in image_env or () if "=" in entry)
        env.setdefault("PATH", DEFAULT_PATH)
        env.update(spec.env)
        return own, b"".join(("%s=%s" % kv).encode("utf-8", "surrogateescape") + b"\0"
                             for kv in sorted(env.items()))

    def _container_config(self, sandbox_id: str, spec: SandboxSpec, image: str,
                          labels: Dict[str, str], run_dir: Path,
                          own_env: Dict[str, str]) -> dict:
        from docker.types import Mount
        if self.transport == "tcp":
            listen = "tcp:0.0.0.0:%d" % TCP_PORT
        else:
            listen = "unix:%s/sock" % SOCKET_DIR
        config = dict(
            image=image, name=container_name(self.pool, sandbox_id),
            entrypoint=["/.sandman/bin/sandmand"],
            # the socket is 0666: the host directory (0700 above it) and the token guard
            # it, and the client need not be the user the image runs as
            command=["--listen", listen, "--socket-mode", "0666",
                     "--token-file", "%s/token" % SOCKET_DIR,
                     "--env-file", "%s/token" % SOCKET_DIR],
            labels=dict(labels, **{NODE_LABEL: self.node_id, AGENT_LABEL: self.incarnation}),
            hostname=re.sub(r"[^a-z0-9-]", "-", sandbox_id.lower())[:63],
            mounts=[Mount("/.sandman", str(self.bundle), type="bind", read_only=True),
                    Mount(SOCKET_DIR, str(run_dir), type="bind")],
            environment=own_env, detach=True,
            # the policy of record (providers/syscalls.py): the capabilities a
            # LocalProvider sandbox keeps, and the engine's profile with its refusals
            cap_drop=["ALL"], cap_add=list(kept_capabilities(spec.capabilities)),
            security_opt=["no-new-privileges", "seccomp=%s" % self._seccomp(spec)])
        if spec.workdir:
            config["working_dir"] = spec.workdir
        if spec.user:
            config["user"] = spec.user
        if spec.network:
            if self.transport == "tcp":
                config["ports"] = {"%d/tcp" % TCP_PORT: None}  # a free port, every address
            if self.facts.podman:
                config["network_mode"] = PODMAN_NETWORK
        else:
            config["network_mode"] = "none"
        if self.runtime and not self.facts.podman:
            config["runtime"] = self.runtime
        if spec.disk and self.disk_quota:
            config["storage_opt"] = {"size": str(spec.disk)}
        if spec.cpu:
            config["nano_cpus"] = int(spec.cpu * 1e9)
        if spec.memory:
            config["mem_limit"] = config["memswap_limit"] = spec.memory
        if spec.pids:
            config["pids_limit"] = spec.pids
        return config

    async def _check_engine(self, spec: SandboxSpec) -> None:
        """Refuse, naming the fix, what this engine cannot run as the provider promises."""
        if self.facts is None:
            self.facts = await self._engine("ask the engine's version", engine_facts, self.engine)
        facts = self.facts
        if self.user_namespace == "auto" and not facts.podman and not facts.userns_remap \
                and self.runtime != "runsc":  # under runsc, gVisor's kernel is the boundary
            raise fatal("the Docker daemon at %s runs containers as host root: configure "
                        "userns-remap in its daemon.json, or pass "
                        "DockerProvider(user_namespace='host') for trusted code only"
                        % self.base_url)
        if self.runtime and facts.podman and facts.default_runtime != self.runtime:
            raise fatal("runtime %r: Podman's Docker API runs every container with the "
                        "engine's default runtime (%r here); set [engine] runtime = %r in its "
                        "containers.conf (PodmanService(runtime=%r) does)"
                        % (self.runtime, facts.default_runtime, self.runtime, self.runtime))
        if self.runtime == "runsc" and facts.podman and spec.network:
            raise fatal("image %r: under gVisor through Podman a container has no network "
                        "(runsc needs a network namespace that Podman's compat API does not "
                        "hand it); use network=False, or LocalProvider(isolation='gvisor')"
                        % spec.image)


    async def _seal(self, sandbox_id: str, pid: int, spec: SandboxSpec) -> None:
        """Before the daemon is reachable (nothing inside runs before a client
        connects): no nested user namespaces, and the network filter loaded into the
        container's namespace."""
        from sandman_ray.providers.network import (
            interfaces, load_filter, node_routes, ray_node_addresses, ruleset)
        from sandman_ray.providers.userns import forbid_nested_user_namespaces
        loop = asyncio.get_running_loop()
        try:  # (under runsc, namespaces made inside are gVisor's, not the host kernel's)
            if self.runtime != "runsc":
                await loop.run_in_executor(None, forbid_nested_user_namespaces, pid)
        except OSError as exc:
            raise transient("sandbox %s: %s" % (sandbox_id, exc)) from exc
        if spec.network:
            netns = "/proc/%d/ns/net" % pid
            neighbours = await loop.run_in_executor(None, ray_node_addresses)
            devices = await loop.run_in_executor(None, interfaces, netns)
            rules = ruleset(spec.network_allow, neighbours + node_routes(),
                            serves=TCP_PORT if self.transport == "tcp" else None,
                            devices=devices)
            try:
                await loop.run_in_executor(None, load_filter, sandbox_id, netns, rules)
            except SandboxLost as exc:
                raise transient(str(exc)) from exc

    def _create_call(self, config: dict):
        """The engine's create, with what the SDK does not pass: Podman's per-container
        user namespace."""
        from docker.models.containers import _create_container_args
        args = _create_container_args(dict(config, version=self.engine.api._version))
        if self.user_namespace == "auto" and self.facts.podman and self.runtime != "runsc":
            args["host_config"]["UsernsMode"] = "auto:size=%d" % IDS_PER_CONTAINER
        created = self.engine.api.create_container(**args)
        return self.engine.containers.get(created["Id"])


def _base_profile() -> dict:
    for path in BASE_PROFILES:
        try:
            with open(path) as fh:
                return json.load(fh)
        except FileNotFoundError:
            continue
    raise fatal("no seccomp profile to add the sandbox policy to: %s is missing (Debian: "
                "apt-get install golang-github-containers-common)" % " or ".join(BASE_PROFILES))
