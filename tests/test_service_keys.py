"""The service's key store (sandman_ray/service/tenants.py): keys made, checked and
revoked; kept hashed on disk, root's alone; surviving a new store on the same file (a
restarted server) and a second process's writes; tenant names and limits checked."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sandman_ray.service import tenants
from sandman_ray.service.tenants import KeyStore


@pytest.fixture
def store(tmp_path):
    store = KeyStore(tmp_path / "service" / "keys.db")
    yield store
    store.close()


def test_a_key_is_its_tenants_until_revoked_and_nothing_else_passes(store):
    key = store.create_key("alice", label="trainer")
    other = store.create_key("bob")
    assert key.startswith("sk_sandman_") and store.verify(key) == "alice"
    assert store.verify(other) == "bob"
    key_id = key.split("_")[2]
    wrong_secret = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for bad in (wrong_secret, key + "x", key[:-1], "", None, 42, b"bytes", "sk_sandman_",
                other.replace(other.split("_")[2], key_id),  # bob's secret under alice's id
                "Bearer " + key):
        assert store.verify(bad) is None, bad
    assert store.revoke(key_id) is True
    assert store.verify(key) is None and store.verify(other) == "bob"
    assert store.revoke(key_id) is False  # revoked already
    assert store.revoke(other) is True  # the whole key names it too
    assert store.verify(other) is None


def test_keys_are_stored_hashed_in_a_file_only_root_reads(store):
    key = store.create_key("alice")
    secret = key[len("sk_sandman_") + 13:]  # after the id (the secret may hold "_" too)
    store.close()
    raw = b"".join(p.read_bytes() for p in store.path.parent.iterdir())  # with the WAL
    assert secret.encode() not in raw and key.encode() not in raw
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.path.parent).st_mode) == 0o700
    listed = KeyStore(store.path).keys()
    assert [k["tenant"] for k in listed] == ["alice"] and "digest" not in listed[0]
    assert all(secret not in str(v) for v in listed[0].values())


def test_keys_and_tenants_survive_a_new_store_and_another_process(tmp_path):
    """A restarted server opens the same file: its keys and tenants are there; a key
    made or revoked by another process (``sandman keys``) counts at once."""
    path = tmp_path / "keys.db"
    first = KeyStore(path)
    key = first.create_key("alice")
    first.set_tenant("alice", weight=3, max_sandboxes=8, creates_per_s=2.5)
    first.close()
    again = KeyStore(path)
    assert again.verify(key) == "alice"
    assert again.tenant("alice")["weight"] == 3 and again.tenant("alice")["max_sandboxes"] == 8
    made = subprocess.run([sys.executable, "-c", (
        "import sys; from sandman_ray.service.tenants import KeyStore; "
        "s = KeyStore(sys.argv[1]); s.revoke(sys.argv[2]); print(s.create_key('bob'))"),
        str(path), key], capture_output=True, text=True, check=True).stdout.strip()
    assert again.verify(key) is None and again.verify(made) == "bob"
    again.close()


def test_a_store_refuses_a_directory_others_may_read(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match="may be read by others"):
        KeyStore(shared / "keys.db")
    assert not (shared / "keys.db").exists()


@pytest.mark.parametrize("name", ["", "Alice", "-a", "a b", "a/b", "a" * 64, None, 7, "é"])
def test_tenant_names_are_checked(store, name):
    with pytest.raises(ValueError, match="a tenant's name"):
        store.create_key(name)


@pytest.mark.parametrize("field,value", [("weight", 0), ("weight", -1), ("weight", True),
                                         ("max_sandboxes", 0), ("max_sandboxes", 1.5),
                                         ("creates_per_s", 0), ("creates_per_s", "1")])
def test_tenant_limits_are_checked_naming_them(store, field, value):
    with pytest.raises(ValueError, match=field):
        store.set_tenant("alice", **{field: value})
    assert store.tenant("alice") is None


def test_keys_are_compared_in_constant_time_and_unknown_ids_too():
    """A timing test would measure only noise here: the compare is the standard
    library's constant-time one, made for an unknown id as for a known one."""
    source = Path(tenants.__file__).read_text()
    assert "hmac.compare_digest(_digest(secret), bytes(digest))" in source
    assert [line for line in source.splitlines()
            if "digest" in line and ("==" in line or "!=" in line)] == []


def test_the_cli_makes_lists_and_revokes_keys_without_a_cluster(tmp_path):
    """``sandman keys`` and ``sandman tenants`` work on the store alone (no Ray); a
    listing never shows a secret; a bad name or an unknown key is one line, status 2."""
    store = str(tmp_path / "svc" / "keys.db")

    def sandman(*args):
        return subprocess.run([sys.executable, "-m", "sandman_ray.cli", "keys", "--keys", store]
                              + list(args), capture_output=True, text=True, timeout=60)
    made = sandman("create", "alice", "--label", "ci")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    listed = sandman("list", "--json")
    assert key[len("sk_sandman_") + 13:] not in listed.stdout
    import json
    [row] = json.loads(listed.stdout)
    assert (row["tenant"], row["label"], row["revoked"]) == ("alice", "ci", None)
    assert sandman("revoke", row["key_id"]).returncode == 0
    assert KeyStore(store).verify(key) is None
    again = sandman("revoke", row["key_id"])
    assert again.returncode == 2 and "no live key" in again.stderr
    bad = sandman("create", "Not A Name")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tenant's name" in bad.stderr
    assert "ray" not in subprocess.run(
        [sys.executable, "-c", "import sys, sandman_ray.cli; sandman_ray.cli.parser(); "
         "print(' '.join(m for m in sys.modules if m.split('.')[0] == 'ray'))"],
        capture_output=True, text=True, check=True).stdout.split()
