"""Images fetched and unpacked on nodes ahead of a burst (``sandman.prefetch``).

Each (image, node) pair is one call to the provider, paced like creates: it takes a
token of the pool's create bucket, and at most ``max_starting`` run at once, so that a
prefetch of 300 images never asks a shared cluster for more than a burst of creates
would. The answer says, per pair, when it was ready or why it was not.
"""

import asyncio
import time
from typing import Dict, List, Optional, Sequence

from sandman_ray.errors import NotSupported
from sandman_ray.spec import SandboxSpec


async def prefetch(pool, images: Sequence[str], nodes: Optional[Sequence[str]]) -> List[Dict]:
    """``images`` on ``nodes`` (None: every node the provider places sandboxes on) of
    the Reconciler ``pool``: one dict per pair, in order (image, node_id, ok,
    ready_s from the call, and the provider's answer or ``error``)."""
    if isinstance(images, str) or not all(isinstance(i, str) for i in images):
        raise ValueError("prefetch takes a list of image strings, got %r" % (images,))
    for image in images:
        SandboxSpec(image=image)  # a ValueError that names a malformed one, before any call
    placed = await pool.provider.nodes()
    if placed is None:
        raise NotSupported("%s does not place sandboxes on Ray nodes: nothing to prefetch "
                           "onto" % type(pool.provider).__name__)
    unknown = sorted(set(nodes or ()) - set(placed))
    if unknown:
        raise ValueError("prefetch: no such node of the pool's provider: %s (its nodes: %s)"
                         % (", ".join(unknown), ", ".join(placed)))
    gate = asyncio.Semaphore(pool.config.max_starting)
    start = time.monotonic()

    async def one(image: str, node: str) -> Dict:
        async with gate:
            while not pool.supply.bucket.take():
                await asyncio.sleep(pool.supply.bucket.wait_s())
            try:
                answer = await pool.provider.prefetch(image, node)
            except Exception as exc:  # noqa: BLE001 - said in its row; the others go on
                return {"image": image, "node_id": node, "ok": False,
                        "ready_s": time.monotonic() - start,
                        "error": "%s: %s" % (type(exc).__name__, exc)}
            return dict(answer, image=image, node_id=node, ok=True,
                        ready_s=time.monotonic() - start)
    return list(await asyncio.gather(*(one(image, node) for image in images
                                       for node in (nodes or placed))))
