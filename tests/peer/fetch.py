"""Other projects' own test files, fetched at test time (never copied into this
repository): each peer is pinned by version and by sha256, downloaded once into
``.cache/peer`` and checked every time.

    python tests/peer/fetch.py swe-rex      # prints where its files are

SWE-ReX's files come from its source distribution on PyPI (``pip download
--no-binary``), which ships its tests, pinned by the archive's sha256.
mini-swe-agent's environment and agent tests (``tests/environments/test_local.py``,
``tests/agents/test_default.py``) are not in its sdists (2.0.0 to 2.4.6 hold
``tests/test_fire.py`` and ``tests/test_init.py`` only): they come from its git
repository at the release's tag, each file pinned by its own sha256, read from a clone
named by ``MINI_SWE_AGENT_GIT`` or downloaded from GitHub. Where neither can be had
``fetch`` raises PeerUnreachable, which says so.
"""

import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
import os
import urllib.error
import urllib.request
from typing import Dict, Tuple

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


class PeerUnreachable(RuntimeError):
    """A peer's files are in no source this machine reaches."""


@dataclass(frozen=True)
class GitPeer:
    """Files of a git repository at a release's tag, each pinned by its sha256."""
    package: str
    version: str
    repository: str  # owner/name on GitHub
    tag: str
    files: Dict[str, str]  # path in the repository -> sha256
    clone_variable: str  # the environment variable that may name a local clone

    @property
    def where(self) -> Path:
        return CACHE / ("%s-%s" % (self.package, self.version))


PEERS = {
    "swe-rex": Peer("swe-rex", "1.4.0",
                    "14f8a24c49a63f9e251340b1109ac75a4aacbaece410f8599209de9bfca843c0",
                    ("tests/test_execution.py",)),
    "mini-swe-agent": GitPeer(
        "mini-swe-agent", "2.4.6", "SWE-agent/mini-swe-agent", "v2.4.6",
        {"tests/conftest.py":
             "529ab09866f7e67c6868f2e06646682945fe26ec481ca60e79a06ca1731b697a",
         "tests/environments/test_local.py":
             "94651cc2d09d113c361a95656bfb1f21291a4d6197c4d62bf93c325a07fddafe",
         "tests/agents/test_default.py":
             "87a97d18cdb931dc5f248d5178e8596021e6b17bbef70af51c40a518ac488eda"},
        "MINI_SWE_AGENT_GIT"),
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


def _git_file(peer: GitPeer, path: str) -> bytes:
    """One file of the peer at its tag: from the local clone its variable names, else
    from GitHub."""
    clone = os.environ.get(peer.clone_variable)
    if clone:
        out = subprocess.run(["git", "-C", clone, "show", "%s:%s" % (peer.tag, path)],
                             capture_output=True, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise PeerUnreachable("%s=%s: no %s at %s (%s)" % (
                peer.clone_variable, clone, path, peer.tag, out.stderr.decode().strip()))
        return out.stdout
    url = "https://raw.githubusercontent.com/%s/%s/%s" % (peer.repository, peer.tag, path)
    try:
        with urllib.request.urlopen(url, timeout=15) as answer:
            return answer.read()
    except (urllib.error.URLError, OSError) as exc:
        raise PeerUnreachable(
            "%s %s's %s: %s is out of reach (%s), and %s names no clone of %s" % (
                peer.package, peer.version, path, url, exc, peer.clone_variable,
                peer.repository)) from None


def _fetch_git(peer: GitPeer) -> Path:
    for path, pinned in peer.files.items():
        target = peer.where / path
        cached = target.is_file()
        data = target.read_bytes() if cached else _git_file(peer, path)
        digest = hashlib.sha256(data).hexdigest()
        if digest != pinned:
            raise RuntimeError("%s %s's %s: sha256 %s, pinned %s: not the file the suite was "
                               "pinned to" % (peer.package, peer.version, path, digest, pinned))
        if not cached:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return peer.where


def fetch(name: str) -> Path:
    """The directory holding the peer's pinned files (as in its sources: ``tests/...``)."""
    peer = PEERS[name]
    if isinstance(peer, GitPeer):
        return _fetch_git(peer)
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
