"""The image cache under a disk budget: which entries are in use, which are evicted.

Every unpacked image of ``ImageCache`` (``<cache>/<key>/rootfs``) is an entry. An entry
in use is never evicted:

- a sandbox's: whoever prepares an image holds a shared lock on ``<cache>/<key>.use``
  (a ``Hold``) from before it looks for the entry until the sandbox is removed (the
  agent's process holds it; its sandboxes die with it);
- a snapshot's: the entry a snapshot of any pool on this node was taken over (its
  ``meta.json`` names the base's rootfs, or its base image);
- one being built: its build lock.

``fit`` runs after each build, and when the last sandbox of an entry lets it go while
the cache is over its budget: while the entries' bytes pass the budget, the least
recently used one that an exclusive lock on its ``.use`` file proves unused is renamed
away (a prepare that comes then finds no entry and builds it again) and removed. Images
built by debootstrap (``builtin:``) are neither counted nor evicted: they need a
package mirror to be built again. Several agents share one cache (one per pool on a
node): evictions take ``evict.lock`` in turn, and each agent's holds protect its own
sandboxes from the others.
"""

import fcntl
import json
import logging
import os
import secrets
import shutil
import threading
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set

logger = logging.getLogger(__name__)

DEFAULT_SHARE = 0.5  # of the cache's filesystem, when no budget is given
USED = "used"  # the entry's file whose mtime is its last use


class Hold:
    """One user's claim on an entry: while any is open, this process holds a shared
    lock on the entry's ``.use`` file (one descriptor per entry, however many
    sandboxes use it), and the entry is not evicted. ``close`` (or the object's end)
    gives it up."""

    def __init__(self, budget: "ImageBudget", key: str):
        self.budget, self.key = budget, key

    def close(self) -> None:
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.let_go(self.key)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at the interpreter's end: its fd closes anyway
            pass


def _locked_fd(path: Path, how: int) -> int:
    """A descriptor of ``path`` (made if missing) holding flock ``how``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _try_lock(path: Path) -> Optional[int]:
    """An exclusive lock on ``path`` if nobody holds one (the fd), else None."""
    try:
        return _locked_fd(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None


def tree_bytes(root: Path) -> int:
    """The bytes ``root`` holds on disk (blocks; a hard-linked file once)."""
    seen, total = set(), 0
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


class ImageBudget:
    """The budget of the cache at ``root`` (``budget_bytes``; None: DEFAULT_SHARE of its
    filesystem) and this process's count of hits, misses and evictions;
    ``snapshots_root``: where every pool's snapshots on this node are."""

    def __init__(self, root: Path, budget_bytes: Optional[int], snapshots_root: Path):
        self.root, self.snapshots_root = Path(root), Path(snapshots_root)
        if budget_bytes is None:
            fs = os.statvfs(self.root)
            budget_bytes = int(fs.f_blocks * fs.f_frsize * DEFAULT_SHARE)
        self.budget = int(budget_bytes)
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "evicted_bytes": 0}
        self.bytes = 0  # what the entries held when last measured (``fit``, ``status``)
        self.held: Dict[str, list] = {}  # key -> [its .use descriptor, open Holds]
        self.lock = threading.Lock()  # prepares run on several threads

    def hold(self, key: str) -> Hold:
        """A claim on entry ``key`` (which may not exist yet), made before it is looked
        for: it waits out an eviction of it under way."""
        with self.lock:
            held = self.held.get(key)
            if held is None:
                held = self.held[key] = [_locked_fd(self.root / (key + ".use"),
                                                    fcntl.LOCK_SH), 0]
            held[1] += 1
        return Hold(self, key)

    def let_go(self, key: str) -> None:
        """A Hold of ``key`` closed; the last one lets the entry go, and a cache over
        its budget (as last measured) evicts what it can now."""
        with self.lock:
            held = self.held.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del self.held[key]
            os.close(held[0])
        if self.bytes > self.budget:
            self.fit()

    def used(self, key: str, hit: bool) -> None:
        """The entry ``key`` served a prepare (``hit``: it was there already)."""
        self.stats["hits" if hit else "misses"] += 1
        try:
            os.utime(self.root / key / USED)
        except FileNotFoundError:
            (self.root / key / USED).touch()
        except OSError:
            pass

    def entries(self) -> List[dict]:
        """Each counted entry: key, bytes, last use (oldest first)."""
        found = []
        for meta_path in self.root.glob("*/meta.json"):
            entry = meta_path.parent
            if "." in entry.name:  # one being built (``<key>.building``), or going
                continue
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            if meta.get("unpacked_by") == "debootstrap":
                continue
            if "bytes" not in meta:  # unpacked before entries were measured: once now
                meta["bytes"] = tree_bytes(entry / "rootfs")
                measured = entry / (".meta-%s.json" % secrets.token_hex(4))
                try:
                    measured.write_text(json.dumps(meta))
                    os.rename(measured, meta_path)
                except OSError:
                    measured.unlink(missing_ok=True)
            try:
                last = (entry / USED).stat().st_mtime
            except OSError:
                last = meta_path.stat().st_mtime
            found.append({"key": entry.name, "bytes": int(meta["bytes"]), "used": last,
                          "image": meta.get("image", "")})
        found.sort(key=lambda e: e["used"])
        return found

    def status(self) -> Dict[str, int]:
        entries = self.entries()
        self.bytes = sum(e["bytes"] for e in entries)
        return dict(self.stats, bytes=self.bytes, entries=len(entries),
                    budget_bytes=self.budget)

    def last(self) -> Dict[str, int]:
        """The counts and the bytes last measured, without a walk of the cache."""
        return dict(self.stats, bytes=self.bytes, budget_bytes=self.budget)

    def fit(self, keep: Iterable[str] = ()) -> int:
        """Evict the least recently used unused entries (never those of ``keep``) until
        the cache is within its budget; how many bytes it still holds."""
        keep = set(keep)
        lock = _locked_fd(self.root / "evict.lock", fcntl.LOCK_EX)
        try:
            entries = self.entries()
            total = self.bytes = sum(e["bytes"] for e in entries)
            if total <= self.budget:
                return total
            bases = self._snapshot_bases()
            for entry in entries:
                if total <= self.budget:
                    break
                if entry["key"] in keep or entry["key"] in bases["keys"] or \
                        entry["image"] in bases["images"]:
                    continue
                if self._evict(entry["key"]):
                    total -= entry["bytes"]
                    self.stats["evictions"] += 1
                    self.stats["evicted_bytes"] += entry["bytes"]
                    logger.info("image cache %s: evicted %s (%s, %d bytes): %d of %d bytes "
                                "held", self.root, entry["key"], entry["image"],
                                entry["bytes"], total, self.budget)
            self.bytes = total
            if total > self.budget:
                logger.warning("image cache %s: %d bytes in use, over its budget of %d: "
                               "nothing more can be evicted now", self.root, total,
                               self.budget)
            return total
        finally:
            os.close(lock)

    def _evict(self, key: str) -> bool:
        """Remove entry ``key`` if nothing holds it nor builds it."""
        use = _try_lock(self.root / (key + ".use"))
        if use is None:
            return False
        try:
            build = _try_lock(self.root / (key + ".lock"))
            if build is None:
                return False
            try:
                doomed = self.root / (".evicted-%s-%s" % (key, secrets.token_hex(4)))
                try:
                    os.rename(self.root / key, doomed)
                except FileNotFoundError:
                    return False
            finally:
                os.close(build)
        finally:
            os.close(use)
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def _snapshot_bases(self) -> Dict[str, Set[str]]:
        """The entries snapshots on this node were taken over: their keys (from the
        base's rootfs a snapshot names) and, for a snapshot that names none, its base
        image (a snapshot's base followed down to an image)."""
        keys, images, metas = set(), set(), {}
        for path in self.snapshots_root.glob("*/[!.]*/meta.json"):
            try:
                metas[(path.parent.parent.name, path.parent.name)] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        for meta in metas.values():
            rootfs = meta.get("base_rootfs")
            if rootfs:
                keys.add(Path(rootfs).parent.name)
                continue
            base, seen = meta.get("base", ""), 0
            while base.startswith("snapshot:") and seen < len(metas):
                pool, _, name = base[len("snapshot:"):].partition("/")
                base, seen = (metas.get((pool, name)) or {}).get("base", ""), seen + 1
            images.add(base)
        return {"keys": keys, "images": images}

