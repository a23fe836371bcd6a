"""The simulated Kubernetes API server (see the package docstring: a SIMULATION)."""

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent.parent
DAEMON_SCRIPT = ROOT / "sandman_ray" / "daemon" / "sandmand"  # the package, run as a directory


@dataclass
class SimConfig:
    """The simulated cluster's behaviour (all rates per second, all delays in seconds)."""

    nodes: int = 4
    pods_per_node: int = 110           # the kubelet's default max pods
    api_qps: float = 200.0             # API rate limit: requests per second ...
    api_burst: int = 400               # ... and burst; over it: 429 + Retry-After
    retry_after_s: int = 1
    reject_cost: float = 0.1           # a 429 still costs the server this share of a request
    schedule_rate_per_s: float = 500.0
    pull_s: float = 1.0                # first pod of an image on a node waits this long
    start_s: float = 0.1               # container start
    bad_images: List[str] = field(default_factory=list)   # ErrImagePull -> ImagePullBackOff
    stuck_nodes: List[str] = field(default_factory=list)  # containers never start there
    slow_creates: int = 0              # the next N creates are stored at once ...
    slow_create_s: float = 0.0         # ... but answered only after this long
    daemons: str = "simulated"         # "real": a sandmand process per pod
    daemon_port: int = 7000
    history: int = 200000              # watch events kept for resourceVersion replays


def node_name(index: int) -> str:
    return "sim-node-%d" % index


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def parse_selector(text: str) -> List[Tuple[str, str, Optional[str]]]:
    """``a=b,c!=d,e,!f`` as (op, key, value) terms; ValueError on anything else."""
    terms = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        if "!=" in part:
            key, value = part.split("!=", 1)
            terms.append(("!=", key.strip(), value.strip()))
        elif "==" in part or "=" in part:
            key, value = part.split("==", 1) if "==" in part else part.split("=", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif part.startswith("!"):
            terms.append(("!", part[1:].strip(), None))
        elif " " in part or "(" in part:
            raise ValueError("unsupported label selector term %r" % part)
        else:
            terms.append(("exists", part, None))
    return terms


def selects(terms, labels: Dict[str, str]) -> bool:
    for op, key, value in terms:
        have = labels.get(key)
        if (op == "=" and have != value) or (op == "!=" and have == value) \
                or (op == "exists" and have is None) or (op == "!" and have is not None):
            return False
    return True


class TokenBucket:
    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self, reject_cost: float = 0.0) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        # turning a request away is work too (authentication, authorization and parsing
        # happen before a request is refused): it delays everyone, cluster components too
        self.tokens -= reject_cost
        return False

    async def wait(self) -> None:
        """For the cluster's own components (scheduler binds, kubelet status updates):
        they wait their turn rather than being turned away."""
        while not self.take():
            await asyncio.sleep(max(0.005, (1 - self.tokens) / self.rate))


class SimCluster:
    """Pods, their events, the scheduler and the kubelets, on one event loop."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.pods: Dict[Tuple[str, str], dict] = {}
        self.rv = 0
        self.events = collections.deque(maxlen=config.history)  # (rv, ns, labels, line)
        self.watchers: List[Tuple[str, list, asyncio.Queue]] = []
        self.bucket = TokenBucket(config.api_qps, config.api_burst)
        self.pending: collections.deque = collections.deque()
        self.wake_scheduler = asyncio.Event()
        self.node_pods = collections.Counter()
        self.node_images: Dict[Tuple[str, str], asyncio.Future] = {}
        self.next_ip = collections.Counter()
        self.by_ip: Dict[str, Tuple[str, str]] = {}
        self.daemons: Dict[Tuple[str, str], subprocess.Popen] = {}
        self.stats = collections.Counter()

    # ---- events
    def emit(self, kind: str, pod: dict) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        line = (json.dumps({"type": kind, "object": pod}) + "\n").encode()
        ns, labels = pod["metadata"]["namespace"], pod["metadata"].get("labels") or {}
        self.events.append((self.rv, ns, labels, line))
        for wns, terms, queue in self.watchers:
            if wns == ns and selects(terms, labels):
                queue.put_nowait(line)

    # ---- API operations
    def create(self, ns: str, body: dict) -> dict:
        meta = body.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name or generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not (body.get("spec") or {}).get("containers"):
            raise ApiError(422, "Invalid", "spec.containers: Required value")
        key = (ns, meta["name"])
        if key in self.pods:
            self.stats["conflicts"] += 1
            raise ApiError(409, "AlreadyExists", 'pods "%s" already exists' % meta["name"])
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
        body.update(apiVersion="v1", kind="Pod")
        body["status"] = {"phase": "Pending", "conditions": []}
        self.pods[key] = body
        self.stats["creates"] += 1
        self.emit("ADDED", body)
        self.pending.append(key)
        self.wake_scheduler.set()
        return body

    def get(self, ns: str, name: str) -> dict:
        pod = self.pods.get((ns, name))
        if pod is None:
            raise ApiError(404, "NotFound", 'pods "%s" not found' % name)
        return pod

    def list(self, ns: str, terms) -> dict:
        items = [p for (pns, _), p in self.pods.items()
                 if pns == ns and selects(terms, p["metadata"].get("labels") or {})]
        return {"kind": "PodList", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    def delete(self, ns: str, name: str, grace_s: int) -> dict:
        pod = self.get(ns, name)
        self.stats["deletes"] += 1
        if grace_s > 0 and not pod["metadata"].get("deletionTimestamp"):
            pod["metadata"]["deletionTimestamp"] = now_rfc3339()
            pod["metadata"]["deletionGracePeriodSeconds"] = grace_s
            self.emit("MODIFIED", pod)
            asyncio.get_running_loop().call_later(grace_s, self._remove, (ns, name))
        elif grace_s <= 0:
            self._remove((ns, name))
        return pod

    def _remove(self, key) -> None:
        pod = self.pods.pop(key, None)
        if pod is None:
            return
        node = pod["spec"].get("nodeName")
        if node:
            self.node_pods[node] -= 1
        ip = pod["status"].get("podIP")
        if ip:
            self.by_ip.pop(ip, None)
        proc = self.daemons.pop(key, None)
        if proc is not None:  # TERM: the daemon stops what it started, as in a container
            asyncio.get_running_loop().run_in_executor(None, stop_daemon, proc)
        self.emit("DELETED", pod)

    # ---- scheduler
    async def scheduler(self) -> None:
        nodes = [node_name(i) for i in range(self.config.nodes)]
        turn = 0
        while True:
            if not self.pending:
                self.wake_scheduler.clear()
                await self.wake_scheduler.wait()
            key = self.pending.popleft()
            pod = self.pods.get(key)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                continue
            free = [n for n in nodes if self.node_pods[n] < self.config.pods_per_node]
            if not free:
                if not pod["status"]["conditions"]:
                    pod["status"]["conditions"] = [{
                        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/%d nodes are available: too many pods" % len(nodes)}]
                    self.emit("MODIFIED", pod)
                asyncio.get_running_loop().call_later(0.5, self._requeue, key)
                continue
            await self.bucket.wait()  # the binding is an API request too
            if self.pods.get(key) is not pod:
                continue
            turn += 1
            node = free[turn % len(free)]
            self.node_pods[node] += 1
            pod["spec"]["nodeName"] = node
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            self.stats["scheduled"] += 1
            self.emit("MODIFIED", pod)
            asyncio.ensure_future(self.kubelet(key, node))
            await asyncio.sleep(1.0 / self.config.schedule_rate_per_s)

    def _requeue(self, key) -> None:
        self.pending.append(key)
        self.wake_scheduler.set()

    # ---- kubelet
    def _waiting(self, pod: dict, reason: str, message: str = "") -> None:
        pod["status"]["containerStatuses"] = [{
            "name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
            "restartCount": 0,
            "state": {"waiting": {"reason": reason, "message": message}}}
            for c in pod["spec"]["containers"]]
        self.emit("MODIFIED", pod)

    async def kubelet(self, key, node: str) -> None:
        pod = self.pods.get(key)
        if pod is None:
            return
        if node in self.config.stuck_nodes:
            self._waiting(pod, "ContainerCreating")
            return  # never starts
        images = [c.get("image", "") for c in
                  (pod["spec"].get("initContainers") or []) + pod["spec"]["containers"]]
        for image in images:
            if image in self.config.bad_images:
                self._waiting(pod, "ErrImagePull", "failed to pull image %r: not found" % image)
                await asyncio.sleep(0.2)
                if key in self.pods:
                    self._waiting(pod, "ImagePullBackOff",
                                  'Back-off pulling image "%s"' % image)
                return
            pulled = self.node_images.get((node, image))
            if pulled is None:
                pulled = self.node_images[(node, image)] = asyncio.ensure_future(
                    asyncio.sleep(self.config.pull_s))
                self.stats["pulls"] += 1
            await pulled
        await asyncio.sleep(self.config.start_s)
        if self.pods.get(key) is not pod or pod["metadata"].get("deletionTimestamp"):
            return
        index = int(node.rsplit("-", 1)[1])
        self.next_ip[node] += 1
        serial = self.next_ip[node]
        ip = "127.%d.%d.%d" % (10 + index, serial // 250, serial % 250 + 1)
        if self.config.daemons == "real":
            try:
                await self._start_real_daemon(key, pod, ip)
            except (OSError, RuntimeError) as exc:
                self._waiting(pod, "CrashLoopBackOff", str(exc))
                return
        await self.bucket.wait()  # the kubelet's status update is an API request too
        if self.pods.get(key) is not pod or pod["metadata"].get("deletionTimestamp"):
            proc = self.daemons.pop(key, None)  # deleted while it started
            if proc is not None:
                asyncio.get_running_loop().run_in_executor(None, stop_daemon, proc)
            return
        self.by_ip[ip] = key
        pod["status"].update(
            phase="Running", podIP=ip, hostIP="10.0.0.%d" % (index + 1), startTime=now_rfc3339(),
            conditions=[{"type": t, "status": "True"} for t in
                        ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            containerStatuses=[{"name": c["name"], "image": c.get("image", ""), "imageID": "",
                                "ready": True, "restartCount": 0,
                                "state": {"running": {"startedAt": now_rfc3339()}}}
                               for c in pod["spec"]["containers"]])
        self.emit("MODIFIED", pod)

    async def _start_real_daemon(self, key, pod: dict, ip: str) -> None:
        """The pod's daemon as a host process on the pod's address: its command line with
        ``/.sandman/bin/sandmand`` replaced by this checkout's daemon package, and its
        environment (the token)."""
        container = pod["spec"]["containers"][0]
        args = list(container.get("args") or [])
        args = [("tcp:%s:%d" % (ip, self.config.daemon_port) if a.startswith("tcp:") else a)
                for a in args]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for item in container.get("env") or []:
            env[item["name"]] = item.get("value", "")
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, str(DAEMON_SCRIPT)] + args +
                                    ["--ready-fd", str(write_fd)], env=env, pass_fds=(write_fd,),
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(write_fd)
        self.daemons[key] = proc
        loop = asyncio.get_running_loop()
        line = await loop.run_in_executor(None, os.read, read_fd, 256)
        os.close(read_fd)
        if not line:
            raise RuntimeError("the daemon exited with %s before listening" % proc.wait())

    # ---- the simulated daemons: one responder for every pod's address
    async def simulated_daemon(self, reader, writer) -> None:
        from sandman_ray.daemon.sandmand.wire import (
            PROTOCOL_VERSION, FrameReader, encode_frame, unpack)
        ip = writer.get_extra_info("sockname")[0]
        key = self.by_ip.get(ip)
        frames = FrameReader()
        authed = False
        try:
            while key is not None and key in self.pods:
                data = await reader.read(65536)
                if not data:
                    break
                for body in frames.feed(data):
                    msg = unpack(body)
                    op, rid = msg.get("op"), msg.get("id")
                    if not authed:
                        env = {e["name"]: e.get("value") for e in
                               self.pods[key]["spec"]["containers"][0].get("env") or []}
                        if op != "hello" or msg.get("token") != env.get("SANDMAN_TOKEN"):
                            writer.write(encode_frame({"id": None, "ok": False, "error": {
                                "type": "AuthError", "message": "bad token"}}))
                            return
                        authed = True
                        reply = {"version": PROTOCOL_VERSION, "pid": 1, "python": "simulated"}
                    elif op == "ping":
                        reply = {}
                    elif op == "exec":
                        reply = {"exit_code": 0, "stdout": b"", "stderr": b"", "duration_s": 0.0,
                                 "timed_out": False, "signal": None}
                    else:
                        writer.write(encode_frame({"id": rid, "ok": False, "error": {
                            "type": "UnknownOp",
                            "message": "a simulated daemon answers hello, ping and exec only"}}))
                        continue
                    writer.write(encode_frame({"id": rid, "ok": True, "result": reply}))
                await writer.drain()
        except (ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def shutdown(self) -> None:
        for proc in self.daemons.values():
            stop_daemon(proc)
        self.daemons.clear()


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason = code, reason


def status_body(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def make_app(cluster: SimCluster):
    from aiohttp import web

    def error(exc: ApiError, headers=None):
        return web.json_response(status_body(exc.code, exc.reason, str(exc)), status=exc.code,
                                 headers=headers)

    @web.middleware
    async def rate_limit(request, handler):
        cluster.stats["requests"] += 1
        watching = request.query.get("watch") in ("true", "1")
        if not request.path.startswith("/sim/") and not watching and \
                not cluster.bucket.take(cluster.config.reject_cost):
            cluster.stats["throttled"] += 1
            return error(ApiError(429, "TooManyRequests",
                                  "the server has received too many requests"),
                         headers={"Retry-After": str(cluster.config.retry_after_s)})
        try:
            return await handler(request)
        except ApiError as exc:
            return error(exc)

    async def create_pod(request):
        body = await request.json()
        pod = cluster.create(request.match_info["ns"], body)
        if cluster.config.slow_creates > 0:
            cluster.config.slow_creates -= 1
            await asyncio.sleep(cluster.config.slow_create_s)
        return web.json_response(pod, status=201)

    async def list_pods(request):
        ns = request.match_info["ns"]
        try:
            terms = parse_selector(request.query.get("labelSelector", ""))
        except ValueError as exc:
            raise ApiError(400, "BadRequest", str(exc))
        if request.query.get("watch") in ("true", "1"):
            return await watch(request, ns, terms)
        cluster.stats["lists"] += 1
        return web.json_response(cluster.list(ns, terms))

    async def watch(request, ns, terms):
        cluster.stats["watches"] += 1
        since = int(request.query.get("resourceVersion") or cluster.rv)
        timeout_s = float(request.query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if cluster.events and since < cluster.events[0][0] - 1 and since < cluster.rv:
            gone = status_body(410, "Expired", "too old resource version: %d" % since)
            await response.write((json.dumps({"type": "ERROR", "object": gone}) + "\n").encode())
            return response
        queue: asyncio.Queue = asyncio.Queue()
        for rv, ens, labels, line in cluster.events:
            if rv > since and ens == ns and selects(terms, labels):
                queue.put_nowait(line)
        entry = (ns, terms, queue)
        cluster.watchers.append(entry)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    line = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if line is None:  # the server stops
                    break
                lines = [line]
                while not queue.empty():
                    lines.append(queue.get_nowait())
                if None in lines:
                    break
                await response.write(b"".join(lines))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            cluster.watchers.remove(entry)
        return response

    async def get_pod(request):
        return web.json_response(cluster.get(request.match_info["ns"], request.match_info["name"]))

    async def delete_pod(request):
        grace = request.query.get("gracePeriodSeconds")
        if request.can_read_body:
            body = await request.json()
            if isinstance(body, dict) and body.get("gracePeriodSeconds") is not None:
                grace = body["gracePeriodSeconds"]
        pod = cluster.delete(request.match_info["ns"], request.match_info["name"],
                             int(grace) if grace is not None else 30)
        return web.json_response(pod)

    async def stats(request):
        counts = dict(cluster.stats)
        counts["pods"] = len(cluster.pods)
        counts["running"] = sum(1 for p in cluster.pods.values()
                                if p["status"].get("phase") == "Running")
        return web.json_response(counts)

    async def configure(request):
        for key, value in (await request.json()).items():
            if not hasattr(cluster.config, key):
                raise ApiError(400, "BadRequest", "no simulator setting %r" % key)
            setattr(cluster.config, key, value)
        cluster.bucket = TokenBucket(cluster.config.api_qps, cluster.config.api_burst)
        return web.json_response(asdict(cluster.config))

    async def version(request):
        return web.json_response({"major": "1", "minor": "31", "gitVersion": "v1.31.0-sim"})

    app = web.Application(middlewares=[rate_limit], client_max_size=16 * 2 ** 20)
    app.router.add_post("/api/v1/namespaces/{ns}/pods", create_pod)
    app.router.add_get("/api/v1/namespaces/{ns}/pods", list_pods)
    app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", get_pod)
    app.router.add_delete("/api/v1/namespaces/{ns}/pods/{name}", delete_pod)
    app.router.add_get("/sim/stats", stats)
    app.router.add_post("/sim/config", configure)
    app.router.add_get("/version", version)
    return app


async def serve(config: SimConfig, port: int, ready) -> None:
    from aiohttp import web
    cluster = SimCluster(config)
    runner = web.AppRunner(make_app(cluster), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    daemon_server = None
    if config.daemons == "simulated":  # every 127.x.y.z reaches a socket bound to 0.0.0.0
        daemon_server = await asyncio.start_server(cluster.simulated_daemon, "0.0.0.0",
                                                   config.daemon_port, backlog=4096)
    scheduler = asyncio.ensure_future(cluster.scheduler())
    stop = asyncio.get_running_loop().create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, lambda: stop.done() or stop.set_result(1))
    ready("http://127.0.0.1:%d" % runner.addresses[0][1])
    try:
        await stop
    finally:
        for _, _, queue in cluster.watchers:  # end every watch stream
            queue.put_nowait(None)
        scheduler.cancel()
        cluster.shutdown()
        if daemon_server is not None:
            daemon_server.close()
        await runner.cleanup()


def start_process(config: SimConfig, timeout_s: float = 30.0):
    """The simulator in a process of its own; (its URL, the process)."""
    proc = subprocess.Popen([sys.executable, "-m", "k8s_sim", json.dumps(asdict(config))],
                            stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).parent.parent),
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])))
    line = proc.stdout.readline()
    if not line.startswith("listening "):
        proc.kill()
        raise RuntimeError("the simulator did not start: %r" % line)
    return line.split()[1], proc


def main(argv) -> int:
    config = SimConfig(**json.loads(argv[0])) if argv else SimConfig()
    asyncio.run(serve(config, 0, lambda url: print("listening", url, flush=True)))
    return 0
