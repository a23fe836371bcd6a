"""File operations and tar streams through a real daemon process."""

import io
import os
import tarfile

import pytest

from sandman_ray import DaemonError


def test_write_then_read_with_parents_mode_offset_and_length(client, tmp_path):
    path = str(tmp_path / "a" / "b" / "f.bin")
    data = bytes(range(256)) * 100
    assert client.write_file(path, data, mode=0o600) == len(data)
    assert client.read_file(path) == data
    assert client.read_file(path, offset=10, length=5) == data[10:15]
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_write_replaces_atomically_and_appends(client, tmp_path):
    path = str(tmp_path / "f.txt")
    client.write_file(path, b"old")
    client.write_file(path, "new text")
    assert client.read_file(path) == b"new text"
    client.write_file(path, b"+more", append=True)
    assert client.read_file(path) == b"new text+more"
    assert sorted(os.listdir(tmp_path)) == ["f.txt"]  # no temporary left behind


def test_large_file_round_trip_crosses_several_frames(client, tmp_path):
    path = str(tmp_path / "big")
    data = os.urandom(1 << 20) * 40   # 40 MiB: more than one read reply
    with open(path, "wb") as fh:
        fh.write(data)
    assert client.read_file(path) == data


def test_stat_list_mkdir_move_remove(client, tmp_path):
    root = str(tmp_path)
    client.mkdir(root + "/d/e")
    client.write_file(root + "/d/f", b"12345")
    os.symlink("f", root + "/d/link")
    st = client.stat(root + "/d/f")
    assert (st.type, st.size, st.name) == ("file", 5, "f")
    assert client.stat(root + "/d/link").target == "f"
    assert client.stat(root + "/d/link", follow_symlinks=True).type == "file"
    names = [(e.name, e.type) for e in client.list_dir(root + "/d")]
    assert names == [("e", "dir"), ("f", "file"), ("link", "symlink")]
    client.move(root + "/d/f", root + "/d/e/g")
    assert client.read_file(root + "/d/e/g") == b"12345"
    with pytest.raises(DaemonError) as err:
        client.remove(root + "/d")
    assert err.value.type == "OSError" and err.value.errno == "ENOTEMPTY"
    client.remove(root + "/d", recursive=True)
    assert not os.path.exists(root + "/d")
    client.remove(root + "/d", missing_ok=True)


def test_missing_paths_and_bad_paths_get_clear_errors(client):
    with pytest.raises(DaemonError) as err:
        client.read_file("/no/such/file")
    assert err.value.type == "FileNotFoundError" and err.value.errno == "ENOENT"
    with pytest.raises(DaemonError, match="non-empty path"):
        client.stat("")
    with pytest.raises(DaemonError, match="NUL"):
        client.stat("/tmp/a\0b")
    with pytest.raises(DaemonError, match="'path' must be str"):
        client._call("stat", {"path": 5})
    with pytest.raises(DaemonError, match="must not be negative"):
        client.read_file("/etc/hostname", offset=-1)
    with pytest.raises(DaemonError) as err:
        client.move("/tmp", "/tmp", overwrite=False)
    assert err.value.type == "FileExistsError"


def test_directory_round_trips_as_a_tar_stream(client, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "x.txt").write_bytes(b"x" * 3000000)
    (src / "y").write_text("y")
    os.symlink("y", src / "ylink")
    tar = client.get_archive(str(src))
    names = sorted(tarfile.open(fileobj=io.BytesIO(tar)).getnames())
    assert names == [".", "./sub", "./sub/x.txt", "./y", "./ylink"]
    assert client.put_archive(str(tmp_path / "dst"), tar) == 5
    assert (tmp_path / "dst" / "sub" / "x.txt").read_bytes() == b"x" * 3000000
    assert os.readlink(tmp_path / "dst" / "ylink") == "y"


def _tar(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.mark.parametrize("name, kind, link", [
    ("../escape.txt", tarfile.REGTYPE, ""),
    ("/abs.txt", tarfile.REGTYPE, ""),
    ("evil-link", tarfile.SYMTYPE, "/etc/passwd"),
    ("evil-link", tarfile.SYMTYPE, "../../outside"),
    ("dev", tarfile.CHRTYPE, ""),
])
def test_archive_members_may_not_escape_the_target(client, tmp_path, name, kind, link):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    data = b"bad" if kind == tarfile.REGTYPE else None
    info.size = len(data) if data else 0
    with pytest.raises(DaemonError) as err:
        client.put_archive(str(tmp_path / "target"), _tar([(info, data)]))
    assert err.value.type == "UnsafeArchive"
    assert not (tmp_path / "escape.txt").exists()


def _answers_meanwhile(daemon, call):
    """Run ``call`` on a thread while another connection's ``exec true`` is timed: the
    call's outcome (result or exception) and the slowest exec."""
    import threading
    import time
    outcome, slowest = {}, [0.0]

    def run():
        try:
            outcome["result"] = call()
        except Exception as exc:  # the outcome under test
            outcome["error"] = exc
    thread = threading.Thread(target=run)
    with daemon.client() as other:
        thread.start()
        while thread.is_alive():
            started = time.perf_counter()
            assert other.exec("true").exit_code == 0
            slowest[0] = max(slowest[0], time.perf_counter() - started)
        thread.join()
    return outcome, slowest[0]


@pytest.mark.parametrize("what", ["read_file", "append", "put_archive"])
def test_a_fifo_or_a_device_is_refused_not_waited_on(daemon, client, tmp_path, what):
    """A FIFO (no one at its other end) held the daemon's only thread: an exec with
    timeout=1 went unanswered for 9 s. Now a FIFO or a device is opened without
    blocking and refused at once, naming what it is, and other calls are answered
    meanwhile in milliseconds."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("fifo")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    calls = {"read_file": lambda: client.read_file(fifo),
             "append": lambda: client.write_file(fifo, b"x", append=True),
             "put_archive": lambda: client.put_archive(str(tmp_path), buf.getvalue())}
    outcome, slowest = _answers_meanwhile(daemon, calls[what])
    error = outcome.get("error")
    assert isinstance(error, DaemonError) and error.type == "NotARegularFile", outcome
    assert "fifo" in error.message and slowest < 1.0
    with pytest.raises(DaemonError, match="NotARegularFile: /dev/zero is a char"):
        client.read_file("/dev/zero")


def test_a_sparse_file_of_ten_gigabytes_gets_a_bounded_answer(daemon, client, tmp_path):
    """Read whole, it is refused at its first chunk (more than max_bytes); read in
    parts, each part comes back while another connection's calls are answered."""
    from sandman_ray import ResultTooLarge
    sparse = str(tmp_path / "sparse")
    with open(sparse, "wb") as fh:
        fh.truncate(10 * 2 ** 30)
    outcome, _ = _answers_meanwhile(daemon, lambda: client.read_file(sparse))
    assert isinstance(outcome.get("error"), ResultTooLarge), outcome
    part = lambda: client.read_file(sparse, offset=5 * 2 ** 30, length=32 * 2 ** 20)  # noqa: E731
    outcome, slowest = _answers_meanwhile(daemon, part)
    assert outcome["result"] == b"\0" * (32 * 2 ** 20) and slowest < 1.0, slowest


def test_watch_dir_tells_what_befalls_a_directory_and_its_new_subdirectories(daemon, tmp_path):
    import queue
    import threading
    root = tmp_path / "watched"
    root.mkdir()
    with daemon.client() as watching, daemon.client() as client:
        heard = queue.Queue()
        stream = watching.watch_dir(str(root), recursive=True)
        threading.Thread(target=lambda: [heard.put(e) for e in stream], daemon=True).start()
        seen = []

        def until(event, touch=None):
            """Events until ``event``, calling ``touch`` while none comes (the watch is
            in place once one has come)."""
            while event not in seen:
                try:
                    seen.append(heard.get(timeout=0.2))
                except queue.Empty:
                    if touch is None:
                        raise AssertionError("no %r among %r" % (event, seen))
                    touch()
        until(("chmod", b"probe"), lambda: os.utime(root / "probe") if
              (root / "probe").exists() else (root / "probe").write_text(""))
        client.write_file(str(root / "a.txt"), b"one")  # written beside, renamed into place
        client.mkdir(str(root / "sub"))
        until(("create", b"sub"))
        until(("create", b"a.txt"))
        client.write_file(str(root / "sub" / "b.txt"), b"two", append=True)
        client.move(str(root / "a.txt"), str(root / "c.txt"))
        client.remove(str(root / "sub" / "b.txt"))
        for want in (("create", b"sub/b.txt"), ("write", b"sub/b.txt"), ("rename", b"a.txt"),
                     ("create", b"c.txt"), ("remove", b"sub/b.txt")):
            until(want)
        client.remove(str(root), recursive=True)  # the root's removal ends the watch
        end = None
        while not isinstance(end, dict):
            end = heard.get(timeout=10)
        assert end["events"] >= 7 and not end["overflowed"]


def test_watch_dir_refuses_what_is_not_a_directory_and_ends_when_closed(daemon, tmp_path):
    (tmp_path / "f").write_text("x")
    with daemon.client() as client:
        with pytest.raises(DaemonError, match="Not a directory"):
            list(client.watch_dir(str(tmp_path / "f")))
        stream = client.watch_dir(str(tmp_path))
        stream.close()  # given up: the watch ends, the connection serves on
        assert client.stat(str(tmp_path / "f")).size == 1
