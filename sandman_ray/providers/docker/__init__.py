"""The DockerProvider: sandboxes as containers of Docker or Podman on every Ray node.
``provider.py`` is the pool's side, ``agent.py`` the agent actor, ``engine.py`` the
engine's client and errors (no Ray: the janitor removes a dead agent's containers with
it), ``podman_service.py`` a Podman API service for tests and single machines."""

from sandman_ray._lazy import exports

__getattr__, __dir__ = exports(__name__, {".provider": ("DockerProvider",)})
