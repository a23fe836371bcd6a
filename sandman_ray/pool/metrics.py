"""The pool's and handles' metrics, through ``ray.util.metrics`` (Ray exports them to
Prometheus as ``ray_sandman_*`` on each node's metrics port).

Tags are bounded: pool, state, op, reason *class* and failure kind come from small
fixed sets; clients are reported for the ``TOP_CLIENTS`` biggest holders and the rest
as ``other``. A sandbox id is never a tag.
"""

import re
import time
from typing import Dict, Optional

from ray.util import metrics

TOP_CLIENTS = 20
# Seconds: from a few ms (a warm lease, a reset) to minutes (an image pull).
LATENCY_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                      10, 30, 60, 120, 300]
# What a delete's free-text reason is counted as (first match wins).
REASON_CLASSES = (
    ("released", r"^released"), ("surplus", r"^surplus"), ("shutdown", r"^pool shutdown"),
    ("create_failed", r"^create failed"), ("reset_failed", r"^reset failed"),
    ("host_gone", r"^host .* is gone"), ("no_host", r"^no host within"),
    ("ttl", r"ttl|TTL"), ("idle", r"idle"), ("stray", r"stray|no record"), ("gc", r"^gc:"),
    ("node_lost", r"^lost: Ray node"),
)
REFRESH_S = 1.0  # gauges are set at most this often (Ray exports every few seconds)


def reason_class(reason: str) -> str:
    for name, pattern in REASON_CLASSES:
        if re.search(pattern, reason or ""):
            return name
    return "other"


class PoolMetrics:
    """One pool's series. Create it inside the PoolActor (metrics are per process)."""

    def __init__(self, pool: str):
        self.pool = pool
        tags = {"pool": pool}
        self.sandboxes = metrics.Gauge(
            "sandman_sandboxes", "Sandboxes of the pool by state.", tag_keys=("pool", "state"))
        self.waiters = metrics.Gauge(
            "sandman_waiters", "Acquires waiting for a sandbox.", tag_keys=("pool",))
        self.creates = metrics.Counter(
            "sandman_creates", "Sandboxes created and answering.", tag_keys=("pool",))
        self.create_failures = metrics.Counter(
            "sandman_create_failures", "Provider create errors by kind (throttled, "
            "transient, fatal).", tag_keys=("pool", "kind"))
        self.deletes = metrics.Counter(
            "sandman_deletes", "Sandboxes deleted, by reason.", tag_keys=("pool", "reason"))
        self.resets = metrics.Counter(
            "sandman_resets", "Released sandboxes reset for reuse.", tag_keys=("pool",))
        self.throttled = metrics.Counter(
            "sandman_throttle_events", "Times the provider said 'later' (429, quota).",
            tag_keys=("pool",))
        self.create_rate = metrics.Gauge(
            "sandman_create_rate_per_s", "The create token bucket's current rate.",
            tag_keys=("pool",))
        self.leases = metrics.Gauge(
            "sandman_leases", "Sandboxes held per client (biggest holders; the rest as "
            "'other').", tag_keys=("pool", "client"))
        self.time_to_ready = metrics.Histogram(
            "sandman_time_to_ready_seconds", "From create request to a daemon that answers.",
            boundaries=LATENCY_BOUNDARIES, tag_keys=("pool",))
        self.acquire_wait = metrics.Histogram(
            "sandman_acquire_wait_seconds", "From lease request to a lent sandbox.",
            boundaries=LATENCY_BOUNDARIES, tag_keys=("pool",))
        for metric in (self.sandboxes, self.waiters, self.creates, self.create_failures,
                       self.deletes, self.resets, self.throttled, self.create_rate,
                       self.leases, self.time_to_ready, self.acquire_wait):
            metric.set_default_tags(tags)
        self.reported_clients: set = set()
        self.refreshed = 0.0

    def due(self) -> bool:
        """Whether the gauges are ``REFRESH_S`` old (the pool counts its records only
        then, not on every tick)."""
        return time.monotonic() - self.refreshed >= REFRESH_S

    def refresh(self, states: Dict[str, int], waiters: int, rate: float,
                per_client: Dict[str, int]) -> None:
        """Set the gauges."""
        self.refreshed = time.monotonic()
        for state, count in states.items():
            self.sandboxes.set(count, tags={"state": state})
        self.waiters.set(waiters)
        self.create_rate.set(rate)
        top = sorted(per_client.items(), key=lambda kv: -kv[1])
        shown = dict(top[:TOP_CLIENTS])
        if len(top) > TOP_CLIENTS:
            shown["other"] = sum(n for _, n in top[TOP_CLIENTS:])
        for client in self.reported_clients - set(shown):
            self.leases.set(0, tags={"client": client})  # it holds nothing now
        for client, count in shown.items():
            self.leases.set(count, tags={"client": client})
        self.reported_clients = set(shown)

    def created(self, seconds: float) -> None:
        self.creates.inc()
        self.time_to_ready.observe(seconds)

    def create_failed(self, kind: str) -> None:
        self.create_failures.inc(tags={"kind": kind})
        if kind == "throttled":
            self.throttled.inc()

    def reset_done(self) -> None:
        self.resets.inc()

    def deleted(self, reason: str) -> None:
        self.deletes.inc(tags={"reason": reason_class(reason)})

    def lent(self, wait_s: float) -> None:
        self.acquire_wait.observe(wait_s)


_exec_latency: Optional[metrics.Histogram] = None


def handle_call_latency():
    """The handles' histogram of daemon calls (tags pool, op), made once per process."""
    global _exec_latency
    if _exec_latency is None:
        _exec_latency = metrics.Histogram(
            "sandman_handle_call_seconds", "Daemon calls through sandbox handles "
            "(exec, run, files ...), by op.", boundaries=LATENCY_BOUNDARIES,
            tag_keys=("pool", "op"))
    return _exec_latency

