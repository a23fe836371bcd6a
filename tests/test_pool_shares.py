"""pool/shares.py: each client's leased sandboxes on a node together weigh its weight,
the count rounded up to a power of two."""

from types import SimpleNamespace

from sandman_ray.pool.shares import weights


def recs(*nodes):
    return {"s%d" % i: SimpleNamespace(node=node) for i, node in enumerate(nodes)}


def test_a_clients_sandboxes_on_a_node_together_weigh_its_weight():
    by_client = {"a": recs("n1", "n1", "n1", "n1"), "b": recs("n1"),
                 "c": recs("n1", "n1", "n1", "n2"), "heavy": recs("n1", "n1")}
    assert weights(["a"], by_client, {}) == {"s%d" % i: 0.25 for i in range(4)}
    assert weights(["b"], by_client, {}) == {"s0": 1.0}
    # three on n1 count as four (a power of two), the one on n2 alone
    assert weights(["c"], by_client, {}) == {"s0": 0.25, "s1": 0.25, "s2": 0.25, "s3": 1.0}
    assert weights(["heavy"], by_client, {"heavy": 3.0}) == {"s0": 1.5, "s1": 1.5}
    assert weights(["gone"], by_client, {}) == {}
