"""sandmand: the daemon that runs inside a sandbox.

Standard library only, Python 3.8 or newer. It is mounted read-only into an unmodified
task image (at ``/.sandman``) and keeps files, shell sessions and background processes
alive across calls; the protocol is documented in ``docs/protocol.md``. Its modules:
``wire`` (constants, codec, frames and the op table, imported by the client too),
``fields`` (request fields and the errors answered), ``loop`` (the event loop),
``spawn`` (starting and following processes), ``attrs`` (what a tenant may change of
the daemon's process, and its bounding set), ``commands`` (exactly once: commands
with an id), ``daemon`` (the Daemon: state, lifecycle,
listening), ``ops/`` (the operations, by group), ``connection`` (frames in, replies
out, dispatch) and ``__main__`` (arguments and main: ``python -m sandmand``, or
``python sandman_ray/daemon/sandmand`` from a checkout). This file is imported first on every start:
it stays this small.
"""

# stdlib modules imported on first use; the bundle builder packs these too
LAZY_IMPORTS = ("resource", "subprocess", "shutil", "tarfile", "io", "threading", "heapq",
                "collections", "select", "fcntl", "termios", "struct", "_ctypes")
