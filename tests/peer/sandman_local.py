"""mini-swe-agent's ``LocalEnvironment`` and its config as its own tests make them, made
of sandman: each is a ``SandmanEnvironment`` on a sandbox leased from the pool that
``SANDMAN_PEER_POOL`` names (tests/peer/minisweagent_plugin.py makes it). Their tests
import these two names from here instead of ``minisweagent.environments.local``: the one
line tests/test_peer_minisweagent.py changes in each file."""

import os
from typing import List

from sandman_ray.integrations.minisweagent import SandmanEnvironment, SandmanEnvironmentConfig

MADE: List[SandmanEnvironment] = []  # the environments of the running test


class LocalEnvironmentConfig(SandmanEnvironmentConfig):
    pool: str = os.environ.get("SANDMAN_PEER_POOL", "default")


class LocalEnvironment(SandmanEnvironment):
    def __init__(self, *, config_class: type = LocalEnvironmentConfig, **kwargs):
        super().__init__(config_class=config_class, **kwargs)
        MADE.append(self)
