"""``SwerexEnvironment``: mini-swe-agent's SWE-ReX environment for any SWE-ReX deployment,
sandman's among them.

mini-swe-agent's ``swerex_docker`` and ``swerex_modal`` environments each build one kind
of deployment. This one builds the deployment its config names, as SWE-ReX's
deployment configs serialize (``sandman_ray.integrations.swerex.deployment_config``)::

    environment:
      environment_class: sandman_ray.integrations.swerex_env.SwerexEnvironment
      deployment: {type: sandman, image: builtin:debian, pool: default}
      cwd: /testbed
      timeout: 60

and otherwise answers as mini-swe-agent's ``SwerexDockerEnvironment`` does (it is one:
each action is a ``runtime.execute`` through SWE-ReX, stderr merged, in ``cwd``). The
deployment starts when the environment is made and stops on ``close()``
(``cleanup()``).
"""

import asyncio
from typing import Any, Dict

from sandman_ray.integrations import require_python

require_python("swerex_env", "mini-swe-agent 2.4 and SWE-ReX 1.4", (3, 10))

from sandman_ray.integrations.swerex import deployment_config  # noqa: E402

try:
    from minisweagent.environments.extra.swerex_docker import SwerexDockerEnvironment
    from pydantic import BaseModel, ConfigDict
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sandman_ray.integrations.swerex_env needs mini-swe-agent (pip install "
                      "mini-swe-agent==2.4.6); importing it failed: %s" % exc) from exc

__all__ = ["SwerexEnvironment", "SwerexEnvironmentConfig"]


class SwerexEnvironmentConfig(BaseModel):
    """What ``SwerexEnvironment`` takes (mini-swe-agent's ``environment`` section,
    without ``environment_class``). Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    deployment: Dict[str, Any]
    """A SWE-ReX deployment config as a dict: ``{"type": "sandman", ...}`` (see
    ``SandmanDeploymentConfig``) or any of SWE-ReX's own."""
    cwd: str = "/"
    """Where actions run unless an execute names a ``cwd``."""
    timeout: int = 30
    """Seconds an action may run unless an execute gives a ``timeout``."""


class SwerexEnvironment(SwerexDockerEnvironment):
    """mini-swe-agent's SWE-ReX environment on the deployment its config names."""

    def __init__(self, **kwargs: Any):
        self.config = SwerexEnvironmentConfig(**kwargs)
        self.deployment = deployment_config(self.config.deployment).get_deployment()
        asyncio.run(self.deployment.start())

    def close(self) -> None:
        """Stop the deployment (a sandman sandbox goes back to its pool)."""
        asyncio.run(self.deployment.stop())

    cleanup = close  # the name mini-swe-agent's container environments use

    def __enter__(self) -> "SwerexEnvironment":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
