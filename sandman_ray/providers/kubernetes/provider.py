"""KubernetesProvider: a pod per sandbox, through the official ``kubernetes`` client.

Each pod runs the task image unmodified with the daemon as its command:

- an init container (``bundle_image``, any image holding the daemon bundle at
  ``/bundle`` and a ``cp``) copies the bundle into an emptyDir mounted read-only at
  ``/.sandman`` in the sandbox container;
- the daemon listens on TCP (``daemon_port``) with a per-sandbox token in the
  container's environment (the daemon drops it from its environment before it starts
  anything); labels carry the pool, the sandbox id and the owner, never the token;
- readiness is the pod Running with an IP *and* the daemon answering
  (``check_answers``, from the pool's process), not the pod's Ready condition;
- the pod's ``sandman.spec`` annotation holds the sandbox's spec, so a restarted pool
  adopts its pods whole (limits, env, TTLs);
- one watch stream per namespace (label selector of the pool) keeps every pod's state:
  creates wait on it instead of polling pods one GET at a time;
- API errors are classified for the pool's pacing: 429 throttled (and every request of
  this provider waits out ``Retry-After``), 5xx and timeouts transient, other 4xx
  fatal; a 409 on create means an earlier attempt got through (a retry after a
  timeout), and that pod is adopted rather than duplicated;
- pods stuck in ``ErrImagePull``/``ImagePullBackOff``/``InvalidImageName`` fail the
  create with the reason (fatal: the image is wrong); pods Pending longer than
  ``pending_timeout_s`` (unschedulable, a node that never starts them) are deleted and
  the create fails transient, so the pool replaces them (or fatal, by
  ``stuck_policy="fail"``);
- delete is grace 0 with background propagation; pods are never reused (a fresh pod is
  a fresh sandbox).

``pod_template`` is merged into every pod: metadata labels and annotations, and spec
fields such as ``nodeSelector``, ``tolerations``, ``runtimeClassName`` (gVisor, Kata),
``serviceAccountName``, ``imagePullSecrets``; container-level entries under
``spec.containers[0]`` (``securityContext``, extra ``env``) merge into the sandbox
container. A sandbox's network is what the NetworkPolicies in
``cluster_configs/networkpolicy.yaml`` allow (pods always have an interface): no egress
for ``network=False``; for ``network=True`` (pods labelled ``sandman.network=true``),
the cluster's DNS and public addresses, none of the private, link-local, metadata or
reserved ranges the LocalProvider's filter refuses (nodes with public addresses must
be added to the policy by hand). ``network_allow`` cannot be
enforced per pod by the provider and is refused (a NetworkPolicy selecting the pods'
labels opens more). ``pids`` is the kubelet's ``podPidsLimit``; ``disk`` the
container's ``ephemeral-storage`` limit.

Every client call blocks, so each runs on the provider's thread pool.
"""

import asyncio
import copy
import hashlib
import json
import logging
import re
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from sandman_ray.errors import NotSupported, ProviderError
from sandman_ray.providers.base import (
    POOL_LABEL, SANDBOX_LABEL, Provider, SandboxInfo, SnapshotInfo, check_answers, fatal,
    transient)
from sandman_ray.providers.kubernetes.status import (
    api_error, http_status, pending_reason, retry_after_s, stuck_reason)
from sandman_ray.spec import SandboxSpec, parse_image

logger = logging.getLogger(__name__)

OWNER_LABEL = "sandman.owner"
# "true" on the pods of SandboxSpec(network=True): what cluster_configs/networkpolicy.yaml
# selects to let them out (to public addresses and the cluster's DNS only)
NETWORK_LABEL = "sandman.network"
CONTAINER = "sandbox"
SPEC_ANNOTATION = "sandman.spec"
# What a snapshot or a pause of a pod would need, which neither this provider nor the
# Kubernetes API offers; the NotSupported errors say it.
NO_SNAPSHOT = ("a pod's files cannot be captured through the Kubernetes API: a snapshot "
               "needs either a container-image build of the sandbox container's writable "
               "layer on its node (a commit by the node's container runtime, which the "
               "kubelet does not expose) pushed to a registry the cluster pulls from, or "
               "CSI VolumeSnapshots of a persistent volume holding the sandbox's work tree "
               "(the pods have only their image and emptyDirs)")
NO_PAUSE = ("a pod's processes cannot be paused through the Kubernetes API: a pause needs "
            "the kubelet to freeze the pod's cgroup (the container runtime's pause), which "
            "no Kubernetes API offers; delete the sandbox, or keep it running")


def label_value(text: str) -> str:
    """``text`` as a valid label value (<= 63 of [A-Za-z0-9_.-], alphanumeric ends)."""
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", text).strip("-_.")
    if clean == text and len(text) <= 63:
        return text
    return (clean[:50].strip("-_.") + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]).strip("-")


def pod_name(pool: str, sandbox_id: str) -> str:
    """A DNS-1123 name: lower case alphanumerics and '-', at most 63 characters."""
    pool_part = re.sub(r"[^a-z0-9-]", "-", pool.lower()).strip("-")[:24]
    digest = hashlib.sha256(pool.encode()).hexdigest()[:6]
    return ("sandman-%s-%s-%s" % (pool_part, digest, re.sub(r"[^a-z0-9-]", "-",
                                                            sandbox_id.lower())))[:63].strip("-")


def merge(base: Any, extra: Any) -> Any:
    """``extra`` merged into a copy of ``base``: maps key by key, lists of maps element
    by element, anything else replaced."""
    if isinstance(base, dict) and isinstance(extra, dict):
        out = dict(base)
        for key, value in extra.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(extra, list) and all(
            isinstance(x, dict) for x in base + extra):
        return [merge(base[i], extra[i]) if i < len(base) and i < len(extra)
                else copy.deepcopy((base + extra[len(base):])[i])
                for i in range(max(len(base), len(extra)))]
    return copy.deepcopy(extra)


class KubernetesProvider(Provider):
    """Sandboxes as pods of a Kubernetes cluster.

    namespace: where the pods run.
    bundle_image: the init container's image, holding the daemon bundle at ``/bundle``
        (build it with ``cluster_configs/bundle.Containerfile``).
    pod_template: a partial pod (dict) merged into every pod (see the module docstring).
    owner: the value of the ``sandman.owner`` label (who created these pods).
    host: the API server's URL; None loads the in-cluster configuration, or else
        ``kubeconfig``/``context`` (the kubeconfig's defaults when those are None).
    daemon_port: the port the daemon listens on in every pod.
    pending_timeout_s: a pod not Running this long after its create is replaced.
    max_api_calls: API requests in flight at once.
    request_timeout_s: a create unanswered this long is retried (and, if the first got
        through, adopted on the 409).
    stuck_policy: what a pod not running after ``pending_timeout_s`` (unschedulable, a
        node that never starts it) becomes: ``replace`` (deleted; the create fails
        transient and the pool tries again) or ``fail`` (deleted; the acquire fails
        with the reason). A bad image always fails, with the kubelet's reason.
    """

    supports_reset = False
    supports_snapshots = False  # see snapshot() and pause(): what they would need

    def __init__(self, namespace: str = "default", bundle_image: str = "sandman-ray/bundle:0.1",
                 pod_template: Optional[dict] = None, owner: str = "sandman-ray",
                 host: Optional[str] = None, kubeconfig: Optional[str] = None,
                 context: Optional[str] = None, daemon_port: int = 7000,
                 pending_timeout_s: float = 120.0, max_api_calls: int = 32,
                 request_timeout_s: float = 30.0, stuck_policy: str = "replace"):
        if pod_template is not None and not isinstance(pod_template, dict):
            raise ValueError("KubernetesProvider.pod_template must be a dict (a partial pod), "
                             "got %r" % type(pod_template).__name__)
        if not isinstance(daemon_port, int) or not 0 < daemon_port < 65536:
            raise ValueError("KubernetesProvider.daemon_port must be a TCP port, got %r"
                             % (daemon_port,))
        if stuck_policy not in ("replace", "fail"):
            raise ValueError("KubernetesProvider.stuck_policy must be 'replace' or 'fail', got %r"
                             % (stuck_policy,))
        self.stuck_policy = stuck_policy
        self.namespace, self.bundle_image = namespace, bundle_image
        self.pod_template, self.owner = pod_template or {}, owner
        self.host, self.kubeconfig, self.context = host, kubeconfig, context
        self.daemon_port, self.pending_timeout_s = daemon_port, pending_timeout_s
        self.max_api_calls, self.request_timeout_s = max_api_calls, request_timeout_s
        self.pool = "default"
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._api = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._slots: Optional[asyncio.Semaphore] = None
        self._not_before = 0.0            # monotonic: Retry-After from the API server
        self._pods: Dict[str, dict] = {}  # pod name -> latest pod seen by the watch
        self._changed: Dict[str, asyncio.Event] = {}
        self._watch: Optional[threading.Thread] = None
        self._stream = None  # the watch's open response
        self._synced: Optional[asyncio.Future] = None
        self._stop = threading.Event()
        self._loop = None
        self.stats = {"requests": 0, "throttled": 0, "conflicts": 0, "replaced": 0}

    def __getstate__(self):
        # the configuration travels; the client, threads and watch state (``_*``) do not
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k != "stats"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime()

    # ---- the client
    def api(self):
        if self._api is None:
            from kubernetes import client, config
            if self.host is not None:
                configuration = client.Configuration()
                configuration.host = self.host
            else:
                configuration = client.Configuration()
                try:
                    config.load_incluster_config(client_configuration=configuration)
                except config.ConfigException:
                    config.load_kube_config(config_file=self.kubeconfig, context=self.context,
                                            client_configuration=configuration)
            configuration.connection_pool_maxsize = self.max_api_calls + 4
            self._api = client.CoreV1Api(client.ApiClient(configuration))
        return self._api

    async def _call(self, what: str, fn, *args, **kwargs):
        """One API request on the thread pool, after any Retry-After the server asked
        for, errors classified; a 429 pushes every later request back too."""
        from kubernetes.client.exceptions import ApiException
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_api_calls, thread_name_prefix="k8s")
            self._slots = asyncio.Semaphore(self.max_api_calls)
        loop = asyncio.get_running_loop()
        async with self._slots:
            wait = self._not_before - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.stats["requests"] += 1
            try:
                return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
            except Exception as exc:
                if isinstance(exc, ApiException) and exc.status == 429:
                    self.stats["throttled"] += 1
                    self._not_before = max(self._not_before,
                                           time.monotonic() + retry_after_s(exc))
                raise api_error(exc, what) from exc

    # ---- the watch
    async def _ensure_watch(self) -> None:
        """One watch stream of this pool's pods, fed into ``_pods`` by a thread."""
        if self._watch is None:
            self._loop = asyncio.get_running_loop()
            self._synced = self._loop.create_future()
            self._watch = threading.Thread(target=self._watch_forever, args=(self._stop,),
                                           daemon=True, name="k8s-watch-%s" % self.pool)
            self._watch.start()
        await asyncio.shield(self._synced)

    def _selector(self, labels: Optional[Dict[str, str]] = None) -> str:
        wanted = {POOL_LABEL: label_value(self.pool)}
        wanted.update({k: label_value(v) for k, v in (labels or {}).items()})
        return ",".join("%s=%s" % kv for kv in sorted(wanted.items()))

    def _watch_forever(self, stop: threading.Event) -> None:
        """List, then watch from the list's resourceVersion; after an error or an
        expired version, list again. Runs until ``close`` sets ``stop``."""
        api, loop = self.api(), self._loop
        while not stop.is_set():
            try:
                listed = json.loads(api.list_namespaced_pod(
                    self.namespace, label_selector=self._selector(),
                    _preload_content=False).data)
                pods = {p["metadata"]["name"]: p for p in listed.get("items") or []}
                loop.call_soon_threadsafe(self._replace_all, stop, pods)
                version = listed["metadata"]["resourceVersion"]
                while not stop.is_set():
                    stream = self._stream = api.list_namespaced_pod(
                        self.namespace, label_selector=self._selector(), watch=True,
                        resource_version=version, timeout_seconds=300,
                        allow_watch_bookmarks=True, _preload_content=False)
                    for line in stream:
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            raise _Relist(event["object"].get("message", "watch error"))
                        pod = event["object"]
                        version = pod["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            loop.call_soon_threadsafe(self._seen, stop, event["type"], pod)
                        if stop.is_set():
                            break
            except _Relist:
                continue
            except Exception as exc:  # API, connection, decoding: the watch must not die
                if stop.is_set():
                    break
                logger.warning("pool %s: pod watch broke (%s); listing again", self.pool, exc)
                stop.wait(1.0)

    def _replace_all(self, stop: threading.Event, pods: Dict[str, dict]) -> None:
        if stop is not self._stop:
            return  # a watch of before close()
        self._pods = pods
        for name in set(self._changed):
            self._changed[name].set()
        if not self._synced.done():
            self._synced.set_result(True)

    def _seen(self, stop: threading.Event, kind: str, pod: dict) -> None:
        if stop is not self._stop:
            return
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            self._pods.pop(name, None)
        else:
            self._pods[name] = pod
        event = self._changed.get(name)
        if event is not None:
            event.set()

    # ---- pods
    def _pod(self, sandbox_id: str, spec: SandboxSpec, labels: Dict[str, str], token: str) -> dict:
        kind, image, _ = parse_image(spec.image)
        if kind != "registry":
            raise fatal("image %r: the KubernetesProvider runs registry images (such as "
                        "docker.io/library/debian:12)" % spec.image)
        if spec.network_allow:
            raise fatal("network_allow %s: the KubernetesProvider's network is what the "
                        "cluster's NetworkPolicies allow; write one that selects the pods "
                        "(SandboxSpec.labels) and allows those addresses, and leave "
                        "network_allow empty" % ", ".join(spec.network_allow))
        container: Dict[str, Any] = {
            "name": CONTAINER, "image": image, "command": ["/.sandman/bin/sandmand"],
            "args": ["--listen", "tcp:0.0.0.0:%d" % self.daemon_port],
            "env": [{"name": "SANDMAN_TOKEN", "value": token}] +
                   [{"name": k, "value": v} for k, v in sorted(spec.env.items())],
            "ports": [{"containerPort": self.daemon_port, "name": "sandmand"}],
            "volumeMounts": [{"name": "sandman", "mountPath": "/.sandman", "readOnly": True}]}
        if spec.workdir:
            container["workingDir"] = spec.workdir
        if spec.user:
            uid, _, gid = spec.user.partition(":")
            container["securityContext"] = {"runAsUser": int(uid), "runAsGroup": int(gid or uid)}
        limits = {}
        if spec.cpu:
            limits["cpu"] = "%dm" % max(1, int(spec.cpu * 1000))
        if spec.memory:
            limits["memory"] = str(spec.memory)
        if spec.disk:
            limits["ephemeral-storage"] = str(spec.disk)
        if limits:
            container["resources"] = {"limits": limits, "requests": dict(limits)}
        pod_labels = {label_value(k) if "/" not in k else k: label_value(v)
                      for k, v in labels.items()}
        pod_labels.update({POOL_LABEL: label_value(self.pool), SANDBOX_LABEL: label_value(sandbox_id),
                           OWNER_LABEL: label_value(self.owner),
                           NETWORK_LABEL: "true" if spec.network else "false"})
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(self.pool, sandbox_id), "labels": pod_labels,
                         "annotations": {"sandman.sandbox": sandbox_id}},
            "spec": {
                "restartPolicy": "Never", "automountServiceAccountToken": False,
                "enableServiceLinks": False, "terminationGracePeriodSeconds": 0,
                "initContainers": [{
                    "name": "sandman-bundle", "image": self.bundle_image,
                    "command": ["cp", "-a", "/bundle/.", "/.sandman/"],
                    "volumeMounts": [{"name": "sandman", "mountPath": "/.sandman"}]}],
                "containers": [container],
                "volumes": [{"name": "sandman", "emptyDir": {}}]}}
        pod = merge(pod, self.pod_template)
        # what the pool relies on wins over the template
        pod["metadata"]["labels"].update({POOL_LABEL: label_value(self.pool),
                                          SANDBOX_LABEL: label_value(sandbox_id)})
        pod["metadata"].setdefault("annotations", {}).update({
            "sandman.sandbox": sandbox_id, SPEC_ANNOTATION: json.dumps(spec.to_dict())})
        return pod

    def _info(self, pod: dict) -> SandboxInfo:
        meta, status = pod["metadata"], pod.get("status") or {}
        sandbox_id = (meta.get("annotations") or {}).get("sandman.sandbox",
                                                         meta["labels"].get(SANDBOX_LABEL))
        container = next((c for c in pod["spec"]["containers"] if c["name"] == CONTAINER),
                         pod["spec"]["containers"][0])
        env = {e["name"]: e.get("value", "") for e in container.get("env") or []}
        ip = status.get("podIP")
        return SandboxInfo(
            sandbox_id=sandbox_id, address="tcp:%s:%d" % (ip, self.daemon_port) if ip else "",
            token=env.get("SANDMAN_TOKEN", ""), node_id=None, labels=dict(meta.get("labels") or {}),
            created_at=time.time(), spec=_spec_of(meta, container, env),
            alive=status.get("phase") in ("Pending", "Running")
            and not meta.get("deletionTimestamp"),
            details={"pod": meta["name"], "node": pod["spec"].get("nodeName"),
                     "phase": status.get("phase"), "image": container.get("image")})

    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels: Dict[str, str]) -> SandboxInfo:
        await self._ensure_watch()
        name = pod_name(self.pool, sandbox_id)
        pod = self._pod(sandbox_id, spec, labels, secrets.token_hex(16))
        event = self._changed.setdefault(name, asyncio.Event())
        try:
            try:
                await self._call("create pod %s" % name, self.api().create_namespaced_pod,
                                 self.namespace, pod, _preload_content=False,
                                 _request_timeout=self.request_timeout_s)
            except ProviderError as exc:
                if http_status(exc) != 409:
                    raise
                # an earlier attempt got through (its answer was lost or late): adopt
                # that pod if it is this pool's sandbox of this id
                self.stats["conflicts"] += 1
                existing = await self._get(name)
                if existing is None or existing["metadata"]["labels"].get(POOL_LABEL) != \
                        label_value(self.pool):
                    raise fatal("pod %s exists and is not this pool's sandbox %s"
                                % (name, sandbox_id)) from exc
            info = await self._wait_running(name, sandbox_id, event)
        finally:
            self._changed.pop(name, None)
        try:
            await check_answers(info)
        except ProviderError:
            await self._delete_pod(name)
            raise
        return info

    async def _get(self, name: str) -> Optional[dict]:
        try:
            raw = await self._call("get pod %s" % name, self.api().read_namespaced_pod, name,
                                   self.namespace, _preload_content=False)
        except ProviderError as exc:
            if http_status(exc) == 404:
                return None
            raise
        return json.loads(raw.data)

    async def _wait_running(self, name: str, sandbox_id: str, event: asyncio.Event) -> SandboxInfo:
        """Until the watch shows the pod Running with an IP; a pod that cannot become
        so is deleted and the create fails, saying why."""
        deadline = time.monotonic() + self.pending_timeout_s
        while True:
            pod = self._pods.get(name)
            if pod is not None and pod["metadata"].get("deletionTimestamp"):
                # an earlier attempt's pod, deleted (its daemon did not answer): not this one
                raise transient("sandbox %s: pod %s is still being deleted" % (sandbox_id, name))
            if pod is not None:
                status = pod.get("status") or {}
                if status.get("phase") == "Running" and status.get("podIP"):
                    return self._info(pod)
                problem = stuck_reason(pod)
                if problem is not None:
                    await self._delete_pod(name)
                    raise fatal("sandbox %s: pod %s cannot start: %s" % (sandbox_id, name, problem))
                if status.get("phase") in ("Failed", "Succeeded"):
                    await self._delete_pod(name)
                    raise transient("sandbox %s: pod %s ended (%s) before it ran: %s" % (
                        sandbox_id, name, status.get("phase"), status.get("message", "")))
            left = deadline - time.monotonic()
            if left <= 0:
                self.stats["replaced"] += 1
                await self._delete_pod(name)
                failure = fatal if self.stuck_policy == "fail" else transient
                raise failure("sandbox %s: pod %s not running after %.0f s (%s); deleted%s" % (
                    sandbox_id, name, self.pending_timeout_s, pending_reason(pod),
                    "" if self.stuck_policy == "fail" else ", the pool replaces it"))
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def _delete_pod(self, name: str) -> None:
        try:
            await self._call("delete pod %s" % name, self.api().delete_namespaced_pod, name,
                             self.namespace, grace_period_seconds=0,
                             propagation_policy="Background", _preload_content=False)
        except ProviderError as exc:
            if http_status(exc) != 404:
                raise

    async def delete(self, sandbox_id: str) -> None:
        await self._delete_pod(pod_name(self.pool, sandbox_id))

    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        """This pool's pods whose labels include ``labels``, from the watch's view."""
        await self._ensure_watch()
        wanted = {k: label_value(v) for k, v in (labels or {}).items()}
        return [self._info(p) for p in list(self._pods.values())
                if all((p["metadata"].get("labels") or {}).get(k) == v
                       for k, v in wanted.items())]

    # ---- snapshots and pauses: not offered (supports_snapshots stays False)
    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        """Refused: NotSupported, saying what a snapshot of a pod would need."""
        raise NotSupported("snapshot %r of sandbox %s (pool %s): %s"
                           % (name, sandbox_id, self.pool, NO_SNAPSHOT))

    async def delete_snapshot(self, name: str) -> None:
        """Refused: this provider never made a snapshot."""
        raise NotSupported("delete snapshot %r (pool %s): the KubernetesProvider has no "
                           "snapshots; %s" % (name, self.pool, NO_SNAPSHOT))

    async def pause(self, sandbox_id: str, reclaim: bool = False) -> None:
        """Refused: NotSupported, saying what a pause of a pod would need."""
        raise NotSupported("pause sandbox %s (pool %s): %s" % (sandbox_id, self.pool, NO_PAUSE))

    async def resume(self, sandbox_id: str) -> None:
        """Refused: no pod of this provider is ever paused."""
        raise NotSupported("resume sandbox %s (pool %s): %s" % (sandbox_id, self.pool, NO_PAUSE))

    async def shutdown(self) -> int:
        """Delete every pod of this pool (by a fresh list, not the watch's view)."""
        raw = await self._call("list pods", self.api().list_namespaced_pod, self.namespace,
                               label_selector=self._selector(), _preload_content=False)
        names = [p["metadata"]["name"] for p in json.loads(raw.data).get("items") or []]
        await asyncio.gather(*(self._delete_pod(n) for n in names))
        await self.close()
        return len(names)

    async def close(self) -> None:
        self._stop.set()
        _unblock(self._stream)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._reset_runtime()


def _spec_of(meta: dict, container: dict, env: Dict[str, str]) -> Optional[SandboxSpec]:
    """The spec a pod was made from: its annotation; for a pod made before pods carried
    one, what the pod itself says (image and env; its limits are not read back). None
    when neither makes a spec."""
    try:
        return SandboxSpec.from_dict(json.loads(meta["annotations"][SPEC_ANNOTATION]))
    except (KeyError, TypeError, ValueError):
        pass
    try:
        return SandboxSpec(image=container["image"],
                           env={k: v for k, v in env.items() if k != "SANDMAN_TOKEN"})
    except (KeyError, TypeError, ValueError):
        return None


def _unblock(stream) -> None:
    """End a watch response another thread is blocked reading: shut its socket down
    (closing the response would wait for the reader's lock until the next event)."""
    connection = getattr(stream, "connection", None) or getattr(stream, "_connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Relist(Exception):
    """The watch's resourceVersion expired: list again."""
