"""The grammar worker processes of a ``GrammarManager`` (manager.py), and what they hold.

Per backend, compile workers (up to ``max_compilers``, checked out by one compile or output
check at a time) and ``mask_workers`` mask workers (each holding some of the requests'
matchers, and mapping the shared step bitmask they write mask rows into). The pool keeps
which compiled grammars (gids) each worker holds in its current epoch (a restart empties
it), which matchers live on which worker (``Live``), and the drops and unloads owed to each
worker: a released matcher is dropped, and a grammar retired from the cache is unloaded once
its last matcher goes, ahead of the worker's next batch (``owed_to``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any

from ..params import OutputSpec
from .host import InlineClient
from .shared_memory import SharedBitmask
from .tokenizer_data import TokenizerData
from .worker import WorkerClient

__all__ = ["Live", "WorkerPool", "portable"]


class Live:
    """A matcher's place in the workers (shared with its handle's finalizer)."""

    __slots__ = ("mid", "gid", "client", "epoch", "released")

    def __init__(self, mid: int, gid: int, client: Any):
        self.mid, self.gid, self.client = mid, gid, client
        self.epoch = 0  # the worker epoch its matcher was created in (0: not yet)
        self.released = False


def portable(spec: OutputSpec) -> OutputSpec:
    """The spec without its Python type (a user's class need not be importable in a worker)."""
    return dataclasses.replace(spec, python_type=None) if spec.python_type is not None else spec


class WorkerPool:
    """The compile and mask workers of each backend, started on first use; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        tokenizer_data: TokenizerData,
        bitmask: SharedBitmask,
        backend_options: dict[str, dict[str, Any]],
        isolation: str = "process",
        max_compilers: int = 2,
        mask_workers: int = 2,
    ):
        self._tokenizer = tokenizer  # the Hugging Face one: xgrammar builds its vocabulary from it
        self._tokenizer_data = tokenizer_data
        self._backend_options = backend_options
        self._isolation = isolation
        self.max_compilers = max_compilers
        self.mask_workers = mask_workers
        # The memory the mask workers map and write mask rows into (map_bitmask replaces it);
        # the pool closes it with its workers.
        self.bitmask = bitmask
        self._lock = threading.RLock()  # the workers, the registries
        self._idle = threading.Condition(self._lock)
        self._compilers: dict[str, list[Any]] = {}
        self._idle_compilers: dict[str, list[Any]] = {}
        self.maskers: dict[str, list[Any]] = {}  # the mask workers of each backend started so far
        self._next_masker: dict[str, int] = {}
        self._tokenizers: dict[str, TokenizerData] = {}
        # gids each worker holds, as of its current epoch; gids retired from the cache, and
        # live matchers per gid (a retired gid is unloaded when its last matcher goes).
        self._loaded: dict[Any, tuple[int, set[int]]] = {}
        self._retired: set[int] = set()
        self._live_per_gid: collections.Counter = collections.Counter()
        self._released: collections.deque[Live] = collections.deque()  # appended by finalizers too
        self._queued: dict[Any, list[tuple]] = collections.defaultdict(list)
        self._mids = itertools.count(1)

    # -- workers -------------------------------------------------------------------------
    def _tokenizer_for(self, name: str) -> TokenizerData:
        with self._lock:
            data = self._tokenizers.get(name)
            if data is None:
                data = self._tokenizer_data
                if name == "xgrammar":
                    data = data.with_xgrammar_info(self._tokenizer)
                self._tokenizers[name] = data
            return data

    def _client(self, name: str, label: str, bitmask: SharedBitmask | None) -> Any:
        cls = WorkerClient if self._isolation == "process" else InlineClient
        return cls(name, self._tokenizer_for(name), self._backend_options.get(name, {}), bitmask, label)

    def maskers_for(self, name: str) -> list[Any]:
        """The backend's mask workers (made, not started, on first use)."""
        with self._lock:
            clients = self.maskers.get(name)
            if clients is None:
                clients = self.maskers[name] = [
                    self._client(name, f"{name} mask #{i}", self.bitmask) for i in range(self.mask_workers)
                ]
            return clients

    def checkout_compiler(self, name: str, start: bool = False) -> Any:
        """An idle compile worker of the backend, for the caller alone until
        ``release_compiler``; waits while all ``max_compilers`` are busy."""
        with self._idle:
            while True:
                idle = self._idle_compilers.setdefault(name, [])
                if idle:
                    client = idle.pop()
                    break
                clients = self._compilers.setdefault(name, [])
                if len(clients) < self.max_compilers:
                    client = self._client(name, f"{name} compile #{len(clients)}", None)
                    clients.append(client)
                    break
                self._idle.wait()
        if start:
            try:
                client.start()
            except BaseException:
                self.release_compiler(name, client)
                raise
        return client

    def release_compiler(self, name: str, client: Any) -> None:
        with self._idle:
            self._idle_compilers[name].append(client)
            self._idle.notify()

    def start_backend(self, name: str) -> None:
        """Start a compile worker and the mask workers of the backend (a warm-up)."""
        self.release_compiler(name, self.checkout_compiler(name, start=True))
        for c in self.maskers_for(name):
            c.start()

    def kill_maskers(self) -> None:
        """Kill every mask worker; its matchers are rebuilt in the next one on next use."""
        with self._lock:
            clients = [c for cs in self.maskers.values() for c in cs]
        for c in clients:
            c.kill()

    def map_bitmask(self, bitmask: SharedBitmask) -> None:
        """The mask workers write into ``bitmask`` from now on: they are restarted to map it
        (their matchers are rebuilt on next use), and the old one is closed."""
        with self._lock:
            old, self.bitmask = self.bitmask, bitmask
            for clients in self.maskers.values():
                for c in clients:
                    c.kill()
                    c.bitmask = bitmask
            old.close()

    def worker_pids(self) -> list[int]:
        with self._lock:
            clients = [c for cs in list(self._compilers.values()) + list(self.maskers.values()) for c in cs]
        return [c.pid for c in clients if c.alive and c.pid is not None]

    def close(self) -> None:
        """Close every worker and the bitmask (also the manager's finalizer: must not refer
        back to the manager)."""
        for clients in list(self._compilers.values()) + list(self.maskers.values()):
            for c in clients:
                c.close()
        self.bitmask.close()

    # -- what the workers hold -----------------------------------------------------------
    def loaded_in(self, client: Any) -> set[int]:
        """The gids ``client`` holds in its current epoch (a restart empties it)."""
        with self._lock:
            epoch, gids = self._loaded.get(client, (-1, set()))
            if epoch != client.epoch:
                gids = set()
                self._loaded[client] = (client.epoch, gids)
            return gids

    def place_matcher(self, backend: str, gid: int) -> Live:
        """A new matcher of grammar ``gid``'s place: the backend's next mask worker in turn."""
        clients = self.maskers_for(backend)
        with self._lock:
            i = self._next_masker.get(backend, 0)
            self._next_masker[backend] = (i + 1) % len(clients)
            live = Live(next(self._mids), gid, clients[i])
            self._live_per_gid[gid] += 1
        return live

    def release(self, live: Live) -> None:
        """The matcher is done with (thread-safe, also from a finalizer): its worker drops it later."""
        self._released.append(live)

    def owed_to(self, client: Any) -> list[tuple]:
        """Drops and unloads owed to ``client``, sent ahead of its next batch."""
        with self._lock:
            while self._released:
                live = self._released.popleft()
                if live.released:
                    continue
                live.released = True
                if live.epoch == live.client.epoch and live.epoch:
                    self._queued[live.client].append(("drop", live.mid))
                self._live_per_gid[live.gid] -= 1
                if self._live_per_gid[live.gid] <= 0:
                    del self._live_per_gid[live.gid]
                    if live.gid in self._retired:
                        self._unload(live.gid)
            return self._queued.pop(client, [])

    def retire(self, gid: int) -> None:
        """``gid`` leaves the workers once no matcher uses it."""
        with self._lock:
            self._retired.add(gid)
            if self._live_per_gid[gid] == 0:
                self._unload(gid)

    def _unload(self, gid: int) -> None:
        for client, (epoch, gids) in list(self._loaded.items()):
            if gid in gids and epoch == client.epoch:
                gids.discard(gid)
                self._queued[client].append(("unload", gid))
        self._retired.discard(gid)
