"""The self-contained daemon bundle in real bubblewrap sandboxes of images that have no
Python and no libc."""

import json
import os
from pathlib import Path

import pytest

from sandman_ray import DaemonClient
from sandman_ray.bundle import bundle_size
from sandman_ray.providers.local.bwrap import BwrapSandbox
from conftest import require_bwrap


@pytest.fixture
def busybox_sandbox(bundle, busybox_rootfs, tmp_path):
    require_bwrap()
    sandbox = BwrapSandbox(busybox_rootfs, bundle, tmp_path / "run", hostname="bb")
    address = sandbox.start()
    with DaemonClient(address, sandbox.token, default_timeout=30) as client:
        yield sandbox, client
    sandbox.stop()


def test_bundle_holds_interpreter_loader_libraries_and_stdlib(bundle):
    meta = json.loads((bundle / "BUNDLE.json").read_text())
    assert meta["mount"] == "/.sandman"
    for rel in ("bin/python3", "bin/sandmand", "sandmand.pyz", "lib/" + meta["loader"],
                "lib/libc.so.6", "lib/python%s.zip" % meta["version"].replace(".", "")):
        assert (bundle / rel).is_file(), rel
    assert bundle_size(bundle) < 40e6


def test_bundle_holds_every_module_of_the_daemon_package_compiled(bundle):
    import marshal
    import zipfile
    from sandman_ray.bundle import DAEMON_PACKAGE
    meta = json.loads((bundle / "BUNDLE.json").read_text())
    modules = {"sandmand/%s" % p.relative_to(DAEMON_PACKAGE).with_suffix(".pyc").as_posix()
               for p in DAEMON_PACKAGE.rglob("*.py")}
    assert len(modules) > 10
    stdlib = zipfile.ZipFile(bundle / "lib" / ("python%s.zip" % meta["version"].replace(".", "")))
    assert modules <= set(stdlib.namelist())
    zipapp = set(zipfile.ZipFile(bundle / "sandmand.pyz").namelist())
    assert modules | {"__main__.py", "__main__.pyc"} <= zipapp
    # and the launcher's pack: module names, the package's __init__ as the package
    _boot, pack = marshal.loads((bundle / "lib" / "sandmand.pack").read_bytes())
    assert {name.replace(".", "/") + ("/__init__" if is_package else "") + ".pyc"
            for name, (is_package, _code) in pack.items()} == modules


def test_the_bundles_datetime_is_the_c_modules_and_msgpack_runs_on_it(bundle):
    """The bundle carries datetime as Python 3.12's is (the C module's names, without
    3.11's definitions in Python first): msgpack, and so the daemon's wire, load with
    it and use the C codec, and a timestamp still round-trips."""
    import subprocess
    meta = json.loads((bundle / "BUNDLE.json").read_text())
    check = ("import sys, datetime, _datetime\n"
             "assert datetime.datetime is _datetime.datetime\n"
             "assert 'math' not in sys.modules, '3.11 datetime.py imports math'\n"
             "import msgpack\n"
             "from sandmand import wire\n"
             "assert wire._msgpack is msgpack\n"
             "t = datetime.datetime(2026, 12, 7, tzinfo=datetime.timezone.utc)\n"
             "assert msgpack.unpackb(msgpack.packb(t, datetime=True), timestamp=3) == t\n"
             "print('ok')\n")
    ran = subprocess.run([str(bundle / "lib" / meta["loader"]), "--library-path",
                          str(bundle / "lib"), str(bundle / "bin" / "python3"), "-IS", "-c",
                          check], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert ran.stdout == "ok\n", ran.stderr


@pytest.mark.parametrize("form", [["sandmand.pyz"], ["-m", "sandmand"]])
def test_the_explicit_loader_forms_start_the_daemon(bundle, tmp_path, form):
    """``ld-linux --library-path lib bin/python3 -IS sandmand.pyz`` (or ``-m sandmand``)
    serves without patchelf's paths: here from where the bundle was built."""
    import subprocess
    meta = json.loads((bundle / "BUNDLE.json").read_text())
    ready_r, ready_w = os.pipe()
    argv = [str(bundle / "lib" / meta["loader"]), "--library-path", str(bundle / "lib"),
            str(bundle / "bin" / "python3"), "-IS"]
    argv += [str(bundle / form[0])] if form[0].endswith(".pyz") else form
    proc = subprocess.Popen(argv + ["--listen", "unix:%s/s.sock" % tmp_path, "--ready-fd",
                                    str(ready_w)], pass_fds=(ready_w,),
                            env={"PATH": "/usr/bin:/bin", "SANDMAN_TOKEN": "t" * 16})
    os.close(ready_w)
    try:
        with os.fdopen(ready_r) as fh:
            address = fh.readline().strip()
        with DaemonClient(address, "t" * 16, default_timeout=30) as client:
            assert client.exec("echo up").stdout == b"up\n"
            client.shutdown()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_busybox_image_has_neither_python_nor_libc(busybox_rootfs):
    assert not list(busybox_rootfs.glob("**/libc.so*"))
    assert not list(busybox_rootfs.glob("**/python*"))


def test_exec_ls_lists_the_busybox_tree(busybox_sandbox, busybox_rootfs):
    _, client = busybox_sandbox
    listed = set(client.exec("ls /").text.split())
    expected = {p.name for p in busybox_rootfs.iterdir() if not p.name.startswith(".")}
    assert listed == expected
    assert client.info()["os_release"]["ID"] == "busybox"


def test_sessions_files_and_processes_work_without_bash(busybox_sandbox):
    _, client = busybox_sandbox
    client.run("cd /tmp && export V=1")
    assert client.run("echo $V; pwd").stdout == b"1\n/tmp\n"
    client.write_file("/tmp/f", b"content")
    assert client.exec("cat /tmp/f").stdout == b"content"
    pid = client.spawn("echo bg")
    client.proc_wait(pid, timeout=10)
    assert client.proc_output(pid).data == b"bg\n"


def test_only_the_daemon_maps_the_bundle_libraries(busybox_sandbox):
    _, client = busybox_sandbox
    daemon_pid = client.info()["pid"]
    daemon_maps = client.read_file("/proc/%d/maps" % daemon_pid).decode()
    assert "/.sandman/lib/libc.so.6" in daemon_maps
    child_maps = client.exec("cat /proc/self/maps").text
    assert "/.sandman" not in child_maps


def test_hostile_loader_variables_do_not_stop_the_daemon(bundle, busybox_rootfs, tmp_path):
    require_bwrap()
    env = {"PATH": "/bin", "LD_LIBRARY_PATH": "/nonexistent", "LD_PRELOAD": "/nonexistent.so"}
    sandbox = BwrapSandbox(busybox_rootfs, bundle, tmp_path / "run", env=env)
    try:
        with DaemonClient(sandbox.start(), sandbox.token, default_timeout=30) as client:
            assert client.exec("echo ok").stdout == b"ok\n"
            assert "LD_PRELOAD=/nonexistent.so" in client.exec(["env"]).text  # the image's own
    finally:
        sandbox.stop()


def test_sandbox_sees_only_its_own_processes_and_no_network(busybox_sandbox):
    _, client = busybox_sandbox
    pids = [p for p in client.exec("ls /proc").text.split() if p.isdigit()]
    assert len(pids) < 10
    assert client.exec("ls /sys/class/net").text.split() in (["lo"], [])


def test_stopping_the_sandbox_leaves_nothing(bundle, busybox_rootfs, tmp_path):
    require_bwrap()
    from conftest import processes_matching
    sandbox = BwrapSandbox(busybox_rootfs, bundle, tmp_path / "run")
    with DaemonClient(sandbox.start(), sandbox.token) as client:
        client.spawn("sleep 71.5")
    sandbox.stop()
    from conftest import wait_until
    # the kernel kills the rest of the pid namespace once its init is gone, a moment later
    wait_until(lambda: processes_matching("sleep 71.5") == [], timeout=5,
               what="the sandbox's processes to die with it")
    assert not (tmp_path / "run" / "sock").exists()


def test_a_group_without_limits_that_cannot_be_joined_does_not_stop_the_sandbox(
        bundle, busybox_rootfs, tmp_path, monkeypatch):
    """Where the cgroups look writable but refuse a process (the agent in a container
    with a cgroup namespace of its own, say), a sandbox without limits still starts:
    the group that only tracks its processes is joined where the host allows."""
    from sandman_ray.images import PreparedImage
    from sandman_ray.providers.local.bwrap import SandboxProcess
    from sandman_ray.providers.local.cgroups import Cgroups
    from sandman_ray.spec import SandboxSpec
    require_bwrap()
    fake = tmp_path / "cgroup"
    refusing = fake / "pids" / "sandman-test" / "sbx"
    (refusing / "cgroup.procs").mkdir(parents=True)  # writing a pid into it fails
    monkeypatch.setattr(Cgroups, "ROOT", fake)
    image = PreparedImage("dir:%s" % busybox_rootfs, busybox_rootfs)
    sandbox = SandboxProcess("sbx", image, bundle, tmp_path / "state",
                             SandboxSpec(image=image.image), cgroup_group="sandman-test/sbx")
    sandbox.launch()
    try:
        address = sandbox.wait_ready_blocking(10)
        assert sandbox.cgroups.tracking == [refusing]
        with DaemonClient(address, sandbox.token, default_timeout=30) as client:
            assert client.exec("echo up").stdout == b"up\n"
    finally:
        (refusing / "cgroup.procs").rmdir()  # a real group's files go with it, these not
        sandbox.remove()
