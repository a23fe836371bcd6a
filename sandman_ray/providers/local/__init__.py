"""The LocalProvider: bubblewrap (or gVisor) sandboxes on every Ray node, started by a
node agent per pool and node. ``provider.py`` is the pool's side, ``agent.py`` the
agent actor, ``bwrap.py`` and ``gvisor.py`` one sandbox's launch (``chain.py`` its
command line and mounts), ``cgroups.py``, ``budgets.py`` and ``seccomp.py`` its limits,
the socket buffers cgroup v1 does not hold, and its filter."""

from sandman_ray._lazy import exports

__getattr__, __dir__ = exports(__name__, {".provider": ("LocalProvider", "leftovers")})
