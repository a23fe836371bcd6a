"""A SIMULATED Kubernetes API server, for tests and benchmarks only.

No Kubernetes API server can run on the machines this project is developed and tested
on, so the KubernetesProvider is exercised against this simulation instead. It speaks
the real HTTP API for the part the provider uses (pods: create, get, list, delete and
watch, with label selectors and resourceVersions) and behaves like a busy cluster:

- an API rate limit (token bucket) shared by clients and the cluster's own components:
  client requests over it are answered 429 with ``Retry-After`` (as API Priority and
  Fairness does under overload), and turning one away still costs ``reject_cost`` of a
  request; the scheduler's bindings and the kubelets' status updates wait their turn,
  so a flood of client requests delays pods becoming Running;
- a scheduler that binds at most ``schedule_rate_per_s`` pods a second to nodes with
  room (else the pod stays Pending with ``PodScheduled=False, reason=Unschedulable``);
- a kubelet per node: the first pod of an image on a node waits ``pull_s`` for the pull
  (later pods of that image on that node do not), images listed in ``bad_images`` end
  in ``ErrImagePull`` / ``ImagePullBackOff``, nodes listed in ``stuck_nodes`` never start
  their containers, every container takes ``start_s`` to start;
- each running pod has its own loopback address (127.x.y.z) as pod IP, where its
  daemon listens: a real ``sandmand`` process per pod (``daemons="real"``, small
  scale: real commands, no isolation), or one in-process responder that answers the
  hello, ping and a trivial exec for every pod (``daemons="simulated"``, thousands of
  pods).

Simulation-only endpoints: ``GET /sim/stats`` (counters) and ``POST /sim/config``
(change parameters while it runs). Run it with ``python -m k8s_sim`` from ``tests/``.
"""

from k8s_sim.server import SimCluster, SimConfig, start_process  # noqa: F401
