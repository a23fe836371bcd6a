"""The service's client: sandboxes of a remote sandman service, with no Ray.

``channel.py``: a lease's data-plane connection through the service's gateway.
"""
