"""Build the self-contained daemon bundle: ``python -m sandman_ray.bundle DIR``.

The bundle is a directory that, bound read-only at ``/.sandman`` (the mount point the
binaries are patched for), starts the daemon in any x86-64 Linux image, even one with
no Python and no libc (busybox-static, distroless)::

    bin/python3        this interpreter, its ELF interpreter and rpath set to the bundle
    bin/sandmand       launcher: ``#!/.sandman/bin/python3 -IS`` + the daemon's main
    lib/               ld-linux, libc, libm, libpython ... (what the interpreter needs)
    lib/sandmand.pack  the daemon package's modules, compiled, in one file (the launcher's)
    lib/python3X.zip   the daemon package (sandmand/) and the stdlib modules it imports,
                       compiled, uncompressed
    lib/python3.X/lib-dynload/   the few extension modules it imports
    sandmand.pyz       the daemon as a zipapp, sources beside their compiled modules
                       (for the explicit loader form)

The interpreter runs against the bundle's libraries only; the commands it starts use
the image's own (the daemon builds their environment explicitly, see base_environment).
Without patchelf the bundle still works through the explicit loader:
``/.sandman/lib/ld-linux-x86-64.so.2 --library-path /.sandman/lib /.sandman/bin/python3
-IS /.sandman/sandmand.pyz ...`` (or ``... -IS -m sandmand ...``: the package is in the
zipped stdlib).
"""

import argparse
import json
import logging
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import sandman_ray.daemon.sandmand as sandmand

logger = logging.getLogger(__name__)

DAEMON_PACKAGE = Path(sandmand.__file__).parent  # sandman_ray/daemon/sandmand/

DEFAULT_MOUNT = "/.sandman"
# Not needed by the daemon and each pulls in more shared libraries (zlib, OpenSSL ...):
# the stdlib falls back cleanly when they are missing. (``_ctypes`` and its libffi are
# in: the daemon makes its few calls through it, without the ctypes package.)
EXCLUDED_MODULES = {"zlib", "_bz2", "_lzma", "bz2", "lzma", "gzip", "_hashlib", "_ssl",
                    "ssl", "hashlib", "ctypes", "_blake2", "_sha1", "_sha256",
                    "_sha3", "_sha512", "_md5", "_uuid", "readline", "_curses"}
# Standard modules the bundle carries in another form: arcname -> (the module it needs,
# its source). Python 3.11's datetime.py defines the whole module in Python before it
# takes the C module's names instead (~2 ms of every daemon's start, for msgpack's
# timestamps, which the protocol never sends); from 3.12 on it is this.
SHIMS = {"datetime.pyc": ("_datetime", "from _datetime import *\n"
                                      "from _datetime import __doc__\n")}
# Listing the modules the daemon imports, run by the interpreter being bundled: every
# module of the daemon package, and what each imports.
_SCAN = r"""
import importlib, json, os, pkgutil, sys
sys.path[:0] = sys.argv[1:]
import sandmand
for info in pkgutil.walk_packages(sandmand.__path__, "sandmand."):
    importlib.import_module(info.name)
try:
    import msgpack
except ImportError:
    pass
for name in sandmand.LAZY_IMPORTS:
    importlib.import_module(name)
import encodings
for info in pkgutil.iter_modules(encodings.__path__):
    try:
        importlib.import_module("encodings." + info.name)
    except Exception:
        pass
found = {}
for name, module in sorted(sys.modules.items()):
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) if spec else None
    if origin == "frozen" or origin is None:
        origin = getattr(module, "__file__", None)
    found[name] = [origin, bool(getattr(module, "__path__", None))]
print(json.dumps({"modules": found, "stdlib": os.path.dirname(os.__file__),
                  "version": list(sys.version_info[:2])}))
"""


# The launcher, and the rest of it in lib/sandmand.pack: the daemon package is imported
# from the pack (module name -> (is a package, its marshalled code)) by a finder of its
# own, the stdlib from the zip. zipimport costs ~0.1 ms per module (its path finder, the
# zip's headers, the .pyc's header): ~2.5 ms of a ~30 ms start for the package's 13
# modules on a 2-vCPU VM. The finder's code is compiled in the pack too: compiling it with
# the launcher at every start would cost another ~0.4 ms. And no garbage collection
# while the modules load (they make no garbage, only objects to traverse): ~1.3 ms less
# at the median, ~3 ms at p90 (bench/daemon_start.py measures starts).
_LAUNCHER = """#!%s/bin/python3 -IS
import gc, marshal, sys
gc.disable()
with open(sys.prefix + "/lib/sandmand.pack", "rb") as fh:
    boot, PACK = marshal.loads(fh.read())
exec(boot)  # imports the daemon's main
gc.enable()
main()
"""
_BOOT = '''
from _frozen_importlib import ModuleSpec


class PackFinder:
    """The daemon package's modules, from PACK (see sandman_ray.bundle)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        entry = PACK.get(name)
        return None if entry is None else ModuleSpec(name, PackFinder, is_package=entry[0])

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        exec(marshal.loads(PACK[module.__name__][1]), module.__dict__)


sys.meta_path.insert(0, PackFinder)
from sandmand.__main__ import main
'''


class BundleError(RuntimeError):
    """The bundle cannot be built on this machine; the message says why."""


def shared_libraries(elf: Path) -> Dict[str, Path]:
    """soname -> path of every shared library ``elf`` loads, and the dynamic loader."""
    try:
        out = subprocess.run(["ldd", str(elf)], check=True, capture_output=True, text=True).stdout
    except FileNotFoundError as exc:
        raise BundleError("ldd is needed to find the interpreter's libraries") from exc
    except subprocess.CalledProcessError as exc:
        raise BundleError("ldd %s failed: %s" % (elf, exc.stderr.strip())) from exc
    libs: Dict[str, Path] = {}
    for line in out.splitlines():
        line = line.strip()
        match = re.match(r"(\S+) => (\S+) \(0x", line)
        if match:
            libs[match.group(1)] = Path(match.group(2))
        elif line.startswith("/") and "ld-linux" in line:
            loader = Path(line.split()[0])
            libs[loader.name] = loader
        elif "not found" in line:
            raise BundleError("%s needs a library that is missing: %s" % (elf, line))
    return libs


def _msgpack_dir() -> Optional[Path]:
    """The msgpack package with its C extension, when this interpreter has it: the
    daemon then decodes and encodes frames in C (a ping answers ~30 % sooner)."""
    try:
        import msgpack
        from msgpack import _cmsgpack  # noqa: F401 - only the compiled codec is worth it
    except ImportError:
        return None
    return Path(msgpack.__file__).parent


def _scan_modules(python: Path, extra_paths: List[str]) -> dict:
    proc = subprocess.run([str(python), "-I", "-S", "-c", _SCAN, str(DAEMON_PACKAGE.parent)]
                          + extra_paths,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    if proc.returncode != 0:
        raise BundleError("cannot list the daemon's imports with %s: %s" % (python, proc.stderr))
    return json.loads(proc.stdout)


def _excluded(name: str) -> bool:
    return name.split(".")[0] in EXCLUDED_MODULES


def build(dest: Path, mount: str = DEFAULT_MOUNT, python: Path = None) -> Path:
    """Build the bundle into ``dest`` (replaced if it exists) and return it."""
    python = Path(os.path.realpath(python or sys.executable))
    msgpack_dir = _msgpack_dir()
    scan = _scan_modules(python, [str(msgpack_dir.parent)] if msgpack_dir else [])
    major, minor = scan["version"]
    if (major, minor) != sys.version_info[:2]:
        raise BundleError("the bundled interpreter must be this Python (%d.%d), got %d.%d"
                          % (sys.version_info[0], sys.version_info[1], major, minor))
    stdlib = Path(scan["stdlib"])
    work = Path(tempfile.mkdtemp(prefix=".bundle-", dir=str(dest.parent)))
    try:
        (work / "bin").mkdir()
        lib = work / "lib"
        dynload = lib / ("python%d.%d" % (major, minor)) / "lib-dynload"
        dynload.mkdir(parents=True)
        libs = shared_libraries(python)
        extensions: List[Path] = []
        zip_path = lib / ("python%d%d.zip" % (major, minor))
        sources = set()
        for name, (origin, _is_package) in scan["modules"].items():
            if origin and not _excluded(name):
                sources.add(Path(origin))  # a module known by two names counts once
        with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_STORED) as zf:
            for path in sorted(sources):
                if path.suffix == ".so":
                    extensions.append(path)
                    target = dynload
                    if msgpack_dir and msgpack_dir in path.parents:  # msgpack/_cmsgpack.so
                        target = dynload.parent / path.parent.relative_to(msgpack_dir.parent)
                        target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target / path.name)
                elif path.suffix == ".py" and stdlib in path.parents:
                    arcname = str(path.relative_to(stdlib).with_suffix(".pyc"))
                    if arcname in SHIMS and SHIMS[arcname][0] in scan["modules"] and \
                            (major, minor) < (3, 12):
                        _add_compiled_text(zf, SHIMS[arcname][1], arcname)
                    else:
                        _add_compiled(zf, path, arcname)
                elif path.suffix == ".py" and msgpack_dir and msgpack_dir in path.parents:
                    # beside its extension module: a package cannot span zip and directory
                    rel = path.relative_to(msgpack_dir.parent).with_suffix(".pyc")
                    (dynload.parent / rel).parent.mkdir(parents=True, exist_ok=True)
                    _compile(path, dynload.parent / rel, str(rel))
            for path, arcname in _daemon_modules():
                _add_compiled(zf, path, arcname[:-3] + ".pyc")
        for ext in extensions:
            libs.update(shared_libraries(ext))
        for soname, path in libs.items():
            shutil.copy2(path, lib / soname)
        loader = next(name for name in libs if name.startswith("ld-linux"))
        # the landmark by which the interpreter finds its prefix (the bundle's root)
        (lib / ("python%d.%d" % (major, minor)) / "os.py").write_text("# landmark\n")
        shutil.copy2(python, work / "bin" / "python3")
        _write_zipapp(work / "sandmand.pyz")
        # the extension modules too: one that loads a library of its own (_ctypes's
        # libffi) finds it in the bundle, not in the image (which may have none)
        _patch(work, mount, loader, [work / "bin" / "python3"] + sorted(lib.glob("libpython*"))
               + sorted(dynload.rglob("*.so")))
        _write_pack(lib / "sandmand.pack")
        launcher = work / "bin" / "sandmand"
        launcher.write_text(_LAUNCHER % mount)
        launcher.chmod(0o755)
        (work / "BUNDLE.json").write_text(json.dumps({
            "python": str(python), "version": "%d.%d" % (major, minor), "mount": mount,
            "loader": loader, "daemon": _daemon_digest(),
            "builder": _digest(Path(__file__))}, indent=1))
        # readable by every user: a sandbox may run its daemon as any uid
        work.chmod(0o755)
        for path in work.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)
            elif path.is_file():
                path.chmod(0o755 if os.access(path, os.X_OK) else 0o644)
        # ...but the interpreter only executable: a process that runs a program it may
        # not read is not dumpable and belongs, for ptrace, to the namespace of the
        # file's owner, so no sandbox process can read the daemon's memory or its
        # /proc files (token theft through /proc/1/mem)
        (work / "bin" / "python3").chmod(0o711)
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    logger.info("daemon bundle built in %s (%d bytes)", dest, bundle_size(dest))
    return dest


def _compile(source: Path, target: Path, name: str) -> None:
    """Compile ``source`` to an unchecked-hash .pyc: the bundle carries no sources, and
    the interpreter trusts the code object without looking for one."""
    py_compile.compile(str(source), cfile=str(target), dfile=name[:-1], doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)


def _add_compiled(zf: zipfile.ZipFile, source: Path, arcname: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=".pyc") as tmp:
        _compile(source, Path(tmp.name), arcname)
        zf.write(tmp.name, arcname)


def _add_compiled_text(zf: zipfile.ZipFile, text: str, arcname: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "shim.py"
        source.write_text(text)
        _add_compiled(zf, source, arcname)


def _daemon_modules() -> List[Tuple[Path, str]]:
    """(source, name in a zip) of every module of the daemon package: sandmand/...py."""
    return [(path, "sandmand/" + path.relative_to(DAEMON_PACKAGE).as_posix())
            for path in sorted(DAEMON_PACKAGE.rglob("*.py"))]


def _write_pack(target: Path) -> None:
    """The launcher's lib/sandmand.pack: (the code of _BOOT, {module name: (is a package,
    marshalled code)}), compiled by this interpreter (the one bundled)."""
    import marshal
    pack = {}
    for path, arcname in _daemon_modules():
        name = arcname[:-3].replace("/", ".")
        is_package = name.endswith(".__init__")
        if is_package:
            name = name[:-len(".__init__")]
        code = compile(path.read_bytes(), arcname, "exec", dont_inherit=True)
        pack[name] = (is_package, marshal.dumps(code))
    boot = compile(_BOOT, "sandmand.pack", "exec", dont_inherit=True)
    target.write_bytes(marshal.dumps((boot, pack)))


def _write_zipapp(target: Path) -> None:
    """``python sandmand.pyz``: a ``__main__`` that runs the package's main, and the
    package, each module's source beside its compiled form (which zipimport takes first:
    nothing is compiled at a start)."""
    with tempfile.TemporaryDirectory() as tmp:
        main = Path(tmp) / "__main__.py"
        main.write_text("from sandmand.__main__ import main\nmain()\n")
        with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zf:
            for path, arcname in [(main, "__main__.py")] + _daemon_modules():
                zf.write(path, arcname)
                _add_compiled(zf, path, arcname[:-3] + ".pyc")


def _patch(root: Path, mount: str, loader: str, elves: List[Path]) -> None:
    strip = shutil.which("strip")
    if strip is not None:  # libpython loses ~80 % of its size without its symbols
        for elf in elves:
            subprocess.run([strip, "--strip-unneeded", str(elf)], check=True, capture_output=True)
    patchelf = shutil.which("patchelf")
    if patchelf is None:
        logger.warning("patchelf not found: bin/sandmand will not run directly; use the "
                       "explicit loader form (see sandman_ray.bundle)")
        return
    interp = ["--set-interpreter", "%s/lib/%s" % (mount, loader)]
    for elf in elves:
        args = interp if elf.name == "python3" else []
        subprocess.run([patchelf] + args + ["--force-rpath", "--set-rpath", mount + "/lib",
                                            str(elf)], check=True, capture_output=True)


def ensure_bundle(dest: Path, mount: str = DEFAULT_MOUNT) -> Path:
    """The bundle at ``dest``, built first when missing or made from another daemon
    source or interpreter (so a cache never serves a stale daemon)."""
    stamp = {"daemon": _daemon_digest(), "builder": _digest(Path(__file__)),
             "python": os.path.realpath(sys.executable), "mount": mount}
    meta = dest / "BUNDLE.json"
    if meta.exists():
        known = json.loads(meta.read_text())
        if all(known.get(k) == v for k, v in stamp.items()):
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    return build(dest, mount)


def _digest(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _daemon_digest() -> str:
    """One digest of every module of the daemon package, with its name: a bundle is
    rebuilt when any of them changes, or one is added, renamed or removed."""
    import hashlib
    digest = hashlib.sha256()
    for path, arcname in _daemon_modules():
        digest.update(b"%s\0%s\0" % (arcname.encode(), _digest(path).encode()))
    return digest.hexdigest()


def bundle_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def daemon_argv(mount: str = DEFAULT_MOUNT) -> List[str]:
    """The command that starts the daemon from a bundle mounted at ``mount``."""
    return [mount + "/bin/sandmand"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandman_ray.bundle",
                                     description="Build the self-contained daemon bundle.")
    parser.add_argument("dest", type=Path, help="directory to create (replaced if present)")
    parser.add_argument("--mount", default=DEFAULT_MOUNT,
                        help="where the bundle will be mounted in sandboxes (%(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build(args.dest.resolve(), args.mount)
    except BundleError as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
