"""A private Podman API service: the Docker Engine API on a machine without Docker.

    service = PodmanService("/tmp/my-engine").start()
    provider = DockerProvider(base_url=service.base_url)
    ...
    service.stop()

Everything it keeps (storage, its socket, its configuration) lives under one directory,
so it never touches the machine's own Podman images or containers. The configuration is
what works on hosts with a hybrid cgroup layout and low hard ulimits: runc (crun fails
there), no default ulimits, and ``exit_command_delay = 5`` (the default 300 keeps two
conmon processes per container exec alive for five minutes; 0 breaks exec).

``runtime="runsc"`` makes gVisor the engine's runtime (Podman's Docker API takes the
runtime from here, not from the request), through a wrapper that gives runsc what this
kind of host needs: the ptrace platform (KVM is not always there), no network of its
own (Podman hands runsc no network namespace through that API), host unix sockets
in bind mounts (the daemon's socket directory), and the container's seccomp profile
loaded into gVisor's own kernel (``--oci-seccomp``: runsc ignores it otherwise).
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterable, Optional

CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
runtime = "%(runtime)s"
exit_command_delay = 5

[engine.runtimes]
runsc = ["%(runsc)s"]
"""
RUNSC_WRAPPER = """\
#!/bin/sh
exec %s --platform=ptrace --network=none --host-uds=all --oci-seccomp "$@"
"""
RUNTIMES = ("runc", "runsc")


class PodmanError(RuntimeError):
    pass


class PodmanService:
    """``podman system service`` on a unix socket under ``root``.

    root: directory for the socket, storage and configuration (created).
    insecure_registries: registries reached over plain HTTP (``host:port``), such as a
        registry a test starts on loopback.
    runtime: the engine's OCI runtime: ``runc`` or ``runsc`` (gVisor).
    """

    def __init__(self, root, insecure_registries: Iterable[str] = (), runtime: str = "runc"):
        if runtime not in RUNTIMES:
            raise ValueError("PodmanService.runtime must be one of %s, got %r"
                             % (", ".join(RUNTIMES), runtime))
        self.root = Path(root).resolve()
        self.insecure_registries = list(insecure_registries)
        self.runtime = runtime
        self.process: Optional[subprocess.Popen] = None

    @property
    def socket_path(self) -> Path:
        return self.root / "podman.sock"

    @property
    def base_url(self) -> str:
        return "unix://%s" % self.socket_path

    def env(self) -> Dict[str, str]:
        """The environment under which ``podman`` uses this service's storage and
        configuration."""
        return dict(os.environ,
                    CONTAINERS_CONF=str(self.root / "containers.conf"),
                    CONTAINERS_STORAGE_CONF=str(self.root / "storage.conf"),
                    CONTAINERS_REGISTRIES_CONF=str(self.root / "registries.conf"))

    def _write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        wrapper = self.root / "runsc"
        if self.runtime == "runsc":
            runsc = shutil.which("runsc")
            if runsc is None:
                raise PodmanError("runsc is not installed (Debian: apt-get install runsc)")
            wrapper.write_text(RUNSC_WRAPPER % runsc)
            wrapper.chmod(0o755)
        (self.root / "containers.conf").write_text(
            CONTAINERS_CONF % {"runtime": self.runtime, "runsc": wrapper})
        (self.root / "storage.conf").write_text(
            '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "%s"\n'
            % (self.root / "storage", self.root / "run"))
        registries = ['unqualified-search-registries = ["docker.io"]\n']
        for location in self.insecure_registries:
            registries.append('\n[[registry]]\nlocation = "%s"\ninsecure = true\n' % location)
        (self.root / "registries.conf").write_text("".join(registries))

    def start(self, timeout_s: float = 30.0) -> "PodmanService":
        if shutil.which("podman") is None:
            raise PodmanError("podman is not installed (Debian: apt-get install podman runc)")
        self._write_config()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        log = open(self.root / "service.log", "ab")
        self.process = subprocess.Popen(
            ["podman", "system", "service", "--time=0", self.base_url], env=self.env(),
            # in its own directory: conmon leaves files (an "oom" marker) in its cwd
            cwd=str(self.root), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True)
        log.close()
        try:
            self._wait_answering(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_answering(self, timeout_s: float) -> None:
        import requests.exceptions
        from sandman_ray.providers.docker.engine import engine_client
        engine = engine_client(self.base_url)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise PodmanError("podman system service exited with %s: %s"
                                  % (self.process.returncode, self.log_tail()))
            try:
                engine.ping()
                return
            except requests.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise PodmanError("podman system service did not answer within %.0f s: %s"
                                      % (timeout_s, self.log_tail()))
            time.sleep(0.05)  # waiting for another process's socket: nothing to select on

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.root / "service.log").read_text(errors="replace")
                             .splitlines()[-lines:])
        except OSError:
            return ""

    def podman(self, *args: str, input: Optional[bytes] = None,
               timeout_s: float = 600) -> bytes:
        """Run the podman command on this service's storage; its stdout."""
        done = subprocess.run(["podman"] + list(args), env=self.env(), input=input,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout_s)
        if done.returncode != 0:
            raise PodmanError("podman %s: %s" % (" ".join(args),
                                                 done.stderr.decode(errors="replace").strip()))
        return done.stdout

    def import_rootfs(self, rootfs, reference: str, changes: Iterable[str] = ()) -> str:
        """A single-layer image ``reference`` (``localhost/name:tag``) from a root
        filesystem directory; its id. ``changes`` are Dockerfile instructions for the
        image's config (``ENV A=b``, ``WORKDIR /src``, ``USER nobody``)."""
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        change_args = [arg for change in changes for arg in ("--change", change)]
        try:
            done = subprocess.run(["podman", "import"] + change_args + ["-", reference],
                                  env=self.env(),
                                  stdin=tar.stdout, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        finally:
            tar.stdout.close()
            tar.wait()
        if done.returncode != 0 or tar.returncode != 0:
            raise PodmanError("import %s as %s: %s" % (rootfs, reference,
                                                       done.stderr.decode(errors="replace")))
        return done.stdout.decode().strip()

    def stop(self) -> None:
        """Remove every container of this service's storage, then stop the service."""
        if self.process is None:
            return
        try:
            self.podman("rm", "--all", "--force", "--time", "0", timeout_s=120)
        except (PodmanError, subprocess.TimeoutExpired):
            pass
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def __enter__(self) -> "PodmanService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
