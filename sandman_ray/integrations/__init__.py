"""Integrations with the frameworks RL users already run, each imported on its own so
that no framework is needed for another:

- ``gym``: a gymnasium env, used by RLlib's EnvRunners;
- ``verl``: a verl tool (a subclass of verl's ``BaseTool`` when verl is installed);
- ``skyrl``: a SkyRL-gym ``BaseTextEnv``, registered as ``sandman-bash``;
- ``minisweagent``: an environment class for mini-swe-agent;
- ``swerex``: a SWE-ReX deployment and runtime.

What they share (which sandbox a config means, a task's working directory, how much
output a model sees) is in ``sandboxes``.

``pip install 'sandman-ray[integrations]'`` installs the framework versions tested, on
the Pythons each supports (the extra's markers say which); importing an integration on
another Python says so by name (``require_python``)."""

import sys
from typing import Optional, Tuple


def require_python(integration: str, framework: str, minimum: Tuple[int, int],
                   below: Optional[Tuple[int, int]] = None) -> None:
    """ImportError, naming the Pythons ``framework`` supports, when this Python is not
    one of them (the framework's own import would fail, or install nothing, with a
    message that does not say why)."""
    here = sys.version_info[:2]
    if here >= minimum and (below is None or here < below):
        return
    wanted = "%d.%d or newer" % minimum if below is None else \
        "%d.%d up to %d.%d" % (minimum + (below[0], below[1] - 1))
    raise ImportError("sandman_ray.integrations.%s needs Python %s, as %s does; this is "
                      "Python %d.%d" % (integration, wanted, framework, here[0], here[1]))
