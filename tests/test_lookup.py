"""Pool handles that a long-lived driver cached turning stale: the pool shut down and
created anew by another process under the same name; every call looks it up once more.
On a real local Ray with the LocalProvider."""

import asyncio
import subprocess
import sys
import textwrap

import pytest

import sandman_ray as sandman
from sandman_ray.lookup import _pools
from conftest import ROOT, local_ray, unique_pool

STATE = "/tmp/sandman-ray-test/lookup-state"
CACHE = str(ROOT / ".cache" / "provider")


@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


def make_pool():
    return unique_pool(sandman.LocalProvider(state_root=STATE, cache_root=CACHE), "look")


RECREATE = textwrap.dedent("""
    import sys, ray, sandman_ray as sandman
    ray.init(address=sys.argv[1], log_to_driver=False)
    sandman.shutdown_pool(sys.argv[2])
    sandman.create_pool(sys.argv[2], provider=sandman.LocalProvider(
        state_root=sys.argv[3], cache_root=sys.argv[4]), warm={sys.argv[5]: 1})
""")


def test_a_pool_created_anew_by_another_process_is_found_again_by_every_call(cluster,
                                                                         busybox_image):
    """A long-lived driver caches its pool's actor; another process shuts the pool down
    and creates it anew under the same name. The driver's next calls meet the dead
    actor, look the pool up once more and work: acquire (sync and async), snapshots,
    set_warm and shutdown_pool."""
    image, name = busybox_image, make_pool()
    sandman.release(sandman.acquire(image, pool=name, timeout=60))
    old = sandman.get_pool(name)
    done = subprocess.run([sys.executable, "-c", RECREATE, cluster, name, STATE, CACHE, image],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    try:
        with sandman.sandbox(image, pool=name, timeout=60) as sb:
            assert sb.exec("echo again").stdout == b"again\n"
        assert sandman.get_pool(name)._actor_id != old._actor_id
        _pools[name] = old  # the dead actor once more, for the async path

        async def async_acquire():
            sb = await sandman.acquire_async(image, pool=name, timeout=60)
            out = (await sb.exec_async("echo async")).stdout
            await sandman.release_async(sb)
            return out
        assert asyncio.run(async_acquire()) == b"async\n"
        _pools[name] = old
        assert sandman.snapshots(name) == []
        _pools[name] = old
        assert sandman.set_warm(image, 2, pool=name)
        _pools[name] = old
    finally:
        assert sandman.shutdown_pool(name) >= 1
    with pytest.raises(sandman.SandmanError, match="no pool named"):
        sandman.get_pool(name)
