"""The fixtures SWE-ReX's ``tests/test_execution.py`` asks for (its repository's
``tests/conftest.py`` is not in its sdist), made of sandman: ``remote_runtime`` is a
``SandmanRuntime`` on a sandbox leased for the test (``builtin:debian``), from a pool on
a local Ray started for the run; ``runtime_with_default_session`` the same with its
default bash session open. ``_Action`` and ``_Command`` are SWE-ReX's request models
with the 5 s timeout its suite gives them.

tests/test_peer_swerex.py copies this file in as the suite's ``conftest.py`` and runs
the suite in a process of its own.
"""

import uuid
from typing import Optional

import pytest

import sandman_ray as sandman
from sandman_ray.integrations.swerex import SandmanRuntime
from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, Command
from swerex.runtime.abstract import CreateBashSessionRequest

from peer_pool import IMAGE, peer_pool  # tests/peer/, on the suite's PYTHONPATH


class _Action(BashAction):
    timeout: Optional[float] = 5


class _Command(Command):
    timeout: Optional[float] = 5


@pytest.fixture(scope="session")
def sandman_pool():
    with peer_pool("swerex", "peer-swerex-" + uuid.uuid4().hex[:6]) as name:
        yield name


@pytest.fixture
async def remote_runtime(sandman_pool):
    sandbox = await sandman.acquire_async(IMAGE, pool=sandman_pool, timeout=120)
    runtime = SandmanRuntime(sandbox)
    try:
        yield runtime
    finally:
        await runtime.close()
        await sandman.release_async(sandbox)


@pytest.fixture
async def runtime_with_default_session(remote_runtime):
    await remote_runtime.create_session(CreateBashSessionRequest())
    yield remote_runtime
    await remote_runtime.close_session(CloseBashSessionRequest())
