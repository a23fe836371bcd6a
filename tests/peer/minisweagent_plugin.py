"""What mini-swe-agent's environment and agent tests need around them, loaded as a
pytest plugin (``-p minisweagent_plugin``) beside their own ``tests/conftest.py``: a
local Ray and a pool of ``builtin:debian`` for the session (its name in
``SANDMAN_PEER_POOL``, where tests/peer/sandman_local.py reads it), and each test's
environments closed after it (their tests make them and drop them)."""

import os

import pytest

from peer_pool import peer_pool  # tests/peer/, on the suite's PYTHONPATH


@pytest.fixture(scope="session", autouse=True)
def sandman_pool():
    with peer_pool("minisweagent", os.environ["SANDMAN_PEER_POOL"]) as name:
        yield name


@pytest.fixture(autouse=True)
def sandman_environments_closed(sandman_pool):
    import sandman_local
    yield
    while sandman_local.MADE:
        sandman_local.MADE.pop().close()
