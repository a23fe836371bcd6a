"""The service's tenants and their API keys, kept in one sqlite file of the head node.

A key is ``sk_sandman_<key id>_<secret>``: the id (12 hex digits) names it in listings
and revocations, the secret (32 random bytes, URL-safe base64) is shown once, when the
key is made, and stored only as its SHA-256 (a 256-bit random secret needs no salt nor
slow hash: nothing is left to guess from the digest). A key is checked by its id's
digest with a constant-time compare, and an unknown id is compared against a digest of
nothing, so the time of an answer does not tell which ids exist.

The file and the directory it is made in are root's alone (0600 in a 0700 directory):
keys and tenants outlive the server and the pool. Each tenant has a weight (its share
of the pool's lending, 1 by default), and limits: the most sandboxes it may hold or
wait for at once, and creates per second (None: the pool's alone).
"""

import hashlib
import hmac
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from sandman_ray.spec import number_in

KEY_PREFIX = "sk_sandman_"
_KEY = re.compile(r"^sk_sandman_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_TENANT = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_NOTHING = hashlib.sha256(b"").digest()  # compared against when an id is unknown


def of_a_key_form(text: Optional[str]) -> bool:
    """Whether ``text`` has the form of an API key (it may still be no live one)."""
    return isinstance(text, str) and _KEY.fullmatch(text) is not None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY, weight REAL NOT NULL DEFAULT 1.0,
    max_sandboxes INTEGER, creates_per_s REAL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS keys (
    key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(name),
    digest BLOB NOT NULL, label TEXT NOT NULL DEFAULT '', created REAL NOT NULL,
    revoked REAL);
"""


def default_path() -> Path:
    """Where the service's tenants and keys live unless told: ``$SANDMAN_KEYS``, else
    /var/lib/sandman-ray/service/keys.db for root, ~/.local/state/... for a user."""
    if os.environ.get("SANDMAN_KEYS"):
        return Path(os.environ["SANDMAN_KEYS"])
    if os.geteuid() == 0:
        return Path("/var/lib/sandman-ray/service/keys.db")
    return Path.home() / ".local" / "state" / "sandman-ray" / "service" / "keys.db"


def check_tenant(name) -> str:
    """``name`` if it is a tenant's name: lower-case letters, digits, ``.``, ``_`` and
    ``-``, starting with a letter or digit, at most 63; else ValueError naming it."""
    if not isinstance(name, str) or not _TENANT.match(name):
        raise ValueError("a tenant's name is 1 to 63 of a-z, 0-9, '.', '_' and '-', "
                         "starting with a letter or digit; got %r" % (name,))
    return name


class KeyStore:
    """The tenants and keys of one service, in the sqlite file ``path`` (made, with
    its directory, where missing)."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.path.parent.stat().st_mode & 0o077:
            raise ValueError("the key store's directory %s may be read by others (mode %o): "
                             "make it 0700" % (self.path.parent,
                                               self.path.parent.stat().st_mode & 0o777))
        os.close(os.open(str(self.path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        os.chmod(self.path, 0o600)
        self.lock = threading.Lock()  # one connection, used from any thread
        self.db = sqlite3.connect(str(self.path), check_same_thread=False,
                                  isolation_level=None)
        with self.lock:
            self.db.executescript("PRAGMA journal_mode=WAL;" + _SCHEMA)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # ---- tenants
    def set_tenant(self, name: str, weight: Optional[float] = None,
                   max_sandboxes: Optional[int] = None,
                   creates_per_s: Optional[float] = None) -> Dict:
        """Make tenant ``name``, or change what is given of it; the tenant."""
        check_tenant(name)
        if weight is not None and not number_in(weight, 0, 1000, above=True):
            raise ValueError("a tenant's weight is a number above 0, at most 1000; got %r"
                             % (weight,))
        if max_sandboxes is not None and not number_in(max_sandboxes, 1, math.inf,
                                                       integer=True):
            raise ValueError("max_sandboxes is an int >= 1; got %r" % (max_sandboxes,))
        if creates_per_s is not None and not number_in(creates_per_s, 0, math.inf, above=True):
            raise ValueError("creates_per_s is a number above 0; got %r" % (creates_per_s,))
        with self.lock:
            self.db.execute("INSERT OR IGNORE INTO tenants (name, created) VALUES (?, ?)",
                            (name, time.time()))
            for column, value in (("weight", weight), ("max_sandboxes", max_sandboxes),
                                  ("creates_per_s", creates_per_s)):
                if value is not None:
                    self.db.execute("UPDATE tenants SET %s = ? WHERE name = ?" % column,
                                    (value, name))
        return self.tenant(name)

    def tenant(self, name: str) -> Optional[Dict]:
        with self.lock:
            row = self.db.execute("SELECT name, weight, max_sandboxes, creates_per_s, created "
                                  "FROM tenants WHERE name = ?", (name,)).fetchone()
        if row is None:
            return None
        return dict(zip(("name", "weight", "max_sandboxes", "creates_per_s", "created"), row))

    def tenants(self) -> List[Dict]:
        with self.lock:
            names = [r[0] for r in self.db.execute("SELECT name FROM tenants ORDER BY name")]
        return [self.tenant(name) for name in names]

    # ---- keys
    def create_key(self, tenant: str, label: str = "") -> str:
        """A new key of ``tenant`` (made if new): the whole key, which only this answer
        holds."""
        self.set_tenant(tenant)
        if not isinstance(label, str) or len(label) > 200:
            raise ValueError("a key's label is a string of at most 200 characters")
        secret = secrets.token_urlsafe(32)
        with self.lock:
            while True:
                key_id = secrets.token_hex(6)
                try:
                    self.db.execute("INSERT INTO keys (key_id, tenant, digest, label, created) "
                                    "VALUES (?, ?, ?, ?, ?)",
                                    (key_id, tenant, _digest(secret), label, time.time()))
                    break
                except sqlite3.IntegrityError:  # an id taken: another
                    continue
        return "%s%s_%s" % (KEY_PREFIX, key_id, secret)

    def verify(self, key) -> Optional[str]:
        """The tenant whose live key ``key`` is, or None (malformed, unknown, wrong or
        revoked: the same None, in about the same time)."""
        found = _KEY.fullmatch(key) if isinstance(key, str) else None
        key_id, secret = found.groups() if found else ("", "")
        with self.lock:
            row = self.db.execute("SELECT tenant, digest, revoked FROM keys WHERE key_id = ?",
                                  (key_id,)).fetchone()
        tenant, digest, revoked = row if row is not None else (None, _NOTHING, None)
        matches = hmac.compare_digest(_digest(secret), bytes(digest))
        return tenant if found and matches and row is not None and revoked is None else None

    def revoke(self, key_id: str) -> bool:
        """Revoke the key of id ``key_id`` (or the whole key); False if there is none
        live."""
        found = _KEY.fullmatch(key_id) if isinstance(key_id, str) else None
        key_id = found.group(1) if found else key_id
        with self.lock:
            done = self.db.execute("UPDATE keys SET revoked = ? WHERE key_id = ? AND "
                                   "revoked IS NULL", (time.time(), key_id))
        return done.rowcount == 1

    def keys(self, tenant: Optional[str] = None) -> List[Dict]:
        """The keys (of ``tenant``): id, tenant, label, when made and revoked; never a
        secret."""
        query = "SELECT key_id, tenant, label, created, revoked FROM keys"
        args = ()
        if tenant is not None:
            query, args = query + " WHERE tenant = ?", (tenant,)
        with self.lock:
            rows = self.db.execute(query + " ORDER BY created", args).fetchall()
        return [dict(zip(("key_id", "tenant", "label", "created", "revoked"), r)) for r in rows]


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
