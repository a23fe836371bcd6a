"""The image cache under a disk budget (sandman_ray/image_budget.py): least recently
used images evicted, never one a sandbox, a snapshot or a build uses; and a real
LocalProvider pool whose images together pass its budget."""

import json
import os

import pytest
import ray

import sandman_ray as sandman
from sandman_ray.images import ImageCache
from image_kit import BASE, entry, layer, oci
from conftest import local_ray, unique_pool, wait_until

MB = 1 << 20


def image(tmp_path, n, size=MB):
    """An OCI layout whose top layer holds ``size`` bytes of its own."""
    data = os.urandom(size)
    return oci(tmp_path / ("layout-%d" % n), [BASE, layer(entry("data/%d.bin" % n, data=data))])


def sizes(cache):
    return {e["key"]: e["bytes"] for e in cache.budget.entries()}


def test_the_least_recently_used_unused_image_is_evicted_and_comes_back(tmp_path):
    images = [image(tmp_path, n) for n in range(4)]
    cache = ImageCache(tmp_path / "cache", prefer_tools=False, budget_bytes=int(2.5 * MB))
    held = cache.prepare(images[0])  # a sandbox runs on it the whole time
    for name in images[1:]:
        cache.prepare(name).release()  # each used once, then its sandbox is gone
    status = cache.budget.status()
    assert status["bytes"] <= status["budget_bytes"] and status["evictions"] >= 1
    assert status["misses"] == 4 and status["hits"] == 0
    assert (held.rootfs / "data" / "0.bin").stat().st_size == MB  # in use: never evicted
    left = {json.loads((path.parent / "meta.json").read_text())["image"]
            for path in (tmp_path / "cache").glob("*/rootfs")}
    assert images[0] in left and images[3] in left and images[1] not in left
    again = cache.prepare(images[1])  # evicted: unpacked again, whole
    assert (again.rootfs / "data" / "1.bin").stat().st_size == MB
    assert cache.budget.status()["misses"] == 5
    assert not list((tmp_path / "cache").glob(".evicted-*"))  # nothing left half removed
    held.release()
    again.release()


def test_an_image_being_built_is_neither_counted_nor_evicted(tmp_path):
    """Its directory already has its meta.json just before it is renamed into place."""
    images = [image(tmp_path, n) for n in range(2)]
    cache = ImageCache(tmp_path / "cache", prefer_tools=False, budget_bytes=MB)
    building = tmp_path / "cache" / "sha256-abc.building"
    (building / "rootfs").mkdir(parents=True)
    (building / "meta.json").write_text(json.dumps({"image": "x", "bytes": 10 * MB,
                                                    "unpacked_by": "sandman"}))
    for name in images:
        cache.prepare(name).release()
    assert (building / "meta.json").exists()
    assert all("." not in e["key"] for e in cache.budget.entries())


def test_an_image_a_snapshot_was_taken_over_is_never_evicted(tmp_path):
    images = [image(tmp_path, n) for n in range(3)]
    cache = ImageCache(tmp_path / "cache", prefer_tools=False, budget_bytes=MB,
                       snapshots_root=tmp_path / "snaps")
    base = cache.prepare(images[0])  # a sandbox on it is snapshotted, then removed
    snap = tmp_path / "snaps" / "pool-a" / "snap-1"
    snap.mkdir(parents=True)
    (snap / "meta.json").write_text(json.dumps({"base": images[0],
                                                "base_rootfs": str(base.rootfs)}))
    base.release()
    for name in images[1:]:
        cache.prepare(name).release()
    assert (base.rootfs / "data" / "0.bin").exists()
    assert cache.budget.status()["evictions"] >= 1


def test_a_held_image_outlasts_an_eviction_asked_by_another_cache(tmp_path):
    """Two agents (two pools on a node) share one cache: one's sandbox holds an image
    the other's budget would evict."""
    images = [image(tmp_path, n) for n in range(3)]
    mine = ImageCache(tmp_path / "cache", prefer_tools=False, budget_bytes=MB)
    theirs = ImageCache(tmp_path / "cache", prefer_tools=False, budget_bytes=MB)
    held = mine.prepare(images[0])
    for name in images[1:]:
        theirs.prepare(name).release()
    assert (held.rootfs / "data" / "0.bin").stat().st_size == MB
    held.release()
    theirs.prepare(images[1]).release()  # now it may go
    assert not (held.rootfs / "data" / "0.bin").exists()


@pytest.fixture(scope="module")
def cluster():
    yield from local_ray()


def busybox_images(layouts, busybox_rootfs, count, size):
    """OCI layouts of the busybox rootfs (a shell and its tools) under a layer of
    ``size`` bytes of each one's own."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(busybox_rootfs, arcname=".")
    return [oci(layouts / ("layout-%d" % n), [buf.getvalue(), layer(
        entry("data", "dir", mode=0o755), entry("data/%d.bin" % n, data=os.urandom(size)))])
        for n in range(count)]


def test_a_budget_below_the_images_total_serves_every_create(cluster, tmp_path_factory,
                                                             busybox_rootfs):
    """A LocalProvider pool whose image cache holds 1.5 images of 4 MB: sandboxes of
    four images, one after another while the first stays leased, all start and run;
    the first's image stays under its sandbox, and the cache ends within its budget."""
    layouts = tmp_path_factory.mktemp("budget-images")
    images = busybox_images(layouts, busybox_rootfs, 4, 4 * MB)
    cache_root = str(tmp_path_factory.mktemp("budget-cache"))
    from sandman_ray.providers.local import LocalProvider
    provider = LocalProvider(state_root="/tmp/sandman-ray-test/budget", cache_root=cache_root,
                             image_cache_bytes=9 * MB, prefer_tools=False)
    pool = unique_pool(provider, "budget", reuse="delete")  # a released sandbox goes
    actor = sandman.get_pool(pool)

    def cache():
        status = ray.get(actor.status.remote(True))
        [cache] = status["image_cache"].values()
        return dict(cache, create_failures=status["stats"]["create_failures"])
    try:
        first = sandman.acquire(images[0], pool=pool, timeout=120)
        for name in images[1:]:
            with sandman.sandbox(name, pool=pool, timeout=120) as sb:
                assert sb.exec("ls /data").stdout.strip() != b""
        assert first.exec("wc -c < /data/0.bin").stdout.strip() == str(4 * MB).encode()
        assert cache()["evictions"] >= 1  # while the first's image stays under it
        sandman.release(first)
        # each image goes once its last sandbox is deleted
        ended = wait_until(lambda: (lambda c: c if c["bytes"] <= c["budget_bytes"] else None)(
            cache()), timeout=60, what="the cache back within its budget")
        assert ended["evictions"] >= 3 and ended["misses"] == 4
        assert ended["create_failures"] == 0
    finally:
        sandman.shutdown_pool(pool)


def test_prefetch_unpacks_images_on_the_nodes_ahead_of_their_sandboxes(cluster,
                                                                        tmp_path_factory,
                                                                        busybox_rootfs):
    layouts = tmp_path_factory.mktemp("prefetch-images")
    images = busybox_images(layouts, busybox_rootfs, 2, MB)
    from sandman_ray.providers.local import LocalProvider
    provider = LocalProvider(state_root="/tmp/sandman-ray-test/budget",
                             cache_root=str(tmp_path_factory.mktemp("prefetch-cache")),
                             prefer_tools=False)
    pool = unique_pool(provider, "prefetch")
    try:
        node = ray.get_runtime_context().get_node_id()
        missing = "oci:%s" % (layouts / "nothing")
        rows = sandman.prefetch(pool, images + [missing])
        assert [(r["image"], r["node_id"], r["ok"]) for r in rows] == \
            [(images[0], node, True), (images[1], node, True), (missing, node, False)]
        assert rows[0]["digest"].startswith("sha256:") and rows[1]["ready_s"] > 0
        assert "nothing" in rows[2]["error"]
        with sandman.sandbox(images[1], pool=pool, timeout=120) as sb:  # unpacked already
            assert sb.exec("ls /data").stdout == b"1.bin\n"
        [cache] = ray.get(sandman.get_pool(pool).status.remote(True))["image_cache"].values()
        assert (cache["misses"], cache["hits"], cache["entries"]) == (2, 1, 2)
        with pytest.raises(ValueError, match="no such node"):
            sandman.prefetch(pool, images, nodes=["f" * 56])
        with pytest.raises(ValueError, match="lists of images"):
            sandman.prefetch(pool, images[0])
    finally:
        sandman.shutdown_pool(pool)
