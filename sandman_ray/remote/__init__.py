"""The service's client: sandboxes of a remote sandman service, with no Ray.

``pool.py``: ``connect(url, api_key)``, a pool whose ``acquire``/``sandbox`` give
sandboxes with the daemon client's methods; ``channel.py``: a lease's data-plane
connection through the service's gateway.
"""

from sandman_ray.remote.pool import RemotePool, RemoteSandbox, connect

__all__ = ["RemotePool", "RemoteSandbox", "connect"]
