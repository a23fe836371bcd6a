"""sandman as a network service: one fleet for clients outside the pool's Ray cluster.

``tenants.py``: the tenants and their API keys, on the head node's disk.
``relay.py``: the data plane: a tenant's upgraded connection relayed to its lease's
daemon, the lease's token kept in the gateway.
"""
