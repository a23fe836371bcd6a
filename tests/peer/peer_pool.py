"""The local Ray and the pool of ``builtin:debian`` a peer's suite runs on, in the
process that runs it (its cache in ``SANDMAN_PEER_CACHE``; tests/peer/ is on the
suite's PYTHONPATH)."""

import contextlib
import os

import ray

import sandman_ray as sandman
from sandman_ray.providers.local import LocalProvider

IMAGE = "builtin:debian"


@contextlib.contextmanager
def peer_pool(peer: str, name: str):
    """Ray in namespace ``sandman-peer-<peer>`` and pool ``name`` with two warm
    sandboxes, both gone at the end."""
    ray.init(num_cpus=2, include_dashboard=False, namespace="sandman-peer-" + peer,
             log_to_driver=False)
    sandman.create_pool(name, provider=LocalProvider(
        state_root="/tmp/sandman-ray-test/peer-" + peer,
        cache_root=os.environ["SANDMAN_PEER_CACHE"]), warm={IMAGE: 2})
    try:
        yield name
    finally:
        sandman.shutdown_pool(name)
        ray.shutdown()
