"""Grammar workers forked from one server per backend (grammar/fork_server.py, grammar/forked_workers.py): the workers
of every manager of a process share it, an exit code reaches the engine, a killed server is
replaced and takes its workers with it, and with the server switched off workers are spawned
as before. Real workers and backends throughout."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from constrained_serve.grammar import GrammarManager, make_output_spec
from constrained_serve.grammar.forked_workers import ENV, ForkedWorker

MODEL_VOCAB = 49152

pytestmark = pytest.mark.timeout(120)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def working(mgr: GrammarManager, backend: str) -> bool:
    h = mgr.new_matcher(mgr.compile(make_output_spec(regex="[0-9]{2}"), backend))
    return mgr.advance([(h, [], 4, ())])[0] is not None


def test_the_workers_of_every_manager_are_forked_by_one_server(tokenizer):
    managers = [GrammarManager(tokenizer, MODEL_VOCAB, mask_threads=1) for _ in range(2)]
    try:
        for m in managers:
            assert working(m, "llguidance")
        pids = [p for m in managers for p in m.worker_pids()]
        assert len(pids) == 4  # a compile and a mask worker each
        [server] = {parent_of(p) for p in pids}
        assert parent_of(server) == os.getpid() and "fork_server llguidance" in cmdline(server)
        clients = [c for m in managers for c in m.workers.maskers_for("llguidance")]
        assert all(isinstance(c._proc, ForkedWorker) for c in clients)
    finally:
        for m in managers:
            m.close()
    assert all(gone(p) for p in pids)  # closed managers kill their workers; the server stays
    assert not gone(server, timeout=0.2)


def test_exit_codes_reach_the_engine(tokenizer):
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, mask_threads=1)
    try:
        assert working(mgr, "llguidance")
        [client] = mgr.workers.maskers_for("llguidance")
        proc = client._proc
        client._conn.close()  # the engine's end closed: the worker returns from its loop, exit 0
        client._conn = None
        assert proc.wait(timeout=10) == 0
        assert working(mgr, "llguidance")  # a new worker in its place
        [client] = mgr.workers.maskers_for("llguidance")
        proc = client._proc
        os.kill(proc.pid, signal.SIGKILL)  # from outside: the server reaps it and says how it ended
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        mgr.close()


def test_a_killed_server_takes_its_workers_and_is_replaced(tokenizer):
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, mask_threads=1)
    try:
        assert working(mgr, "llguidance")
        workers = mgr.worker_pids()
        [server] = {parent_of(p) for p in workers}
        os.kill(server, signal.SIGKILL)
        assert all(gone(p) for p in workers), "a worker outlived its fork server"
        assert working(mgr, "llguidance")  # new workers, from a new server
        [new_server] = {parent_of(p) for p in mgr.worker_pids()}
        assert new_server != server and "fork_server llguidance" in cmdline(new_server)
    finally:
        mgr.close()


def test_switched_off_the_workers_are_spawned(tokenizer, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, mask_threads=1)
    try:
        assert working(mgr, "llguidance")
        pids = mgr.worker_pids()
        assert pids and all(parent_of(p) == os.getpid() and "worker_process" in cmdline(p) for p in pids)
    finally:
        mgr.close()
