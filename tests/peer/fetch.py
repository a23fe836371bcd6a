"""Other projects' own test files, fetched at test time (never copied into this
repository): each peer is pinned by version and by the sha256 of the archive its files
come from, downloaded once into ``.cache/peer`` and checked every time.

    python tests/peer/fetch.py swe-rex      # prints where its files are

A peer's archive is its source distribution on PyPI (``pip download --no-binary``),
which ships its tests. mini-swe-agent's environment and agent tests
(``tests/environments/test_local.py``, ``tests/agents/test_default.py``) are not in its
sdists (2.0.0 to 2.4.6 hold ``tests/test_fire.py`` and ``tests/test_init.py`` only) and
its git repository is out of this network's reach: they are not fetched here.
"""

import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "peer"


@dataclass(frozen=True)
class Peer:
    package: str
    version: str
    sha256: str  # of the sdist
    files: Tuple[str, ...]  # paths inside the sdist, below its top directory

    @property
    def where(self) -> Path:
        return CACHE / ("%s-%s" % (self.package, self.version))


PEERS = {
    "swe-rex": Peer("swe-rex", "1.4.0",
                    "14f8a24c49a63f9e251340b1109ac75a4aacbaece410f8599209de9bfca843c0",
                    ("tests/test_execution.py",)),
}


def _sdist(peer: Peer) -> Path:
    """The peer's sdist in the cache, downloaded if missing, its sha256 checked."""
    downloads = CACHE / "sdists"
    downloads.mkdir(parents=True, exist_ok=True)
    prefix = "%s-%s." % (peer.package.replace("-", "_"), peer.version)
    found = [p for p in downloads.iterdir() if p.name.startswith(prefix)]
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", "-d", str(downloads),
                        "%s==%s" % (peer.package, peer.version)], check=True,
                       stdin=subprocess.DEVNULL)
        found = [p for p in downloads.iterdir() if p.name.startswith(prefix)]
    if len(found) != 1:
        raise RuntimeError("%s %s: expected one sdist in %s, found %s"
                           % (peer.package, peer.version, downloads, [p.name for p in found]))
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != peer.sha256:
        raise RuntimeError("%s: sha256 %s, pinned %s: not the archive the suite was pinned "
                           "to" % (found[0], digest, peer.sha256))
    return found[0]


def fetch(name: str) -> Path:
    """The directory holding the peer's pinned files (as in its sdist: ``tests/...``)."""
    peer = PEERS[name]
    if all((peer.where / f).is_file() for f in peer.files):
        return peer.where
    archive = _sdist(peer)
    with tarfile.open(archive) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        for wanted in peer.files:
            member = tar.getmember("%s/%s" % (top, wanted))
            data = tar.extractfile(member).read()
            target = peer.where / wanted
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return peer.where


if __name__ == "__main__":
    for name in sys.argv[1:] or list(PEERS):
        print(fetch(name))
