"""The engine's side of forked grammar workers: ``start_worker`` asks the backend's fork
server (fork_server.py, which has the why) for a worker, or spawns one where it cannot.

One server per backend and process, shared by the process's engines, started by the first
worker of its backend. The engine holds a pidfd per forked worker (``ForkedWorker``, with the
part of ``subprocess.Popen`` the worker client uses): poll, wait and kill go through it, so a
reused pid is never signalled; the server reports its workers' exit codes. Where any of this
is missing (not Linux, no pidfd, a server that cannot start), or with
``CONSTRAINED_SERVE_FORK_SERVER=0``, workers are spawned as before.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from . import launcher
from .fork_server import MAX_MESSAGE

logger = logging.getLogger(__name__)

__all__ = ["ForkServer", "ForkServerError", "ForkedWorker", "fork_server_enabled", "start_worker"]

ENV = "CONSTRAINED_SERVE_FORK_SERVER"


class ForkServerError(OSError):
    """The fork server could not start, or could not fork a worker."""


def fork_server_enabled() -> bool:
    return (
        sys.platform == "linux"
        and hasattr(os, "pidfd_open")
        and hasattr(signal, "pidfd_send_signal")
        and os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")
    )


def start_worker(backend: str, fds: list[int]) -> Any:
    """A grammar worker process for ``backend`` on ``fds`` (socket, progress page[, bitmask]):
    forked by the backend's server where it can be, else spawned. Returns a ``Popen`` or a
    ``ForkedWorker``; either has ``pid``, ``poll``, ``kill``, ``wait``, ``returncode`` and
    ``stderr``."""
    env = launcher.worker_env()
    if fork_server_enabled():
        for attempt in (1, 2):  # a server that died (killed from outside) is started again once
            try:
                return ForkServer.for_backend(backend).fork(fds, env)
            except ForkServerError as e:
                logger.debug("%s fork server (attempt %d): %s", backend, attempt, e)
        logger.info("the %s fork server is not available: starting its grammar worker afresh", backend)
    argv = [sys.executable, "-m", "constrained_serve.grammar.worker_process", str(os.getpid())] + [str(f) for f in fds]
    return launcher.popen(
        argv, pass_fds=fds, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


class ForkServer:
    """The engine's side of one backend's fork server: ``fork`` asks it for a worker."""

    _servers: dict[str, ForkServer] = {}
    _servers_lock = threading.Lock()

    @classmethod
    def for_backend(cls, backend: str, start_timeout_s: float = 120.0) -> ForkServer:
        with cls._servers_lock:
            server = cls._servers.get(backend)
            # A copy of this process made by fork() must not share its parent's server.
            if server is None or server.owner != os.getpid() or not server.alive:
                if server is not None and server.owner == os.getpid():
                    server.close()
                server = cls._servers[backend] = cls(backend, start_timeout_s)
            return server

    def __init__(self, backend: str, start_timeout_s: float = 120.0):
        self.backend = backend
        self.owner = os.getpid()
        self._lock = threading.Lock()  # one request (and its reply) at a time
        self._exits: dict[int, int] = {}  # exit codes the server reported, by worker pid
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "constrained_serve.grammar.fork_server", backend, str(os.getpid())]
        try:
            self._proc = launcher.popen(
                argv + [str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=launcher.worker_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as e:
            ours.close()
            raise ForkServerError(f"cannot start: {e}") from e
        finally:
            theirs.close()
        launcher.start_stderr_thread(self._proc.stderr, f"{backend} fork server", self._proc.pid)
        self._sock = ours
        started = time.monotonic()
        try:
            reply, _ = self._receive(start_timeout_s)
        except ForkServerError as e:
            self.close()
            raise ForkServerError(f"did not start: {e}") from e
        if "ready" not in reply:
            self.close()
            raise ForkServerError(f"did not start: {reply.get('error', reply)}")
        logger.debug("%s fork server ready in %.1f s (pid %d)", backend, time.monotonic() - started, self._proc.pid)

    @property
    def alive(self) -> bool:
        return self._sock is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def fork(self, fds: list[int], env: dict[str, str], timeout_s: float = 60.0) -> ForkedWorker:
        """A worker running ``worker_process.main`` on ``fds`` in ``env``."""
        read_end, write_end = os.pipe()  # the worker's stderr, for the engine's logging
        try:
            with self._lock:
                if self._sock is None:
                    raise ForkServerError("closed")
                try:
                    socket.send_fds(self._sock, [json.dumps({"env": env}).encode()], [*fds, write_end])
                except OSError as e:
                    self.close()
                    raise ForkServerError(f"is gone ({e})") from e
                reply, pidfds = self._receive(timeout_s)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        if "forked" not in reply or len(pidfds) != 1:
            for fd in pidfds:
                os.close(fd)
            os.close(read_end)
            raise ForkServerError(f"could not fork a worker: {reply.get('error', reply)}")
        return ForkedWorker(reply["forked"], pidfds[0], os.fdopen(read_end, "rb"), self)

    def exit_code(self, pid: int, timeout_s: float) -> int | None:
        """The exit code of worker ``pid`` (which has exited), as the server reports it."""
        end = time.monotonic() + timeout_s
        with self._lock:
            while pid not in self._exits and self._sock is not None:
                if not select.select([self._sock], [], [], max(0.0, end - time.monotonic()))[0]:
                    break
                try:
                    self._read()
                except ForkServerError:
                    break
            return self._exits.pop(pid, None)

    def _receive(self, timeout_s: float) -> tuple[dict[str, Any], list[int]]:
        """The next reply that is not an exit report; under the lock (or before the server
        is shared)."""
        end = time.monotonic() + timeout_s
        while True:
            if not select.select([self._sock], [], [], max(0.0, end - time.monotonic()))[0]:
                raise ForkServerError(f"no answer within {timeout_s:g} s")
            reply, fds = self._read()
            if "exit" not in reply:
                return reply, fds

    def _read(self) -> tuple[dict[str, Any], list[int]]:
        """One message from the server; a worker's exit report is recorded."""
        try:
            msg, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
        except OSError as e:
            self.close()
            raise ForkServerError(f"is gone ({e})") from e
        if not msg:
            self.close()
            raise ForkServerError(f"exited (code {self._proc.poll()})")
        reply = json.loads(msg)
        if "exit" in reply:
            self._exits[reply["exit"]] = reply["code"]
        return reply, fds

    def close(self) -> None:
        """Stop the server (its workers die with it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class ForkedWorker:
    """A forked worker, as the worker client uses a ``subprocess.Popen``. Thread-safe: the
    pidfd is closed once, under the lock, never while another thread waits on it."""

    def __init__(self, pid: int, pidfd: int, stderr: Any, server: ForkServer):
        self.pid = pid
        self.stderr = stderr
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._server = server
        self._killed = False
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
                self._exited()
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                if not select.select([self._pidfd], [], [], timeout)[0]:
                    raise subprocess.TimeoutExpired(f"grammar worker {self.pid}", timeout)
                self._exited()
            return self.returncode

    def kill(self) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                    self._killed = True
                except ProcessLookupError:  # exited already
                    pass

    def _exited(self) -> None:
        code = self._server.exit_code(self.pid, timeout_s=0.5)
        if code is None:  # the server did not say (it died too): what is known
            code = -signal.SIGKILL if self._killed else -1
        self.returncode = code
        fd, self._pidfd = self._pidfd, -1
        os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_pidfd", -1)
        if fd >= 0:
            self._pidfd = -1
            try:
                os.close(fd)
            except OSError:
                pass
