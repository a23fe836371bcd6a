"""The snapshots of a NodeAgent (``agent.py``): a sandbox's writable layer copied
into this node's store (``snapshots.py``) at one moment, listed, sent to another node's
agent and deleted. A mixin of NodeAgent, which owns the state it reads: ``sandboxes``,
``snapshot_store``, ``snapshot_bytes``, ``capturing`` (the capture threads),
``captures``, ``fetching``, ``closed``, ``pool`` and ``node_id``."""

import asyncio
import os
from typing import List

from sandman_ray.errors import NotSupported
from sandman_ray.providers.base import SnapshotInfo, fatal, transient


class AgentSnapshots:
    """See the module's docstring."""

    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        """Copy the sandbox's writable layer as snapshot ``name`` of this pool
        (providers/local/snapshots.py), the sandbox frozen meanwhile so the copy is of
        one moment (it runs on afterwards; a sandbox the user paused stays paused)."""
        from sandman_ray.providers.local.snapshots import check_name, not_supported, unsupported_why
        sandbox = self._sandbox(sandbox_id, "snapshot")
        try:
            check_name(name)
        except ValueError as exc:
            raise fatal(str(exc)) from None
        if unsupported_why(sandbox) is not None:
            raise not_supported(sandbox)
        if sandbox.cgroups is None or not sandbox.cgroups.can_freeze:
            raise NotSupported("snapshot of sandbox %s needs a freezer cgroup to copy its "
                               "files at one moment, which this host does not give it"
                               % sandbox_id)
        async with self._lock(sandbox_id):  # no pause, resume, reset or capture meanwhile
            if self.closed or self.sandboxes.get(sandbox_id) is not sandbox:
                raise fatal("snapshot: sandbox %s is gone" % sandbox_id)
            task = asyncio.get_running_loop().run_in_executor(
                self.capturing, self._capture, sandbox, name)
            self.captures.add(task)
            try:
                return await asyncio.shield(task)
            finally:
                self.captures.discard(task)

    def _capture(self, sandbox, name: str) -> SnapshotInfo:
        """On a capture thread: freeze (unless paused already), copy, thaw; a sandbox
        that cannot be frozen is not copied."""
        groups = sandbox.cgroups
        was_frozen = groups.frozen()
        if not was_frozen:
            try:
                groups.freeze()
            except OSError as exc:
                groups.thaw()
                raise transient("snapshot of sandbox %s: it could not be frozen: %s"
                                % (sandbox.sandbox_id, exc)) from exc
        try:
            upper = sandbox.open_upper()
            try:
                return self.snapshot_store.capture(
                    upper, name, sandbox.ids.base if sandbox.ids is not None else 0,
                    sandbox.image, sandbox.sandbox_id, self.node_id,
                    self.snapshot_store.room(self.snapshot_bytes))
            finally:
                os.close(upper)
        finally:
            if not was_frozen:
                groups.thaw()

    async def snapshots(self) -> List[SnapshotInfo]:
        """The pool's snapshots this node holds (taken here, or brought here), each
        with this node as its ``node_id``."""
        import dataclasses
        infos = await asyncio.get_running_loop().run_in_executor(None, self.snapshot_store.list)
        return [dataclasses.replace(info, node_id=self.node_id) for info in infos]

    async def export_snapshot(self, name: str) -> bytes:
        """Snapshot ``name`` as a tar, for the agent of another node (``fetch_snapshot``)."""
        return await asyncio.get_running_loop().run_in_executor(
            None, self.snapshot_store.export, name)

    async def fetch_snapshot(self, image: str, source) -> None:
        """Bring the snapshot ``image`` from the agent ``source`` into this node's store
        (its base first, when that is a snapshot too); at most one fetch per snapshot
        at a time, and none for one this node holds."""
        from sandman_ray.providers.local.snapshots import parse_ref
        _, name = parse_ref(image)
        if (self.snapshot_store.path(name) / "meta.json").exists():
            return
        await self.fetching.run(name, lambda: self._fetch(name, source))

    async def _fetch(self, name: str, source) -> None:
        from sandman_ray.providers.local.snapshots import archive_meta
        loop = asyncio.get_running_loop()
        data = await source.export_snapshot.remote(name)
        meta = archive_meta(data)
        if str(meta.get("base", "")).startswith("snapshot:"):
            await self.fetch_snapshot(meta["base"], source)
        await loop.run_in_executor(None, self.snapshot_store.import_tar, name, data)

    async def delete_snapshot(self, name: str) -> None:
        """Remove snapshot ``name``; SnapshotInUse while a sandbox of this agent runs
        from it (its overlay reads the layer) or another snapshot stacks on it."""
        from sandman_ray.errors import SnapshotInUse
        from sandman_ray.providers.local.snapshots import image_ref
        ref = image_ref(self.pool, name)
        layer = self.snapshot_store.path(name) / "layer"
        users = sorted(sid for sid, sb in self.sandboxes.items() if layer in sb.image.layers)
        if users:
            raise SnapshotInUse("snapshot %s: sandbox(es) %s still run from it"
                                % (ref, ", ".join(users)))
        await asyncio.get_running_loop().run_in_executor(None, self.snapshot_store.delete, name)
