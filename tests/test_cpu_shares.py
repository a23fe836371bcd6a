"""providers/local/cpu_shares.py: a client over its share of a contended node weighs
the least until it is back under it; alone, or on an idle node, nobody is weighed
down. (The weights are written to a dict here; tests/test_service_ops.py and bench
``service`` see them on real cgroups.)"""

import asyncio

from sandman_ray.providers.local.cpu_shares import LEAST, CpuShares


def shares():
    written = {}
    cpu = CpuShares(lambda sid, w: written.__setitem__(sid, w), lambda sid: None, cpus=2)
    return cpu, written


def test_a_client_over_its_share_weighs_the_least_while_another_wants_cpu():
    async def run():
        cpu, written = shares()
        for sid in ("a1", "a2", "a3", "a4"):
            cpu.set(sid, "svc:a", 0.25)
        cpu.set("b1", "svc:b", 1.0)
        assert written == {"a1": 0.25, "a2": 0.25, "a3": 0.25, "a4": 0.25, "b1": 1.0}
        used = {sid: 0.0 for sid in written}
        cpu.step(used, 1.0)  # the first reading: no rate yet

        def second(a_each, b):
            for sid in ("a1", "a2", "a3", "a4"):
                used[sid] += a_each
            used["b1"] += b
            cpu.step(dict(used), 1.0)
        for _ in range(3):  # a floods (1.2 CPUs of 2), b wants 0.7: a is over its 1.0
            second(0.3, 0.7)
        assert cpu.over == {"svc:a"}
        assert [written[s] for s in ("a1", "a2", "a3", "a4", "b1")] == [LEAST] * 4 + [1.0]
        second(0.45, 0.0)  # b stops: while it still counts as wanting CPU, a stays down
        assert cpu.over == {"svc:a"}
        for _ in range(4):  # ... and once b's use has faded, a is weighed as the pool says
            second(0.45, 0.0)
        assert cpu.over == set() and written["a1"] == 0.25
        cpu.set("a1", None, 1.0)  # its lease ended: back at 1
        assert written["a1"] == 1.0 and "a1" not in cpu.weights
        for sid in ("a2", "a3", "a4", "b1"):
            cpu.forget(sid)
        await asyncio.sleep(0)
        return cpu
    cpu = asyncio.run(run())
    assert cpu.weights == {}


def test_an_idle_node_weighs_nobody_down():
    async def run():
        cpu, written = shares()
        cpu.set("a1", "svc:a", 1.0)
        cpu.set("b1", "svc:b", 1.0)
        used = {"a1": 0.0, "b1": 0.0}
        for _ in range(4):  # 0.4 and 0.1 CPUs of 2: not contended
            used = {"a1": used["a1"] + 0.4, "b1": used["b1"] + 0.1}
            cpu.step(dict(used), 1.0)
        assert cpu.over == set() and written == {"a1": 1.0, "b1": 1.0}
        cpu.forget("a1")
        cpu.forget("b1")
    asyncio.run(run())
