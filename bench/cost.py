"""The cost section of bench/run_all.py: memory (PSS) per idle sandbox and per handle
host actor, and CPU per create."""

import asyncio
import os
import time
import uuid
from typing import List

import ray

import sandman_ray as sandman
from sandman_ray import AsyncDaemonClient
from sandman_ray.spec import SandboxSpec

from common import cpu_ticks, provider
from local import pss_kb

def cost(image: str, count: int = 20) -> dict:
    p = provider().bind("bench-cost-" + uuid.uuid4().hex[:6])
    spec = SandboxSpec(image=image)

    async def run():
        await p.create("cost-warmup", spec, {})  # the agent, bundle and image first
        await asyncio.sleep(1.0)
        idle = cpu_ticks()
        await asyncio.sleep(2.0)
        idle_per_s = (cpu_ticks() - idle) / 2.0
        start, t = cpu_ticks(), time.monotonic()
        infos = await asyncio.gather(*(p.create("cost-%d" % i, spec, {}) for i in range(count)))
        for info in infos:
            client = await AsyncDaemonClient.connect(info.address, info.token)
            await client.ping()
            client.close()
        busy = cpu_ticks() - start - idle_per_s * (time.monotonic() - t)
        await asyncio.sleep(1.0)  # start-up settles before idle memory is read
        pss = [pss_kb(info.details["pid"]) for info in infos]
        return busy / os.sysconf("SC_CLK_TCK") / count, sum(pss) / len(pss)
    pool = "bench-cost-pool-" + uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider(), warm={image: 1})
    try:
        cpu_s, sandbox_kb = asyncio.run(run())
        sb = sandman.acquire(image, pool=pool, timeout=120)
        host_pid = ray.get(sb._host.__ray_call__.remote(lambda self: os.getpid()))
        host_kb = pss_kb(host_pid)
        sandman.release(sb)
    finally:
        sandman.shutdown_pool(pool)
        asyncio.run(p.shutdown())
    return {"cpu_ms_per_create": cpu_s * 1e3, "pss_mb_per_idle_sandbox": sandbox_kb / 1024,
            "pss_mb_per_handle_host": host_kb / 1024}


def rows(c: dict) -> List[tuple]:
    return [("cost", "PSS per idle sandbox (daemon + bwrap)",
             "%.1f MB" % c["pss_mb_per_idle_sandbox"], ""),
            ("cost", "PSS per handle host actor (one per client process and node)",
             "%.1f MB" % c["pss_mb_per_handle_host"], ""),
            ("cost", "CPU per create (whole machine, idle subtracted)",
             "%.1f ms" % c["cpu_ms_per_create"], "")]
