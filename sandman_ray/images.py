"""Image root filesystems for sandboxes.

For now: a busybox-static rootfs (no libc, no Python), the smallest real image, used by
the demo and the tests to prove the daemon bundle needs nothing from the image.
"""

import os
import shutil
import subprocess
from pathlib import Path

# Mount points a sandbox binds over; a read-only root cannot get them created later.
MOUNT_POINTS = (".sandman", "run/sandman", "proc", "dev", "tmp", "sys")
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")


def find_busybox() -> str:
    """Path of a statically linked busybox (Debian package ``busybox-static``)."""
    for path in BUSYBOX_CANDIDATES:
        if os.path.exists(path):
            out = subprocess.run(["file", "-b", path], capture_output=True, text=True).stdout \
                if shutil.which("file") else ""
            if "dynamically linked" not in out:
                return path
    raise FileNotFoundError("no static busybox found; install it: apt-get install busybox-static")


def build_busybox_rootfs(dest: Path) -> Path:
    """Create a minimal rootfs at ``dest``: busybox and its applet links, /etc files,
    and the directories sandboxes mount over. Idempotent (an existing rootfs is kept)."""
    dest = Path(dest)
    if (dest / "bin" / "busybox").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp-%d" % os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    busybox = find_busybox()
    (tmp / "bin").mkdir(parents=True)
    shutil.copy2(busybox, tmp / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            os.symlink("busybox", tmp / "bin" / applet)
    for sub in MOUNT_POINTS + ("etc", "root", "home", "var/tmp", "usr"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    os.symlink("../bin", tmp / "usr" / "bin")
    (tmp / "tmp").chmod(0o1777)
    (tmp / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                        "nobody:x:65534:65534:nobody:/:/bin/false\n")
    (tmp / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (tmp / "etc" / "os-release").write_text('ID=busybox\nNAME="BusyBox"\nVERSION_ID=static\n')
    try:
        tmp.rename(dest)
    except OSError:  # built concurrently by someone else: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
