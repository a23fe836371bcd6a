"""Many task images in one burst (the images section of bench/run_all.py, with
bench/images.py): ``count`` OCI images that share one base layer of ``base_mb`` and
differ in a small top layer, and ``n`` acquires over them (each image in turn) from
``clients`` client processes at once on a cold pool with a cache of its own: the time
to 50 % and 100 % usable, the disk the node's image cache holds after it, against the
sum of the distinct layers; then the same burst under a budget below the images'
total, which must still complete, end within its budget and fail no create.
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import ray

import sandman_ray as sandman
from sandman_ray.providers.local import LocalProvider

from burst import clients_burst, summary
from common import STATE, wait_for

LAYOUTS = Path("/tmp/sandman-bench-images")
MANY_CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time, ray, sandman_ray as sandman
    ray.init(address=sys.argv[1], namespace="sandman-bench", log_to_driver=False)
    pool, index, clients = sys.argv[2].split("|")
    images, n = json.loads(sys.argv[3]), int(sys.argv[4])
    sandman.prepare(pool)
    print("go", flush=True)
    start = float(sys.stdin.readline())
    async def one(k):
        h = await sandman.acquire_async(images[k % len(images)], pool=pool, timeout=3600)
        assert (await h.exec_async("true")).exit_code == 0
        return time.time(), h
    async def main():
        while time.time() < start:
            await asyncio.sleep(0.001)
        mine = range(int(index), int(index) + n * int(clients), int(clients))
        return await asyncio.gather(*[one(k) for k in mine])
    results = asyncio.run(main())
    print("usable " + json.dumps([[t, h.sandbox] for t, h in results]), flush=True)
    sys.stdin.readline()
    for _, h in results:
        sandman.release(h)
""")


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tar(files: Dict[str, bytes], tree: Optional[Path] = None) -> bytes:
    """A layer of ``tree`` (a rootfs, if given) and ``files``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if tree is not None:
            tar.add(str(tree), arcname=".")
        for name in sorted({os.path.dirname(n) for n in files} - {""}):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_images(count: int, base_mb: int) -> List[str]:
    """``count`` OCI layouts (kept under LAYOUTS between runs) sharing one base layer:
    the benches' busybox rootfs (a shell and its tools) and ``base_mb`` MB in 100 KB
    files, its blob hard-linked into each."""
    from local import busybox_rootfs
    root = LAYOUTS / ("busybox-%d-%d" % (count, base_mb))
    images = ["oci:%s:v1" % (root / ("image-%03d" % i)) for i in range(count)]
    if (root / "done").exists():
        return images
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    files = {}
    for i in range(base_mb * 10):
        files["usr/share/base/%03d/%05d.bin" % (i // 1000, i)] = os.urandom(100 * 1024)
    base_raw = _tar(files, busybox_rootfs())
    base_blob = gzip.compress(base_raw, compresslevel=1)
    (root / "base.blob").write_bytes(base_blob)
    for i in range(count):
        top_raw = _tar({"task/%03d.txt" % i: b"task %d\n" % i})
        top_blob = gzip.compress(top_raw, compresslevel=1)
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                             "rootfs": {"type": "layers", "diff_ids": [
                                 _digest(base_raw), _digest(top_raw)]}}).encode()
        where = root / ("image-%03d" % i)
        blobs = where / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        os.link(root / "base.blob", blobs / _digest(base_blob)[7:])
        for data in (top_blob, config):
            (blobs / _digest(data)[7:]).write_bytes(data)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": _digest(b), "size": len(b)} for b in (base_blob, top_blob)]
        }).encode()
        (blobs / _digest(manifest)[7:]).write_bytes(manifest)
        (where / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (where / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": _digest(manifest), "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))
    (root / "done").touch()
    return images


def one_burst(images: List[str], n: int, clients: int,
              budget: Optional[int] = None) -> dict:
    """``n`` acquires over ``images`` on a new cold pool whose nodes' image cache is new
    (and holds ``budget`` bytes at most, if given); the cache's state after the burst's
    sandboxes are gone."""
    cache_root = Path("/tmp/sandman-bench-cache-%s" % uuid.uuid4().hex[:6])
    provider = LocalProvider(state_root=STATE, cache_root=str(cache_root),
                             image_cache_bytes=budget)
    pool = "bench-images-%s" % uuid.uuid4().hex[:6]
    sandman.create_pool(pool, provider=provider, max_sandboxes=n + 8)
    actor = sandman.get_pool(pool)
    try:
        address = ray.get_runtime_context().gcs_address
        targets = ["%s|%d|%d" % (pool, i, clients) for i in range(clients)]
        start, usable = clients_burst(MANY_CLIENT, address, targets, json.dumps(images), n,
                                      clients)
        out = summary(start, usable)
        # released, then deleted as surplus once they lingered (nothing asks for them):
        # the cache as its images' last sandboxes left it
        wait_for(lambda: not any(v for k, v in ray.get(actor.status.remote())["states"].items()
                                 if k != "gone"), "the burst's sandboxes gone")
        status = ray.get(actor.status.remote(True))
        [cache] = status["image_cache"].values()
        out.update(cache=cache, create_failures=status["stats"]["create_failures"])
        return out
    finally:
        sandman.shutdown_pool(pool)
        shutil.rmtree(cache_root, ignore_errors=True)


def many_images(count: int = 100, n: int = 500, clients: int = 4,
                base_mb: int = 200) -> dict:
    started = time.monotonic()
    images = make_images(count, base_mb)
    made_s = time.monotonic() - started
    whole = one_burst(images, n, clients)
    per_image = whole["cache"]["bytes"] / max(1, whole["cache"]["entries"])
    budget = int(0.4 * whole["cache"]["bytes"])
    budgeted = one_burst(images, n, clients, budget)
    return {"images": count, "n": n, "clients": clients, "base_mb": base_mb,
            "made_s": made_s, "whole": whole, "budgeted": budgeted,
            "budget_bytes": budget, "bytes_per_image": per_image}


def rows(part: dict) -> List[tuple]:
    out = []
    for kind, name in (("whole", "whole images"), ("budgeted", "whole images, budget 40 %")):
        r = part[kind]
        out.append(("images", "%d acquires over %d images (base %d MB), %s: 50 %% / 100 %% "
                    "usable" % (part["n"], part["images"], part["base_mb"], name),
                    "%.1f s / %.1f s" % (r["usable_50_s"], r["usable_100_s"]),
                    "cache after: %.2f GB in %d images%s, %d evictions, %d create failures" % (
                        r["cache"]["bytes"] / 1e9, r["cache"]["entries"],
                        " (budget %.2f GB)" % (part["budget_bytes"] / 1e9)
                        if kind == "budgeted" else "", r["cache"]["evictions"],
                        r["create_failures"])))
    return out
