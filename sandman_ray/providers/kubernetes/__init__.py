"""The KubernetesProvider: a pod per sandbox, through the Kubernetes API."""

from sandman_ray._lazy import exports

__getattr__, __dir__ = exports(__name__, {".provider": ("KubernetesProvider",)})
