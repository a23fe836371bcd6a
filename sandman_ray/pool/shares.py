"""The CPU of a node shared between the pool's clients, by their weights.

A sandbox is a CPU group of its own (providers/local/cgroups.py), so a contended node
is shared between sandboxes: a client holding eight leases would take eight times the
CPU of a client holding one, and one tenant of the service that floods its sandboxes
with commands would slow every other tenant's. So each leased sandbox weighs its
client's weight (1 by default; a service tenant's own) divided by how many sandboxes
that client holds on the node: every client's sandboxes on a node together weigh its
weight. The count is rounded up to a power of two, so that a client's sandboxes are
weighed again only when its count doubles or halves (each weighing is a write per
sandbox), not at every lease.
"""

import math
from collections import Counter
from typing import Dict, Iterable


def weights(clients: Iterable[str], by_client: Dict[str, Dict[str, object]],
            client_weight: Dict[str, float]) -> Dict[str, float]:
    """sandbox id -> its weight, for every leased sandbox of ``clients``
    (``by_client``: client -> {sandbox id: its record})."""
    out: Dict[str, float] = {}
    for client in clients:
        recs = by_client.get(client)
        if not recs:
            continue
        on_node = Counter(rec.node for rec in recs.values())
        weight = client_weight.get(client, 1.0)
        for sandbox_id, rec in recs.items():
            out[sandbox_id] = weight / 2 ** math.ceil(math.log2(on_node[rec.node]))
    return out
