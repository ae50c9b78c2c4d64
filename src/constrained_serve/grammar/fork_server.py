"""Grammar workers forked from a server that imported their backend once.

A worker started as ``python -m constrained_serve.grammar.worker_process`` pays an interpreter
and its backend's imports: about 0.8 s of CPU for llguidance, 3.5-4.6 s for xgrammar (which
imports torch and transformers). An engine starts a compile and a mask worker per backend
(up to 8 mask workers on a GPU machine), starts a new one after each runaway it kills, and a
process may build several engines (a notebook, the tests). The first xgrammar request
waited about 9 s for its two workers, one after the other.

So the first worker of a backend starts its fork server (``python -m
constrained_serve.grammar.fork_server BACKEND PARENT FD``), a single-threaded process that
imports the backend and then forks one worker per request: a few milliseconds each. The
child runs ``worker_process.main`` as a spawned worker does, on the file descriptors the
engine sends with the request (its socket, progress page, bitmask and stderr pipe, as
SCM_RIGHTS) and in the request's environment. Fork is safe here because the server has no
other thread when it forks (it checks, and starts none; ``OMP_NUM_THREADS=1`` keeps OpenBLAS
and torch from starting pools at import); forking the engine itself would not be.

One server per backend and process, shared by the process's engines (the engine's side:
forked_workers.py). It dies with the process (PR_SET_PDEATHSIG, its loop watches its parent,
and the closed socket ends it), and its workers die with it. It reaps its workers and
reports their exit codes to the engine.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from typing import Any

from . import worker_process

MAX_MESSAGE = 1 << 20  # a request carries the worker's environment


def _preload(backend: str) -> None:
    """What every worker of ``backend`` imports, imported once here."""
    from . import host  # noqa: F401

    if backend == "llguidance":
        from . import llguidance  # noqa: F401
    elif backend == "xgrammar":
        from . import xgrammar  # noqa: F401
    else:
        raise ValueError(f"unknown grammar backend {backend!r}")


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def serve(backend: str, parent: int, ctl_fd: int) -> None:
    ctl = socket.socket(fileno=ctl_fd)
    worker_process.exit_with_parent(parent)  # no watch thread here: the loop below watches, fork needs one thread
    try:
        _preload(backend)
        if _threads() != 1:  # fork would copy a process whose other threads may hold locks
            raise RuntimeError(f"{_threads()} threads after importing {backend}; fork needs one")
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which spawns instead
        ctl.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        os._exit(1)

    def reap(_signum: int = 0, _frame: Any = None) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            try:
                ctl.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                os._exit(0)

    signal.signal(signal.SIGCHLD, reap)
    ctl.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        if os.getppid() != parent:
            os._exit(0)
        if not select.select([ctl], [], [], 1.0)[0]:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, MAX_MESSAGE, 8)
        except OSError:
            os._exit(0)
        if not msg:  # the engine's process closed its end: done
            os._exit(0)
        _fork_worker(ctl, json.loads(msg), fds)


def _fork_worker(ctl: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    *worker_fds, stderr_fd = fds
    server = os.getpid()
    pidfd, error = -1, None
    # SIGCHLD held until the pidfd is open: a worker that dies at once is not reaped (and its
    # pid reused) before then.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        pid = os.fork()
        if pid == 0:
            _run_worker(ctl, request["env"], server, worker_fds, stderr_fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            os.kill(pid, signal.SIGKILL)
            error = f"pidfd_open: {e}"
    except OSError as e:
        error = f"fork: {e}"
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for fd in fds:
            os.close(fd)
    if error is not None:
        ctl.send(json.dumps({"error": error}).encode())
        return
    try:
        socket.send_fds(ctl, [json.dumps({"forked": pid}).encode()], [pidfd])
    finally:
        os.close(pidfd)


def _run_worker(ctl: socket.socket, env: dict[str, str], server: int, fds: list[int], stderr_fd: int) -> None:
    """In the forked child: become a grammar worker; never returns."""
    code = 1
    try:
        ctl.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(stderr_fd, 2)
        os.close(null)
        os.close(stderr_fd)
        os.environ.clear()
        os.environ.update(env)
        worker_process.main([str(server)] + [str(f) for f in fds])
        code = 0
    except BaseException:  # noqa: BLE001 - its last words go to the engine's log
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    # As a worker does: Ctrl-C reaches the whole foreground group, and the engine decides
    # what it means. Its workers inherit this.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
