"""OCI image layouts and ``docker save`` archives, read and checked before anything of
them is unpacked.

Nothing a layout or an archive claims is believed: ``index.json``, manifests and
configs are read below the layout's directory descriptor (``image_files``: no link
out, regular files only, at most ``ImageLimits.json_bytes``); every blob is hashed as
it is read and must have the digest and size its descriptor names; every layer's
uncompressed stream must have the config's ``rootfs.diff_ids`` entry; and the cache
key (``Verified.digest``) is the digest of bytes read here: the manifest's for a
layout (which names the config and every layer by digest), the config's for an
archive (which names every layer's uncompressed digest). An image that lies about
one of them is refused, so it can never take the cache entry of the image it claims
to be.

``Verified.unpack_builtin`` applies the layers with the built-in applier
(``image_layers``); ``Verified.private_layout`` copies the checked blobs into a
layout of the cache's own, the only thing umoci is ever handed.
"""

import hashlib
import io
import json
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, List, Optional, Tuple

from sandman_ray.errors import ProviderError
from sandman_ray.image_files import open_regular, read_capped, read_file
from sandman_ray.image_layers import (
    BoundedTarInfo, ImageLimits, LayerRefused, VerifiedStream, apply_blob, check_blob,
    check_digest)
from sandman_ray.errors import fatal

REF_NAME = "org.opencontainers.image.ref.name"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
# How deep an index of indexes may nest before the manifest (skopeo writes one level)
INDEX_DEPTH = 4


@dataclass
class Verified:
    """An image whose manifest (or archive manifest) and config were read and checked.

    digest: the cache key, the digest of bytes read (module docstring).
    config: the image config (its ``config`` part is checked by ``ImageConfig``).
    config_raw: the config's bytes, as read.
    layers: each layer's (name for errors, descriptor digest or None, size or None,
        diff_id, opener of its bytes).
    close: closes what the layers are read from (the layout's descriptor, the archive).
    """

    image: str
    digest: str
    config: dict
    config_raw: bytes
    layers: List[Tuple[str, Optional[str], Optional[int], str, Callable[[], BinaryIO]]] = \
        field(default_factory=list)
    limits: ImageLimits = field(default_factory=ImageLimits)
    close: Callable[[], None] = lambda: None  # what the layers are read from

    def unpack_builtin(self, dest: Path) -> None:
        """Every layer applied onto ``dest`` by the built-in applier, checked as read."""
        dest.mkdir()
        for name, digest, size, diff_id, opener in self.layers:
            with opener() as raw:
                _refusing(self.image, lambda: apply_blob(raw, dest, digest, size, diff_id,
                                                         self.limits, name))

    def private_layout(self, layout: Path, tag: str = "image") -> None:
        """A layout at ``layout`` holding the checked config and layers (each blob
        checked as it is copied) and a manifest written here, tagged ``tag``."""
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        descriptors = []
        for index, (name, digest, size, diff_id, opener) in enumerate(self.layers):
            part = blobs / ("layer-%d.part" % index)
            with opener() as raw, open(part, "wb") as out:
                stream = VerifiedStream(raw, None, None, self.limits.layer_bytes, name)
                _refusing(self.image, lambda: check_blob(stream, digest, size, diff_id,
                                                         self.limits, name, copy_to=out))
            with open(part, "rb") as written:
                head = written.read(2)
            got = "sha256:" + stream.hash.hexdigest()
            os.rename(part, blobs / got.split(":")[1])
            descriptors.append({"mediaType": OCI_LAYER + ("+gzip" if head == b"\x1f\x8b" else ""),
                                "digest": got, "size": stream.count})
        config_digest = _put(blobs, self.config_raw)
        manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                               "config": {"mediaType": OCI_CONFIG, "digest": config_digest,
                                          "size": len(self.config_raw)},
                               "layers": descriptors}).encode()
        (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": _put(blobs, manifest), "size": len(manifest),
            "annotations": {REF_NAME: tag}}]}))


def _put(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return "sha256:" + digest


def _refusing(image: str, work: Callable[[], None]) -> None:
    try:
        work()
    except LayerRefused as exc:
        raise fatal("image %r: %s: refused" % (image, exc)) from exc


def _json(data: bytes, image: str, what: str) -> dict:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise fatal("image %r: %s is not JSON: %s" % (image, what, exc)) from exc
    if not isinstance(value, dict):
        raise fatal("image %r: %s is not a JSON object" % (image, what))
    return value


def _diff_ids(config: dict, count: int, image: str) -> List[str]:
    rootfs = config.get("rootfs")
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(ids, list) or len(ids) != count:
        raise fatal("image %r: its config's rootfs.diff_ids names %s layers, its manifest %d"
                    % (image, len(ids) if isinstance(ids, list) else "no", count))
    for diff_id in ids:
        _refusing(image, lambda: check_digest(diff_id, "rootfs.diff_ids entry"))
    return ids


# --------------------------------------------------------------------------- OCI layouts
class OciLayout:
    """An OCI image layout on this host, every file of it read below its descriptor."""

    def __init__(self, path: Path, image: str, limits: ImageLimits):
        self.path, self.image, self.limits = Path(path), image, limits
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise fatal("image %r: not an OCI layout (%s: %s)"
                        % (image, path, exc.strerror)) from exc

    def close(self) -> None:
        os.close(self.fd)

    def _blob_path(self, descriptor: dict, what: str) -> Tuple[str, str]:
        if not isinstance(descriptor, dict):
            raise fatal("image %r: %s is not a descriptor" % (self.image, what))
        digest = descriptor.get("digest")
        _refusing(self.image, lambda: check_digest(digest, what))
        size = descriptor.get("size")
        if size is not None and (not isinstance(size, int) or size < 0):
            raise fatal("image %r: %s has size %r" % (self.image, what, size))
        return digest, "blobs/%s/%s" % tuple(digest.split(":", 1))

    def blob_json(self, descriptor: dict, what: str) -> Tuple[str, bytes, dict]:
        """A manifest, index or config blob: its digest, bytes and JSON, checked."""
        digest, path = self._blob_path(descriptor, what)
        fd = open_regular(self.fd, path, self.image)
        data = read_capped(fd, self.limits.json_bytes, "image %r: %s" % (self.image, path))
        stream = VerifiedStream(io.BytesIO(data), digest, descriptor.get("size"),
                                self.limits.json_bytes, "%s %s" % (what, path))
        _refusing(self.image, stream.verify)
        return digest, data, _json(data, self.image, "%s %s" % (what, path))

    def opener(self, descriptor: dict, what: str) -> Callable[[], BinaryIO]:
        _, path = self._blob_path(descriptor, what)
        return lambda: os.fdopen(open_regular(self.fd, path, self.image), "rb")

    def manifest(self, tag: str) -> Tuple[str, dict]:
        """The digest and JSON of the manifest ``tag`` names (or the only one, or
        ``latest``), through an index of platforms to linux/amd64."""
        try:
            raw = read_file(self.fd, "index.json", self.limits.json_bytes, self.image)
        except ProviderError as exc:
            raise fatal("image %r: not an OCI layout (%s)" % (self.image, exc)) from exc
        index = _json(raw, self.image, "index.json")
        manifests = index.get("manifests") or []
        if not isinstance(manifests, list) or not all(isinstance(m, dict) for m in manifests):
            raise fatal("image %r: index.json's manifests is not a list of descriptors"
                        % self.image)

        def named(m: dict) -> object:
            annotations = m.get("annotations")
            return annotations.get(REF_NAME) if isinstance(annotations, dict) else None
        if tag:
            manifests = [m for m in manifests if named(m) == tag]
        elif len(manifests) > 1:
            manifests = [m for m in manifests if named(m) == "latest"]
        if len(manifests) != 1:
            raise fatal("image %r: %s" % (self.image, "no manifest tagged %r" % tag if tag
                                          else "the layout holds several images; name a tag"))
        descriptor = manifests[0]
        for _ in range(INDEX_DEPTH):
            digest, _, manifest = self.blob_json(descriptor, "manifest")
            if "manifests" not in manifest:
                return digest, manifest
            chosen = [m for m in manifest["manifests"] if isinstance(m, dict) and (
                m.get("platform") or {}).get("architecture") in ("amd64", None)] \
                if isinstance(manifest["manifests"], list) else []
            if not chosen:
                raise fatal("image %r has no linux/amd64 image" % self.image)
            descriptor = chosen[0]
        raise fatal("image %r: indexes nest deeper than %d" % (self.image, INDEX_DEPTH))


def read_oci(path: Path, tag: str, image: str, limits: ImageLimits) -> Verified:
    """An OCI layout's image checked as far as it can be before its layers are read
    (those are checked as they are, below the layout's descriptor, which
    ``Verified.close`` closes)."""
    layout = OciLayout(path, image, limits)
    try:
        digest, manifest = layout.manifest(tag)
        _, config_raw, config = layout.blob_json(manifest.get("config"), "config")
        descriptors = manifest.get("layers")
        if not isinstance(descriptors, list):
            raise fatal("image %r: its manifest's layers is not a list" % image)
        diff_ids = _diff_ids(config, len(descriptors), image)
        verified = Verified(image, digest, config, config_raw, limits=limits)
        for number, (descriptor, diff_id) in enumerate(zip(descriptors, diff_ids)):
            name = "layer %d" % (number + 1)
            blob, _ = layout._blob_path(descriptor, name)
            verified.layers.append(("%s (%s)" % (name, blob), blob, descriptor.get("size"),
                                    diff_id, layout.opener(descriptor, name)))
    except BaseException:
        layout.close()
        raise
    verified.close = layout.close
    return verified


# --------------------------------------------------------------------------- docker save
def read_docker_archive(path: Path, image: str, limits: ImageLimits) -> Verified:
    """A ``docker save`` archive's image: its manifest and config read (within the
    archive: a link member resolves to another member, never to a host file), its
    layers checked as they are read against the config's diff_ids."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise fatal("image %r: no such file (%s)" % (image, exc.strerror)) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise fatal("image %r: no such file (not a regular file): refused" % image)
    os.set_blocking(fd, True)
    fh = os.fdopen(fd, "rb")
    try:
        tar = tarfile.open(fileobj=fh, mode="r:", tarinfo=BoundedTarInfo)
        members = {}
        while True:
            tar.sandman_headers = 0
            member = tar.next()
            if member is None:
                break
            if len(tar.members) > limits.archive_members:
                raise fatal("image %r: the archive has more than %d members: refused"
                            % (image, limits.archive_members))
            members[member.name] = member

        def extract(name: object, what: str) -> BinaryIO:
            member = members.get(name) if isinstance(name, str) else None
            if member is None:
                raise fatal("image %r is not a docker save archive: no %s %r" % (image, what, name))
            try:
                found = tar.extractfile(member)
            except (KeyError, RecursionError, tarfile.TarError) as exc:
                raise fatal("image %r: %s %r: %s" % (image, what, name, exc)) from exc
            if found is None:
                raise fatal("image %r: %s %r is not a file of the archive" % (image, what, name))
            return found

        def small(name: object, what: str) -> bytes:
            stream = VerifiedStream(extract(name, what), None, None, limits.json_bytes,
                                    "%s %r" % (what, name))
            out = io.BytesIO()
            _refusing(image, lambda: check_blob(stream, None, None, None, limits, what, out))
            return out.getvalue()
        listing = json.loads(small("manifest.json", "manifest"))
        if not isinstance(listing, list) or not listing or not isinstance(listing[0], dict):
            raise fatal("image %r is not a docker save archive: manifest.json is no list of "
                        "images" % image)
        manifest = listing[0]
        config_raw = small(manifest.get("Config"), "config")
        config = _json(config_raw, image, "config")
        names = manifest.get("Layers")
        if not isinstance(names, list):
            raise fatal("image %r: manifest.json's Layers is not a list" % image)
        diff_ids = _diff_ids(config, len(names), image)
        verified = Verified(image, "sha256:" + hashlib.sha256(config_raw).hexdigest(), config,
                            config_raw, limits=limits)
        for number, (name, diff_id) in enumerate(zip(names, diff_ids)):
            opener = (lambda n=name: extract(n, "layer"))
            verified.layers.append(("layer %d (%s)" % (number + 1, name), None,
                                    None, diff_id, opener))
    except (ValueError, EOFError, RecursionError, tarfile.TarError) as exc:
        fh.close()
        raise fatal("image %r is not a docker save archive: %s" % (image, exc)) from exc
    except LayerRefused as exc:
        fh.close()
        raise fatal("image %r: %s: refused" % (image, exc)) from exc
    except BaseException:
        fh.close()
        raise
    verified.close = fh.close
    return verified
