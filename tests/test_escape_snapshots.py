"""The escape suite, snapshots: what a hostile sandbox leaves in its writable layer
for a snapshot to copy (links out, FIFOs, setuid files, entries without data, depth),
and archives passed between nodes. The copy follows nothing, blocks on nothing, and
charges every entry against the pool's budget and the store's room. The sandboxes are
real (``escape_kit.py``)."""

import os
import shutil
import stat
import subprocess
import tempfile
import uuid

import pytest

from conftest import Sandbox
from escape_kit import sh
from escape_kit import provider  # noqa: F401 - a fixture: pytest finds it by name


def test_a_snapshot_copies_what_a_sandbox_left_without_following_it(provider):
    """A hostile sandbox leaves, for its snapshot to copy: a link to the host's
    /etc/shadow, a link out of the layer, a FIFO, a setuid copy of a shell. The copy
    follows nothing (links stay links, read in a fork they resolve in the fork's own
    root), blocks on nothing, and what it wrote on the host's disk only host root may
    reach."""
    from conftest import run
    shadow = open("/etc/shadow", "rb").read()
    with Sandbox(provider, "builtin:debian") as sb:
        out = sh(sb, "ln -s /etc/shadow /root/shadow && ln -s ../../../../../../ /root/up && "
                     "mkfifo /root/fifo && cp /bin/dash /root/suid && chmod 4755 /root/suid && "
                     "echo left")
        assert "left" in out
        name = "hostile-%s" % uuid.uuid4().hex[:6]
        snap = run(provider.snapshot(sb.id, name))
    layer = os.path.join(provider.snapshot_root, sb.info.node_id[:16], provider.pool, name,
                         "layer")
    assert os.readlink(os.path.join(layer, "root", "shadow")) == "/etc/shadow"
    assert stat.S_ISFIFO(os.lstat(os.path.join(layer, "root", "fifo")).st_mode)
    suid = os.path.join(layer, "root", "suid")
    assert os.stat(suid).st_mode & stat.S_ISUID and os.stat(suid).st_uid == 0
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                        "stat", suid], capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    with Sandbox(provider, snap.image) as fork:
        seen = fork.client.exec(["cat", "/root/shadow"]).stdout
        assert seen and seen != shadow  # the image's own shadow file, not the host's
        assert sh(fork, "ls /root/up/ | grep -c sandman-ray || true").strip() == "0"
        # run by a user other than root inside, the setuid copy is not root (nosuid)
        assert sh(fork, "setpriv --reuid 1000 --regid 1000 --clear-groups /root/suid -c "
                        "'id -u'").strip() == "1000"
    assert open("/etc/shadow", "rb").read() == shadow


def test_a_snapshot_costs_what_the_layer_holds_and_stops_at_its_budget(provider):
    """A sparse terabyte and hard links cost a snapshot what they hold on the
    sandbox's tmpfs, not what they claim; a layer past the pool's snapshot budget, or
    deeper than the copy walks, is refused, and nothing of it is left."""
    from conftest import run
    from sandman_ray.errors import ProviderError
    from sandman_ray.providers.local import LocalProvider
    with Sandbox(provider, "builtin:debian") as sb:
        sh(sb, "truncate -s 1T /root/sparse && head -c 4000000 /dev/urandom > /root/a && "
               "ln /root/a /root/b")
        snap = run(provider.snapshot(sb.id, "sparse-%s" % uuid.uuid4().hex[:6]))
    assert 4_000_000 <= snap.size_bytes < 5_000_000, snap
    with Sandbox(provider, snap.image) as fork:
        assert sh(fork, "stat -c '%s %h' /root/sparse /root/b") == "1099511627776 1\n4000000 2\n"
    small = LocalProvider(state_root=provider.state_root, cache_root=provider.cache_root,
                          snapshot_bytes=1_000_000).bind("budget-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(small, "builtin:debian") as sb:
            sh(sb, "head -c 3000000 /dev/urandom > /root/big")
            with pytest.raises(ProviderError, match="more than 1000000 bytes"):
                run(small.snapshot(sb.id, "too-big"))
            sh(sb, "rm /root/big; mkdir -p /root/$(yes d | head -300 | tr '\\n' /)")
            with pytest.raises(ProviderError, match="deeper than 256"):
                run(small.snapshot(sb.id, "too-deep"))
            assert run(small.snapshots()) == []
            store = os.path.join(small.snapshot_root, sb.info.node_id[:16], small.pool)
            assert os.listdir(store) == []
    finally:
        run(small.shutdown())


def test_a_file_swapped_for_a_fifo_under_the_copy_is_refused_not_waited_on(tmp_path):
    """The copy opens a file it found regular without blocking and checks it is still
    that file: a FIFO put in its place (a sandbox that was not frozen) fails the
    snapshot at once instead of hanging the agent's thread."""
    from sandman_ray.errors import ProviderError
    from sandman_ray.providers.local.snapshots import Copy, _copy_file
    (tmp_path / "src").mkdir()
    (tmp_path / "dst").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    looked = os.stat(tmp_path / "src" / "f")
    os.unlink(tmp_path / "src" / "f")
    os.mkfifo(tmp_path / "src" / "f")
    s_dir, d_dir = (os.open(tmp_path / d, os.O_RDONLY | os.O_DIRECTORY) for d in ("src", "dst"))
    try:
        with pytest.raises(ProviderError, match="changed while it was copied"):
            _copy_file("f", s_dir, d_dir, looked, (0, 0), Copy(None))
    finally:
        os.close(s_dir)
        os.close(d_dir)


def test_the_snapshot_store_honours_no_setuid_bit_and_no_device(local_provider):
    """A snapshot keeps its files' bits, setuid-root copies of a tenant's included: the
    store is on a mount that honours neither setuid bits nor device nodes (the agent
    binds it so where its filesystem is not, as this disk's /tmp is not)."""
    from conftest import LOCAL_CACHE, LOCAL_STATE, run
    from sandman_ray.providers.local import LocalProvider
    root = tempfile.mkdtemp(prefix="sandman-store-", dir="/var/tmp")
    assert not os.statvfs(root).f_flag & os.ST_NOSUID  # the disk honours them
    p = LocalProvider(state_root=LOCAL_STATE, cache_root=LOCAL_CACHE,
                      snapshot_root=root).bind("store-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(p, "builtin:debian"):
            flags = os.statvfs(root).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV
    finally:
        run(p.shutdown())
        subprocess.run(["umount", root])
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("target", ["absolute", "relative", "layer/later"])
def test_a_snapshot_archive_may_link_only_to_its_own_files(tmp_path, target):
    """Archives pass between the pool's own agents; one crafted all the same may not
    make a hard link on the host to a host file, nor to a name it has not put there
    itself (yet), and nothing of it is left. The host file is the test's own 0600
    file: a link that got through would also take the member's mode and time, which
    the test sees (and no real file of the host pays for it)."""
    import io
    import tarfile
    from sandman_ray.providers.local.snapshots import SnapshotStore
    secret = tmp_path / "host" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"hunter2")
    secret.chmod(0o600)
    before = os.stat(secret)
    # a hard link's name is read from the directory the archive is unpacked in
    target = {"absolute": str(secret), "relative": "../../../host/secret"}.get(target, target)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("meta.json", b"{}"), ("layer/own", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        good = tarfile.TarInfo("layer/same")
        good.type, good.linkname = tarfile.LNKTYPE, "layer/own"
        tar.addfile(good)
        bad = tarfile.TarInfo("layer/stolen")
        bad.type, bad.linkname = tarfile.LNKTYPE, target
        tar.addfile(bad)
        later = tarfile.TarInfo("layer/later")
        later.size = 1
        tar.addfile(later, io.BytesIO(b"y"))
    store = SnapshotStore(tmp_path / "store", "pool")
    with pytest.raises(ValueError, match="'layer/stolen' links to .* not a file of the"):
        store.import_tar("crafted", buf.getvalue())
    assert not store.path("crafted").exists() and os.listdir(tmp_path / "store" / "pool") == []
    after = os.stat(secret)
    assert (after.st_mode, after.st_mtime_ns, after.st_nlink) == \
        (before.st_mode, before.st_mtime_ns, 1)
    honest = io.BytesIO()  # the same archive without the stolen link: a link of its own
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as src, \
            tarfile.open(fileobj=honest, mode="w") as tar:
        for member in src.getmembers():
            if member.name != "layer/stolen":
                tar.addfile(member, src.extractfile(member) if member.isreg() else None)
    store.import_tar("honest", honest.getvalue())
    layer = store.path("honest") / "layer"
    assert os.stat(layer / "same").st_ino == os.stat(layer / "own").st_ino


def test_a_layer_of_links_and_names_is_charged_for_every_entry(provider):
    """Links, directories and empty files hold no file data but take the store's
    memory and inodes: 20,000 symbolic links of 200 bytes (a page each on a tmpfs)
    are charged as what they take, so a pool's budget stops their second copy, and
    the first one's size says what it holds."""
    from conftest import run
    from sandman_ray.errors import ProviderError
    from sandman_ray.providers.local import LocalProvider
    small = LocalProvider(state_root=provider.state_root, cache_root=provider.cache_root,
                          snapshot_bytes=150_000_000).bind("links-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(small, "builtin:debian") as sb:
            sh(sb, "mkdir /root/l && perl -e 'symlink(\"x\" x 200, \"/root/l/$_\") or die "
                   "for 1..20000; mkdir \"/root/d$_\" or die for 1..2000'")
            first = run(small.snapshot(sb.id, "links"))
            assert first.size_bytes >= 20_000 * 4096 + 22_000 * 512  # pages, and entries
            with pytest.raises(ProviderError, match="more than [0-9]+ bytes"):
                run(small.snapshot(sb.id, "again"))
            assert [s.name for s in run(small.snapshots())] == ["links"]
        with Sandbox(small, first.image) as fork:
            assert sh(fork, "ls /root/l | wc -l; readlink /root/l/7 | wc -c") == "20000\n201\n"
    finally:
        run(small.shutdown())


def test_a_snapshot_stops_at_the_inodes_its_store_has_left(provider):
    """A store whose filesystem counts inodes (a tmpfs of 3,000) keeps a tenth of them:
    a layer of 5,000 empty files is refused, saying so, and nothing of it stays."""
    from conftest import run
    from sandman_ray.errors import ProviderError
    from sandman_ray.providers.local import LocalProvider
    root = tempfile.mkdtemp(prefix="sandman-inodes-", dir="/var/tmp")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,nr_inodes=3000,size=64m",
                    "sandman-inodes", root], check=True)
    small = LocalProvider(state_root=provider.state_root, cache_root=provider.cache_root,
                          snapshot_root=root).bind("inodes-%s" % uuid.uuid4().hex[:6])
    try:
        with Sandbox(small, "builtin:debian") as sb:
            sh(sb, "mkdir /root/f && perl -e 'open(F, \">/root/f/$_\") or die for 1..5000'")
            with pytest.raises(ProviderError, match="more than [0-9]+ entries"):
                run(small.snapshot(sb.id, "many"))
            assert run(small.snapshots()) == []
            store = os.path.join(root, sb.info.node_id[:16], small.pool)
            assert os.listdir(store) == []
            sh(sb, "rm -r /root/f")
            assert run(small.snapshot(sb.id, "few")).size_bytes > 0  # the store works
    finally:
        run(small.shutdown())
        subprocess.run(["umount", "-l", root])
        shutil.rmtree(root, ignore_errors=True)


def _tree(top, depth, wide):
    """``depth`` nested directories below ``top`` with a file at the bottom, and
    ``wide`` empty files beside the first; the number of entries."""
    where = top
    for _ in range(depth):
        where = os.path.join(where, "d")
        os.mkdir(where)
    open(os.path.join(where, "f"), "w").close()
    for i in range(wide):
        open(os.path.join(top, "w%d" % i), "w").close()
    return depth + 1 + wide


def test_the_copy_is_linear_in_entries_however_deep_and_stops_at_its_bounds(tmp_path,
                                                                            monkeypatch):
    """A chain of 240 directories costs the copy as many opens as 240 files side by
    side, not one walk from the root per level (the layer's depth made it quadratic);
    the entries and the time a copy may take are bounded."""
    from sandman_ray.errors import ProviderError
    from sandman_ray.providers.local import snapshots
    opens = []
    real_open = os.open

    def counted(*args, **kwargs):
        opens.append(args[0])
        return real_open(*args, **kwargs)

    def copy(depth, wide, **bounds):
        src, dst = tmp_path / ("s-%d-%d" % (depth, wide)), tmp_path / ("d-%d-%d" % (depth, wide))
        src.mkdir()
        dst.mkdir()
        entries = _tree(str(src), depth, wide)
        s_fd, d_fd = (os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in (src, dst))
        del opens[:]
        monkeypatch.setattr(os, "open", counted)
        try:
            snapshots.copy_layer(s_fd, d_fd, 0, **bounds)
        finally:
            monkeypatch.setattr(os, "open", real_open)
            os.close(s_fd)
            os.close(d_fd)
        return entries, len(opens)

    deep_entries, deep_opens = copy(240, 0)
    wide_entries, wide_opens = copy(0, 240)
    assert deep_entries == wide_entries == 241
    assert deep_opens <= 2 * deep_entries and wide_opens <= 2 * wide_entries, \
        (deep_opens, wide_opens)
    with pytest.raises(ProviderError, match="more than 100 entries"):
        copy(10, 200, entries=100)
    with pytest.raises(ProviderError, match="took more than 0 s"):
        copy(3, 3, seconds=0.0)
