"""``sandman serve``, ``sandman keys`` and ``sandman tenants``: the service, and its
tenants and API keys on this machine's key store (``--keys FILE``, else
``tenants.default_path()``). ``keys`` and ``tenants`` need no Ray cluster: the store is
a file the server reads.

    sandman serve --pool NAME [--host 127.0.0.1] [--port 8470] [--data-port 8471]
                  [--tls-cert F --tls-key F] [--insecure] [--keys FILE]
                                                 serve POOL until Ctrl-C (or SIGTERM)
    sandman serve --pool NAME --stop             stop a service left running

    sandman keys create TENANT [--label TEXT]   a new key, printed once
    sandman keys list [--tenant TENANT] [--json] ids, tenants, labels, never a secret
    sandman keys revoke KEY_ID                   the key stops working at once
    sandman tenants set NAME [--weight W] [--max-sandboxes N] [--creates-per-s R]
    sandman tenants list [--json]
"""

import json
import time

from sandman_ray.service.tenants import KeyStore, default_path


def add_parsers(sub) -> None:
    serve = sub.add_parser("serve", help="serve POOL to clients outside Ray, until Ctrl-C")
    serve.add_argument("--pool", required=True)
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8470, help="the control plane's (0: any)")
    serve.add_argument("--data-port", type=int, default=8471, help="the data plane's (0: any)")
    serve.add_argument("--tls-cert")
    serve.add_argument("--tls-key")
    serve.add_argument("--insecure", action="store_true",
                       help="listen beyond loopback without TLS, and place leases on other "
                            "nodes (whose gateways listen on their nodes' addresses) without "
                            "it: keys cross in the clear")
    serve.add_argument("--keys", help="the key store (default: %s)" % default_path())
    serve.add_argument("--fusion-image", default="builtin:code",
                       help="the image SandboxFusion's /run_code runs programs in "
                            "(default: %(default)s: python, bash, C, C++)")
    serve.add_argument("--e2b-template", action="append", metavar="NAME=IMAGE",
                       help="an E2B template and the image its sandboxes run (again for "
                            "more; base is builtin:code unless given)")
    serve.add_argument("--stop", action="store_true", help="stop the service of POOL")
    serve.add_argument("--slow-after", type=int, default=5,
                       help="failed keys from one address a minute before each more one "
                            "waits, longer and longer, for its 401 (0: never)")
    keys = sub.add_parser("keys", help="the service's API keys (no cluster needed)")
    keys.add_argument("--keys", help="the key store (default: %s)" % default_path())
    verbs = keys.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("create", help="a new key of TENANT, printed once")
    p.add_argument("tenant")
    p.add_argument("--label", default="")
    p = verbs.add_parser("list", help="the keys, never their secrets")
    p.add_argument("--tenant")
    p.add_argument("--json", action="store_true")
    p = verbs.add_parser("revoke", help="revoke a key by its id (or the whole key)")
    p.add_argument("key_id")
    tenants = sub.add_parser("tenants", help="the service's tenants, their weights and "
                                             "limits (no cluster needed)")
    tenants.add_argument("--keys", help="the key store (default: %s)" % default_path())
    verbs = tenants.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("set", help="make a tenant, or change its weight or limits")
    p.add_argument("name")
    p.add_argument("--weight", type=float)
    p.add_argument("--max-sandboxes", type=int)
    p.add_argument("--creates-per-s", type=float)
    p = verbs.add_parser("list")
    p.add_argument("--json", action="store_true")


def cmd_serve(args) -> int:
    """Start the service of ``--pool`` (a detached actor on this node), print its
    URLs, and stop it at Ctrl-C or SIGTERM: its leases are given back."""
    import ipaddress
    import signal
    import threading
    from sandman_ray.service.host import start_service, stop_service
    if args.stop:
        args.connect()
        print("stopped; %d leases given back" % stop_service(args.pool))
        return 0
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("give --tls-cert and --tls-key together")
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback and not args.tls_cert and not args.insecure:
        raise ValueError("--host %s is reachable from other machines: give --tls-cert and "
                         "--tls-key, or --insecure to send API keys in the clear"
                         % args.host)
    for port in (args.port, args.data_port):
        if not 0 <= port <= 65535:
            raise ValueError("a port is 0 to 65535, got %d" % port)
    from sandman_ray.lookup import get_pool
    args.connect()  # the cluster, once the arguments are known to be good (cli.py)
    get_pool(args.pool)  # a pool that does not exist is said now, by name
    keys = str(args.keys or default_path())
    KeyStore(keys).close()  # made (root's alone) before the actor opens it
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    if args.slow_after < 0:
        raise ValueError("--slow-after is 0 or more, got %d" % args.slow_after)
    from sandman_ray.spec import parse_image
    parse_image(args.fusion_image)  # a bad reference is said now, by name
    templates = {}
    for given in args.e2b_template or ():
        name, sep, image = given.partition("=")
        if not sep or not name or not image:
            raise ValueError("--e2b-template is NAME=IMAGE, got %r" % given)
        parse_image(image)
        templates[name] = image
    _, urls = start_service(args.pool, keys, args.host, args.port, args.data_port, tls,
                            args.slow_after, args.fusion_image, args.insecure, templates)
    print(json.dumps(dict(urls, pool=args.pool)), flush=True)
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    done.wait()
    stop_service(args.pool)
    return 0


def cmd_keys(args) -> int:
    store = KeyStore(args.keys or default_path())
    try:
        if args.verb == "create":
            print(store.create_key(args.tenant, args.label))
            return 0
        if args.verb == "revoke":
            if not store.revoke(args.key_id):
                raise ValueError("no live key %r" % args.key_id)
            print("revoked")
            return 0
        keys = store.keys(args.tenant)
        if args.json:
            print(json.dumps(keys))
            return 0
        print("%-14s %-20s %-20s %-10s %s" % ("key id", "tenant", "made", "state", "label"))
        for key in keys:
            print("%-14s %-20s %-20s %-10s %s" % (
                key["key_id"], key["tenant"], _when(key["created"]),
                "revoked" if key["revoked"] else "live", key["label"]))
        return 0
    finally:
        store.close()


def cmd_tenants(args) -> int:
    store = KeyStore(args.keys or default_path())
    try:
        if args.verb == "set":
            print(json.dumps(store.set_tenant(args.name, args.weight, args.max_sandboxes,
                                              args.creates_per_s)))
            return 0
        rows = store.tenants()
        if args.json:
            print(json.dumps(rows))
            return 0
        print("%-20s %-8s %-14s %s" % ("tenant", "weight", "max sandboxes", "creates/s"))
        for t in rows:
            print("%-20s %-8g %-14s %s" % (t["name"], t["weight"],
                                           t["max_sandboxes"] or "-", t["creates_per_s"] or "-"))
        return 0
    finally:
        store.close()


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


COMMANDS = {"serve": cmd_serve, "keys": cmd_keys, "tenants": cmd_tenants}
