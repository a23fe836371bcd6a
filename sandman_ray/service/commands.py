"""``sandman keys`` and ``sandman tenants``: the service's tenants and API keys, on this
machine's key store (``--keys FILE``, else ``tenants.default_path()``). They need no Ray
cluster: the store is a file the server reads.

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


COMMANDS = {"keys": cmd_keys, "tenants": cmd_tenants}
