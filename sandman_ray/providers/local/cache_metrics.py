"""A node's image cache as its pool's agent reports it, through ``ray.util.metrics``
(beside the pool's series of pool/metrics.py, as ``ray_sandman_image_cache_*``)."""

from typing import Dict

from ray.util import metrics


class ImageCacheMetrics:
    """A node's image cache as its pool's agent sees it (image_budget.py): bytes held
    and budget, and the agent's hits, misses and evictions so far (Ray labels each
    series with the node it comes from). Create it inside the agent."""

    NAMES = {"bytes": "Bytes the node's unpacked images hold (as last measured).",
             "budget_bytes": "The node's image cache budget.",
             "hits": "Creates whose image was unpacked already.",
             "misses": "Creates that unpacked their image.",
             "evictions": "Images evicted to keep the cache within its budget."}

    def __init__(self, pool: str):
        self.gauges = {}
        for name, doc in self.NAMES.items():
            gauge = metrics.Gauge("sandman_image_cache_" + name, doc, tag_keys=("pool",))
            gauge.set_default_tags({"pool": pool})
            self.gauges[name] = gauge

    def refresh(self, status: Dict[str, int]) -> None:
        for name, gauge in self.gauges.items():
            gauge.set(status[name])
