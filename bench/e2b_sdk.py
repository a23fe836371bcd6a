"""E2B's SDK against the service beside sandman's own client, in one run.

``commands.run("true")`` of E2B's SDK (``e2b`` from PyPI, pointed at ``sandman serve``
by its environment variables; each call a Connect stream through envd's routes, which
spawn the command in the sandbox and follow it to its end) beside ``exec("true")`` of
sandman's client through the service's data plane, on sandboxes of the same image and
pool, in interleaved batches. Issue 50's target: E2B's p50 <= 1.5x ours. The SDK runs
every command as ``/bin/bash -l -c <cmd>``, a login shell whose profile (Debian's
/etc/profile runs ``id`` in a subshell) costs more than ``true`` itself; the same
command line by sandman's exec is measured beside, the floor of any E2B server; and the
SDK itself against a server that answers every Start at once (``stub_envd``).

    python bench/e2b_sdk.py [--batches 40] [--per 25]     (or make bench: its service section)
"""

import argparse
import os
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandman_ray.service.e2b.sandboxes import USER_SPEC  # noqa: E402
from sandman_ray.spec import SandboxSpec  # noqa: E402
from common import interleaved, pct, run_alone, states, wait_for  # noqa: E402

IMAGE = "builtin:code"  # E2B's base template
# what the SDK's commands.run(cmd) asks envd to start: a login shell running cmd
LOGIN_TRUE = ["/bin/bash", "-l", "-c", "true"]


def stub_envd():
    """A server, on a thread of its own, that answers every envd Start at once with a
    command that ended (start, end): the SDK's own floor, with no server work behind
    it. Its URL, and a stop."""
    import asyncio
    import threading
    from aiohttp import web
    from sandman_ray.service.e2b import connect as rpc
    body = (rpc.envelope({"event": {"start": {"pid": 7}}}) +
            rpc.envelope({"event": {"end": {"exited": True, "exitCode": 0,
                                            "status": "exit status 0"}}}) +
            rpc.end_of_stream())

    async def start(request):
        await request.read()
        return web.Response(body=body, headers={"Content-Type": rpc.STREAM_JSON})
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    where = {}

    async def serve():
        app = web.Application()
        app.router.add_post("/process.Process/Start", start)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        where["url"] = "http://127.0.0.1:%d" % runner.addresses[0][1]
        where["runner"] = runner
        ready.set()
    threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()),
                     daemon=True).start()
    ready.wait(30)

    def stop():
        asyncio.run_coroutine_threadsafe(where["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
    return where["url"], stop


def stubbed_sandbox(url: str):
    """An e2b Sandbox object whose envd is ``url`` (no create: the stub has no control
    plane)."""
    import e2b
    from e2b.connection_config import ConnectionConfig
    from packaging.version import Version
    from sandman_ray.service.e2b.sandboxes import ENVD_VERSION
    config = ConnectionConfig(sandbox_url=url, api_key="stub", extra_sandbox_headers={
        "E2b-Sandbox-Id": "stub", "X-Access-Token": "stub"})
    return e2b.Sandbox(sandbox_id="stub", envd_version=Version(ENVD_VERSION),
                       envd_access_token="stub", sandbox_domain=None, connection_config=config)


def e2b_beside_ours(batches: int = 40, per: int = 25) -> dict:
    import service
    from sandman_ray.remote import connect
    with service.served({IMAGE: 2}, 8) as (pool, urls, keys):
        wait_for(lambda: states(pool)["ready"] >= 2, "2 warm sandboxes")
        os.environ.update({"E2B_API_URL": urls["url"], "E2B_SANDBOX_URL": urls["url"],
                           "E2B_API_KEY": keys[0], "E2B_HTTP_VERSION": "1.1"})
        import e2b
        sandbox = e2b.Sandbox.create(timeout=600)
        # a sandbox as E2B's base template makes them (its user, its home)
        ours = connect(urls["url"], keys[0]).acquire(SandboxSpec(image=IMAGE, **USER_SPEC),
                                                     timeout=120)
        try:
            def e2b_run():
                if sandbox.commands.run("true").exit_code != 0:
                    raise RuntimeError("e2b: true failed")
            stub_url, stop_stub = stub_envd()
            stub = stubbed_sandbox(stub_url)
            times = interleaved({"e2b": e2b_run, "sandman": lambda: ours.exec("true"),
                                 "sandman_login_shell": lambda: ours.exec(LOGIN_TRUE),
                                 "e2b_sdk_floor": lambda: stub.commands.run("true")},
                                batches, per)
            stop_stub()
        finally:
            sandbox.kill()
            ours.release()
    out = {name: {"p50_ms": pct(t, 0.5) * 1e3, "p99_ms": pct(t, 0.99) * 1e3, "n": len(t)}
           for name, t in times.items()}
    out["e2b_over_sandman_p50"] = out["e2b"]["p50_ms"] / out["sandman"]["p50_ms"]
    out["e2b_over_login_shell_p50"] = (out["e2b"]["p50_ms"] /
                                       out["sandman_login_shell"]["p50_ms"])
    return out


def rows(s: dict) -> List[tuple]:
    e, ours = s["e2b"], s["sandman"]
    login = s["sandman_login_shell"]
    return [("e2b", "E2B SDK commands.run('true') via the service: p50 / p99",
             "%.2f / %.2f ms" % (e["p50_ms"], e["p99_ms"]),
             "%.2fx sandman's exec('true') %.2f ms (target <= 1.5x)"
             % (s["e2b_over_sandman_p50"], ours["p50_ms"])),
            ("e2b", "  the SDK's command line, bash -l -c true, by sandman's exec",
             "%.2f / %.2f ms" % (login["p50_ms"], login["p99_ms"]),
             "E2B's %.2fx it: the service's E2B path" % s["e2b_over_login_shell_p50"])] + (
        [("e2b", "  the SDK alone: commands.run against a server that answers at once",
          "%.2f / %.2f ms" % (s["e2b_sdk_floor"]["p50_ms"], s["e2b_sdk_floor"]["p99_ms"]),
          "its share of E2B's p50: %.0f%%" % (100 * s["e2b_sdk_floor"]["p50_ms"] / e["p50_ms"]))]
        if "e2b_sdk_floor" in s else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--per", type=int, default=25)
    args = parser.parse_args()
    return run_alone(lambda: e2b_beside_ours(args.batches, args.per), rows, "e2b")


if __name__ == "__main__":
    sys.exit(main())
