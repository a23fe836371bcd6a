"""The names by which the pool, the providers, the handle hosts and the service find
each other's Ray actors, and under which the Ray dashboard shows their calls: one
module that every side imports."""

NAMESPACE = "sandman"  # the Ray namespace of every actor of sandman's
HOST_PREFIX = "sandman:sbx:"  # the names of handle hosts


def pool_actor_name(pool: str) -> str:
    return "sandman:pool:%s" % pool


def pool_task_name(op: str, pool: str) -> str:
    """The name of a pool's ``op`` calls on the Ray dashboard: ``sandman:<op>:<pool>``.
    Never a sandbox id: Ray counts the tasks a process submits by name (its ``ray_tasks``
    metric) and keeps every name's series for the life of the process, so a name per
    sandbox would grow the submitter's memory with every sandbox it ever made."""
    return "sandman:%s:%s" % (op, pool)
