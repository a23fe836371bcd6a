"""Observability on a real local Ray with its dashboard: the pool's metrics as Ray
exports them to Prometheus, the dashboard's actor list seen by a headless Chromium,
and the ``sandman`` command against live pools."""

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import ray

import sandman_ray as sandman
from conftest import (
    ROOT, free_port, own_ray, processes_matching, require_bwrap, unique_pool, wait_until)

STATE = "/tmp/sandman-ray-test/observability-state"
CACHE = str(ROOT / ".cache" / "provider")
ARTIFACTS = ROOT / "test-artifacts"
SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} ([0-9.e+-]+)$')


@pytest.fixture(scope="module")
def cluster():
    require_bwrap()
    ports = {"dashboard": free_port(), "metrics": free_port()}
    # a Ray of its own: the dashboard and a metrics port (the session's has neither)
    own_ray(num_cpus=2, include_dashboard=True, dashboard_port=ports["dashboard"],
            _metrics_export_port=ports["metrics"], namespace="sandman-observability-tests")
    ports["gcs"] = ray.get_runtime_context().gcs_address
    yield ports
    ray.shutdown()


def new_pool(**config):
    return unique_pool(sandman.LocalProvider(state_root=STATE, cache_root=CACHE), "o", **config)


def scrape(port: int) -> dict:
    """{(metric name, frozenset of label pairs): value} from the metrics endpoint."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def series(samples: dict, name: str, pool: str, **labels) -> float:
    """The sum of ``name``'s samples for ``pool`` with ``labels``."""
    want = {("pool", pool)} | set(labels.items())
    return sum(v for (n, l), v in samples.items() if n == name and want <= l)


def test_metrics_endpoint_shows_the_pool_during_a_burst(cluster):
    pool = new_pool(warm={"host": 2}, create_rate_per_s=50.0)

    async def burst():
        return await asyncio.gather(*(sandman.acquire_async("host", pool=pool, timeout=120)
                                      for _ in range(6)))
    handles = asyncio.run(burst())
    try:
        for h in handles:
            assert ray.get(h.exec.remote("true")).exit_code == 0
        found = {}

        def exported():
            samples = scrape(cluster["metrics"])
            found.update(
                leased=series(samples, "ray_sandman_sandboxes", pool, state="leased"),
                waits=series(samples, "ray_sandman_acquire_wait_seconds_count", pool),
                creates=series(samples, "ray_sandman_creates_total", pool),
                ready=series(samples, "ray_sandman_time_to_ready_seconds_count", pool),
                rate=series(samples, "ray_sandman_create_rate_per_s", pool),
                execs=series(samples, "ray_sandman_handle_call_seconds_count", pool, op="exec"),
                clients=series(samples, "ray_sandman_leases", pool))
            return (found["leased"] == 6 and found["waits"] >= 6 and found["execs"] >= 6
                    and found["clients"] == 6)
        wait_until(exported, timeout=60, what="the pool's series exported")
        assert found["creates"] >= 6 and found["ready"] == found["creates"]
        assert 0 < found["rate"] <= 50.0  # the bucket's rate, never above the pool's
        # what dashboards/sandman_pools.json asks for is exported under those names,
        # with the SessionName label its variable filters by
        import test_dashboard
        mine = {n: dict(l) for (n, l), _ in scrape(cluster["metrics"]).items()
                if ("pool", pool) in l}
        asked = {m for expr in test_dashboard.queries(json.loads(
            test_dashboard.DASHBOARD.read_text())) for m in re.findall(r"ray_sandman_\w+", expr)}
        always = {m for m in asked if not re.search(r"failures|throttle|deletes|resets", m)}
        assert always <= set(mine), always - set(mine)  # the rest need a failure or reset
        assert all(labels.get("SessionName") for labels in mine.values())
        # the pool's calls to its agent are Ray tasks counted by name (ray_tasks): named
        # per pool, never per sandbox, or each sandbox made would add series for good
        wait_until(lambda: any(n == "ray_tasks" and dict(l).get("Name", "").startswith(
            "sandman:create:") for n, l in scrape(cluster["metrics"])),
            timeout=60, what="the pool's create tasks counted")
        ids = {h.sandbox for h in handles}
        labelled = [(n, dict(l)) for n, l in scrape(cluster["metrics"])
                    if any(i in value for _, value in l for i in ids)]
        assert not labelled, labelled[:3]
    finally:
        for h in handles:
            sandman.release(h)
        sandman.shutdown_pool(pool)


def auth_token() -> str:
    """The cluster's token, as a user gets it (``ray get-auth-token``); empty when
    token authentication is off."""
    proc = subprocess.run([str(Path(sys.executable).with_name("ray")), "get-auth-token"],
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() if proc.returncode == 0 else ""


@pytest.mark.slow
def test_dashboard_lists_the_pool_and_handles_by_name(cluster):
    """Chromium (Debian's, driven by Playwright) opens the dashboard's actors page with
    the cluster's token, as a user who signed in; the pool actor, its node agent and
    the handles holding its sandboxes appear by name. The screenshot is kept in
    test-artifacts/."""
    from playwright.sync_api import sync_playwright
    chromium = shutil.which("chromium")
    assert chromium, "chromium is installed by make (DEBIAN_PACKAGES)"
    pool = new_pool(warm={"host": 2})
    handles = [sandman.acquire("host", pool=pool, timeout=120) for _ in range(2)]
    try:
        names = {r["holder"] for r in ray.get(sandman.get_pool(pool).list_sandboxes.remote())
                 if r["state"] == "leased"}
        # both leases are held by this driver's one handle host on the node
        assert len(names) == 1 and all(n.startswith("sandman:sbx:") for n in names)
        origin = "http://127.0.0.1:%d" % cluster["dashboard"]
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard-actors.png"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium,
                                         args=["--no-sandbox", "--disable-dev-shm-usage"])
            try:
                context = browser.new_context(viewport={"width": 1600, "height": 1200})
                token = auth_token()
                if token:
                    context.add_cookies([{"name": "ray-authentication-token", "value": token,
                                          "url": origin}])
                page = context.new_page()
                page.goto(origin + "/#/actors")
                page.get_by_text("sandman:pool:%s" % pool, exact=True).wait_for(timeout=60000)
                text = page.inner_text("body")
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
        assert shot.is_file() and shot.stat().st_size > 10000
        for name in names:  # the handles holding the pool's sandboxes
            assert name in text
        assert "sandman:agent:%s:" % pool in text  # and the pool's node agent
    finally:
        for h in handles:
            sandman.release(h)
        sandman.shutdown_pool(pool)


# ---------------------------------------------------------------------- the sandman command
def sandman_cmd(cluster, *args, timeout=120) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("sandman")
    return subprocess.run([str(exe), "--address", cluster["gcs"]] + list(args),
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@ray.remote(num_cpus=0)
class Holder:
    def hold(self, pool: str) -> str:
        self.sandbox = sandman.acquire("host", pool=pool, timeout=120)
        return self.sandbox.sandbox


def test_status_list_events_and_gc_against_a_live_pool(cluster):
    # a watchdog that sweeps once an hour: what gc finds stays until gc deletes it
    pool = new_pool(sweep_interval_s=3600, lease_grace_s=1.0)
    kept = sandman.acquire("host", pool=pool, timeout=120)
    holder = Holder.remote()  # another process, with its own handle host
    lost_id = ray.get(holder.hold.remote(pool))
    kept_id = ray.get(kept.sandbox_id.remote())
    try:
        status = sandman_cmd(cluster, "status", pool, "--json")
        assert status.returncode == 0, status.stderr
        (state,) = json.loads(status.stdout)
        assert state["pool"] == pool and state["states"]["leased"] == 2
        assert sum(state["leases_per_client"].values()) == 2
        text = sandman_cmd(cluster, "status").stdout
        assert "pool %s" % pool in text and "leased" in text and "oldest lease" in text

        listed = json.loads(sandman_cmd(cluster, "list", pool, "--json").stdout)
        assert {(r["sandbox_id"], r["state"]) for r in listed} == {
            (kept_id, "leased"), (lost_id, "leased")}
        assert all(r["image"] == "host" and r["client"] and r["node_id"] for r in listed)
        assert kept_id in sandman_cmd(cluster, "list").stdout

        events = json.loads(sandman_cmd(cluster, "events", pool, "--json").stdout)
        mine = [e["state"] for e in events if e["sandbox_id"] == kept_id]
        assert mine[-3:] == ["started", "ready", "leased"]
        assert any(e["reason"].startswith("lent to") for e in events)

        ray.kill(holder)  # a holder that died: no live handle holds its sandbox now
        wait_until(lambda: lost_id in sandman_cmd(cluster, "gc", pool, "--dry-run").stdout,
                   timeout=30, what="gc to see the lost sandbox")
        dry = sandman_cmd(cluster, "gc", pool, "--dry-run").stdout
        assert "would delete %s" % lost_id in dry and kept_id not in dry
        assert json.loads(sandman_cmd(cluster, "status", pool, "--json").stdout)[0][
            "states"]["leased"] == 2  # a dry run deletes nothing
        real = sandman_cmd(cluster, "gc", pool)
        assert "deleted %s" % lost_id in real.stdout and "1 sandbox deleted" in real.stdout
        after = json.loads(sandman_cmd(cluster, "status", pool, "--json").stdout)[0]
        assert after["states"]["leased"] == 1
        assert ray.get(kept.exec.remote("true")).exit_code == 0  # the live one is untouched
    finally:
        sandman.release(kept)
    down = sandman_cmd(cluster, "shutdown", pool)
    assert down.returncode == 0 and "shut down" in down.stdout
    assert pool not in sandman_cmd(cluster, "status").stdout


def start_watch(cluster, *args):
    """``sandman status --watch ARGS`` in the background: the process, and the list its
    output lines are gathered into as they come."""
    import threading
    exe = Path(sys.executable).with_name("sandman")
    watch = subprocess.Popen([str(exe), "--address", cluster["gcs"], "status", "--watch",
                              "--interval", "0.2"] + list(args),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout), daemon=True)
    reader.start()
    watch.reader = reader
    return watch, lines


def test_status_watch_follows_a_burst_and_ends_with_its_pool(cluster):
    """A person watching a paced burst sees it queue, get created and leased, live;
    the watch ends by itself when the pool is shut down."""
    from concurrent.futures import ThreadPoolExecutor
    pool = new_pool(create_rate_per_s=4.0, create_burst=1)
    watch, lines = start_watch(cluster, pool)
    try:
        def rows():
            """Each frame's row of the pool: {column: value} by the header's order."""
            names = ["pool", "requested", "creating", "ready", "leased", "returning",
                     "failed", "waiters", "creates/s", "leases/s", "pace/s"]
            return [dict(zip(names, line.split())) for line in list(lines)
                    if line.startswith(pool + " ")]

        wait_until(lambda: rows(), timeout=60, what="the watch's first frame")
        with ThreadPoolExecutor(4) as threads:
            handles = list(threads.map(
                lambda _: sandman.acquire("host", pool=pool, timeout=120), range(4)))
        wait_until(lambda: any(r["leased"] == "4" for r in rows()), timeout=30,
                   what="a frame with the burst's 4 leases")
        seen = rows()
        assert any(int(r["waiters"]) > 0 or int(r["requested"]) + int(r["creating"]) > 0
                   for r in seen), seen  # the burst queued for the pacer, visibly
        assert any(r["creates/s"] not in ("-", "0.0") for r in seen), seen
        assert all(float(r["pace/s"]) <= 4.0 for r in seen)
        for handle in handles:
            sandman.release(handle)
        assert any(line.split()[:3] == ["pool", "requested", "creating"] for line in lines)
    finally:
        sandman.shutdown_pool(pool)
    assert watch.wait(timeout=60) == 0, watch.stderr.read()
    watch.reader.join(timeout=10)
    assert lines[-1].strip() == "pool %s is gone" % pool


def test_status_watch_finds_a_pool_created_anew_under_its_name(cluster):
    """A pool shut down and created again (a re-run job) is a new actor: the watch of
    every pool shows it again, with its new actor, as JSON lines."""
    pool = new_pool()
    watch, lines = start_watch(cluster, "--json")

    def pids():
        return [s["pid"] for line in list(lines) for s in json.loads(line)["pools"]
                if s["pool"] == pool]
    try:
        wait_until(lambda: pids(), timeout=60, what="the pool in a frame")
        first = pids()[0]
        sandman.shutdown_pool(pool)
        sandman.create_pool(pool, provider=sandman.LocalProvider(state_root=STATE,
                                                                 cache_root=CACHE))
        wait_until(lambda: any(pid != first for pid in pids()), timeout=30,
                   what="the pool created anew in a frame")
    finally:
        watch.terminate()
        watch.wait(timeout=30)
        sandman.shutdown_pool(pool)
    refused = sandman_cmd(cluster, "status", "--count", "2")
    assert refused.returncode == 2 and "go with --watch" in refused.stderr


def test_sandman_refuses_clearly_and_starts_no_cluster(cluster):
    raylets = len(processes_matching("raylet"))
    proc = subprocess.run([str(Path(sys.executable).with_name("sandman")), "--address",
                           "127.0.0.1:%d" % free_port(), "status"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no Ray cluster at" in proc.stderr
    assert len(processes_matching("raylet")) == raylets
    missing = sandman_cmd(cluster, "status", "no-such-pool")
    assert missing.returncode == 2 and "no pool named 'no-such-pool'" in missing.stderr
    bad = sandman_cmd(cluster, "bench", "nonexistent")
    assert bad.returncode == 2 and "no benchmark 'nonexistent'" in bad.stderr


def test_sandman_names_a_refused_token_at_once(cluster):
    """This module's Ray uses token authentication (Ray's default for a cluster that
    ray.init starts, and for ``ray start``). A shell that names the cluster's address
    without RAY_AUTH_MODE=token sends Ray no token: the CLI says so, and what to set,
    instead of retrying for 20 s and reporting no cluster; with the variable set, the
    same command answers."""
    assert os.environ.get("RAY_AUTH_MODE") == "token", "this Ray runs without token authentication"
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    exe = str(Path(sys.executable).with_name("sandman"))
    refused = subprocess.run([exe, "--address", cluster["gcs"], "status"], env=env,
                             capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    assert refused.returncode == 2, refused.stderr
    assert "token authentication" in refused.stderr and "RAY_AUTH_MODE=token" in refused.stderr
    assert "no Ray cluster" not in refused.stderr
    admitted = subprocess.run([exe, "--address", cluster["gcs"], "status"],
                              env=dict(env, RAY_AUTH_MODE="token"), capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert admitted.returncode == 0, admitted.stderr
