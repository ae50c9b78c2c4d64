"""``constrained-serve extract --ray``: the extraction job on a local Ray cluster (2 CPUs,
2 engine replicas of a tiny model), checked against the local CLI, under actor and driver
kills and Ctrl-C, with bad cluster addresses.

One cluster for the module (starting Ray costs seconds); its processes are checked gone
when the module ends. The driver runs in subprocesses (Ctrl-C, SIGKILL) join that cluster
by its address, as a user's jobs join a running cluster. Every Ray Data run starts its
actors afresh (a process, torch, the model: the cost of each run here), so the tests run
as few as what they check needs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

try:
    import ray
except ImportError:  # make setup installs it; a missing Ray is a failure, not a skip
    pytest.fail("Ray is not installed: pip install 'constrained-serve[ray]' (make setup does)", pytrace=False)

from constrained_serve.cli import main  # noqa: E402
from constrained_serve.ray.session import start_local_cluster  # noqa: E402

from ..helpers import EXAMPLES, SHORT_SCHEMA, subprocess_env  # noqa: E402

REPLICA_CLASS = "ExtractReplica"  # a file job's replica actors (replica_pool.py)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def cluster():
    start_local_cluster(ray, num_cpus=2, logging_level="ERROR")  # as the CLI starts one
    node = ray._private.worker._global_node
    pids = [p.process.pid for procs in node.all_processes.values() for p in procs]
    yield ray
    ray.shutdown()
    assert _wait_gone(pids) == [], "Ray processes left after ray.shutdown()"


def input_lines(n: int = 12) -> list[str]:
    topics = ["a late parcel", "a broken screen", "a double charge", "a refund", "a cancelled flight"]
    lines = [
        json.dumps({"id": f"t{i}", "text": f"Ticket {i}: the customer writes about {topics[i % 5]}."}) for i in range(n)
    ]
    lines.insert(3, "{not json")
    lines.insert(5, json.dumps({"id": "t1", "text": "the id of line 2 again"}))  # duplicate id
    lines.insert(7, "")  # blank: no row, but it counts for line numbers
    lines.insert(8, json.dumps({"text": "no id: keyed by its line"}))
    lines.insert(9, json.dumps(["not", "an", "object"]))
    lines.insert(10, json.dumps({"id": "t-missing", "body": "no text field"}))
    return lines


def write_input(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def without_cache_counts(rows: list[dict]) -> list[dict]:
    return [
        {**r, "usage": {k: v for k, v in r["usage"].items() if k != "cached_tokens"}} if "usage" in r else r
        for r in rows
    ]


def row_key(row: dict) -> str:
    return f"line {row['line']}" if "line" in row else json.dumps(row["id"])


def expected_keys(lines: list[str]) -> list[str]:
    """The resume key of every non-blank line: exactly one row each."""
    keys, seen = [], set()
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("id"), str) and json.dumps(rec["id"]) not in seen:
            seen.add(json.dumps(rec["id"]))
            keys.append(json.dumps(rec["id"]))
        else:
            keys.append(f"line {no}")
    return keys


def common_args(model: Path, max_tokens: int = 12) -> list[str]:
    # One torch thread both locally and per replica: the same float sums, so greedy outputs
    # match token for token.
    return ["--model", str(model), "--max-tokens", str(max_tokens), "--threads", "1", "-q"]


# Set-up errors first: the auto-address test needs no cluster running yet.


def test_auto_address_without_a_cluster_is_a_setup_error(tmp_path) -> None:
    """``--ray-address auto`` finds no cluster: exit 2 naming --ray-address (Ray's message
    names an --address flag we do not have), no output file. Run before the module's
    cluster starts, in a subprocess with its own Ray temp dir. Another cluster running on
    this machine fails it with what to stop (Ray's "auto" would find and join it): a skip
    would pass without testing anything."""
    from ray._private.services import find_gcs_addresses

    if ray.is_initialized() or find_gcs_addresses():
        pytest.fail(
            "a Ray cluster is running on this machine ('ray status' shows it; stop it with 'ray stop'): "
            "'--ray-address auto' would join it, so this test cannot check the no-cluster error"
        )
    src = write_input(tmp_path / "in.jsonl", input_lines(2))
    out = tmp_path / "out.jsonl"
    env = {**subprocess_env(), "RAY_TMPDIR": str(tmp_path / "ray")}
    env.pop("RAY_ADDRESS", None)
    argv = [sys.executable, "-m", "constrained_serve.cli", "extract", str(src), "-o", str(out), "--ray"]
    done = subprocess.run(argv + ["--ray-address", "auto"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--ray-address auto: no running Ray cluster was found" in done.stderr, done.stderr
    assert "rows written so far" not in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_bad_addresses_fail_fast_with_exit_2_and_no_output(tmp_path, capsys) -> None:
    """Nothing listening at --ray-address: Ray's own retries took over 5 minutes. Now a
    set-up error (exit 2) within seconds, naming our flag, leaving no output file."""
    src = write_input(tmp_path / "in.jsonl", input_lines(2))
    out = tmp_path / "out.jsonl"
    started = time.perf_counter()
    assert main(["extract", str(src), "-o", str(out), "--ray", "--ray-address", "127.0.0.1:1", "-q"]) == 2
    took = time.perf_counter() - started
    err = capsys.readouterr().err
    assert took < 30 and "--ray-address 127.0.0.1:1: no Ray cluster answers" in err and "connection refused" in err
    assert "--address" not in err.replace("--ray-address", "") and "rows written so far" not in err
    assert not out.exists()


def test_ray_flags_need_ray_and_a_missing_ray_fails_at_once(tmp_path, capsys, monkeypatch) -> None:
    src = write_input(tmp_path / "in.jsonl", input_lines(2))
    out = tmp_path / "out.jsonl"
    assert main(["extract", str(src), "-o", str(out), "--replicas", "2"]) == 2
    assert "only apply with --ray" in capsys.readouterr().err
    # Ray not installed: importing it fails (None in sys.modules makes `import ray` raise).
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)
    from constrained_serve.ray import RayNotInstalledError, extract

    started = time.perf_counter()
    assert main(["extract", str(src), "-o", str(out), "--ray"]) == 2
    assert "pip install 'constrained-serve[ray]'" in capsys.readouterr().err
    assert time.perf_counter() - started < 1.0 and not out.exists()
    with pytest.raises(RayNotInstalledError, match=r"constrained-serve\[ray\]"):
        extract(src, out)


def test_ray_options_refuse_bad_values_and_plan_a_batch_for_every_replica() -> None:
    from constrained_serve.ray.pipeline import RayOptions, plan_pool

    for bad in ({"replicas": 0}, {"batch_size": 0}, {"max_batch_retries": -1}, {"replica_start_timeout_s": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RayOptions(**bad)
    # 36 rows on 2 CPU replicas of a 2-CPU cluster: 2 batches of 18, one core each, all fit.
    plan = plan_pool({"CPU": 2.0}, RayOptions(replicas=2), 36)
    assert (plan.replicas, plan.batch_size, plan.num_cpus, plan.threads, plan.all_fit) == (2, 18, 1.0, 1, True)
    # 3 replicas on 2 CPUs do not fit: batches go out as replicas start.
    assert not plan_pool({"CPU": 2.0}, RayOptions(replicas=3), 36).all_fit
    # GPUs: one replica per GPU by default, 1 CPU each.
    gpu = plan_pool({"CPU": 16.0, "GPU": 4.0}, RayOptions(), 1000)
    assert (gpu.replicas, gpu.num_gpus, gpu.num_cpus, gpu.threads, gpu.batch_size) == (4, 1.0, 1.0, None, 250)


def test_replicas_of_a_cluster_started_here_run_at_the_drivers_priority(cluster) -> None:
    """Not Ray's nice 15, at which any other busy process on the machine starves them."""

    @ray.remote(num_cpus=1)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray.get(niceness.remote(), timeout=120) == os.getpriority(os.PRIO_PROCESS, 0)


def test_ray_rows_equal_local_rows_and_every_replica_gets_rows(cluster, tiny_llama_dir, tmp_path, capsys) -> None:
    lines = input_lines()
    src = write_input(tmp_path / "in.jsonl", lines)
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["extract", str(src), "-o", str(local)] + common_args(tiny_llama_dir)) == 0
    # The default batch size: rows / replicas, 2 batches of 9 here. Ray Data used to queue
    # both on the replica whose model loaded first (the 36 demo rows all went to one of 2);
    # a tiny model's batch takes a second, so without waiting for both replicas to be up the
    # first would have taken the second batch too.
    argv = ["extract", str(src), "-o", str(on_ray), "--ray", "--replicas", "2"]
    capsys.readouterr()
    assert main(argv + common_args(tiny_llama_dir)[:-1]) == 0  # not -q: the summary has each replica's rows
    per_replica = [int(n) for n in re.findall(r"^replica \w+: (\d+) rows", capsys.readouterr().err, re.M)]
    assert len(per_replica) == 2 and min(per_replica) > 0, per_replica
    # Ordered by default: the same rows, line for line (bad lines, duplicate ids, outputs,
    # token counts), but for cached_tokens: each replica warms its own prefix cache.
    got = rows(on_ray)
    assert without_cache_counts(got) == without_cache_counts(rows(local))
    assert sum(r["usage"]["cached_tokens"] for r in got if "usage" in r) > 0
    assert [row_key(r) for r in got] == expected_keys(lines)
    types = Counter(r["error"]["type"] for r in got if "error" in r)
    assert types["invalid_json"] == 1 and types["not_object"] == 1 and types["missing_field"] == 1
    assert sum(1 for r in got if "output" in r or r["error"]["type"] == "truncated") == 14

    # Rerun: everything is done; nothing is added.
    assert main(argv + common_args(tiny_llama_dir)) == 0
    assert rows(on_ray) == got


def test_python_entry_point_and_dataset_out(cluster, tiny_llama_dir, tmp_path) -> None:
    from constrained_serve.params import SamplingParams
    from constrained_serve.ray import RayJobStats, extract

    lines = input_lines(6)
    src = write_input(tmp_path / "in.jsonl", lines)
    # One replica, batches of 2 (rows across batches in order): each run starts its actors
    # afresh, and what two replicas do is checked above.
    kw = dict(model=str(tiny_llama_dir), engine_kwargs={"num_threads": 1}, replicas=1, batch_size=2)
    params = SamplingParams(max_tokens=8)
    stats = extract(src, tmp_path / "out.jsonl", params=params, **kw)
    assert isinstance(stats, RayJobStats) and stats.rows == len(expected_keys(lines))
    assert sum(r.rows for r in stats.replicas.values()) == stats.rows
    assert "replica " in stats.summary() and "valid rate" in stats.summary()
    written = rows(tmp_path / "out.jsonl")

    # A Dataset in and no output, so a lazy Dataset of rows out (one run for both: each run
    # starts its actors afresh). Rows are keyed by their own id; a record with the text of a
    # file line gets that line's row.
    by_id, first = {r["id"]: r for r in written if "line" not in r}, {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("id") in by_id and "text" in rec:
            first.setdefault(rec["id"], rec)
    records = list(first.values())
    assert len(records) >= 4
    ds = ray.data.from_items(records + [{"id": "extra", "text": "note 1"}, {"text": "no id"}])
    out = [json.loads(r["row"]) for r in extract(ds, params=params, **kw).take_all()]
    got = {r["id"]: r for r in out if r["id"] is not None}
    assert sorted(got) == sorted([rec["id"] for rec in records] + ["extra"])
    assert without_cache_counts([got[rec["id"]] for rec in records]) == without_cache_counts(
        [by_id[rec["id"]] for rec in records]
    )
    assert [r["error"]["type"] for r in out if r["id"] is None] == ["invalid_id"]


def test_progress_board_shows_rows_and_tokens_while_a_batch_decodes(cluster, tiny_llama_dir) -> None:
    """The job as the CLI runs it with a progress line (run_job with an activity()): while
    the one batch decodes, before any of its rows is written, activity() reads the replica's
    rows in flight and a growing token count from the job's board; once the job ends it
    reads (0, 0) and no board actor is left. A real replica, engine, board and cluster."""
    from constrained_serve import SamplingParams
    from constrained_serve.extract.inputs import InputItem
    from constrained_serve.ray.pipeline import RayOptions, run_job
    from constrained_serve.ray.progress_board import BoardActivity
    from constrained_serve.ray.replica import ReplicaConfig

    # 4 rows of 200 tokens: 2 s of decoding on 2 cores, 20 of the replica's 0.1 s reports.
    n, max_tokens = 4, 200
    items = [InputItem(i + 1, f"p{i}", messages=[{"role": "user", "content": f"row {i}"}]) for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # every row decodes max_tokens
    config = ReplicaConfig({"model": str(tiny_llama_dir), "num_threads": 1}, params, {}, False, progress_every_s=0.1)
    activity = BoardActivity(min_interval_s=0.0)
    seen: list[tuple[int, int]] = []  # activity() every 50 ms
    written: list[dict] = []
    first_row_at: list[int] = []  # len(seen) when the first row was written
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(activity())
            time.sleep(0.05)

    def write(row: dict) -> None:
        if not written:
            first_row_at.append(len(seen))
        written.append(row)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stats = run_job(items, write, config, RayOptions(replicas=1, batch_size=n), activity=activity)
    finally:
        stop.set()
        sampler.join()
    assert stats.rows == n and all(r["usage"]["completion_tokens"] == max_tokens for r in written)
    busy = [s for s in seen[: first_row_at[0]] if s != (0, 0)]
    assert busy, f"the board showed nothing before the first row: {seen}"
    assert max(rows for rows, _ in busy) == n and all(0 < rows <= n for rows, _ in busy), busy
    tokens = [t for _, t in busy]
    assert len(set(tokens)) >= 3 and tokens[0] < max(tokens) <= n * max_tokens, busy  # it grew as rows decoded
    assert activity() == (0, 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        a["ActorClassName"] == "ProgressBoard" and a["State"] != "DEAD" for a in ray._private.state.actors().values()
    ):
        time.sleep(0.1)
    boards = [a for a in ray._private.state.actors().values() if a["ActorClassName"] == "ProgressBoard"]
    assert boards and all(a["State"] == "DEAD" for a in boards), boards


def test_a_model_no_replica_can_load_is_a_setup_error(cluster, tmp_path, capsys) -> None:
    """As locally: exit 2, the loader's reason in one line, no output file. (The module's
    session prints its workers' logs, the replica's traceback among them; a CLI run's own
    session does not: the Ctrl-C test checks that output.)"""
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    src = write_input(tmp_path / "in.jsonl", input_lines(2))
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert main(["extract", str(src), "-o", str(out), "--ray"] + common_args(bad)) == 2
    err = capsys.readouterr().err
    assert not out.exists()
    ours = [line for line in err.splitlines() if line.startswith("constrained-serve:")]
    assert len(ours) == 1 and re.fullmatch(
        r"constrained-serve: error: no replica could start: its constructor raised ValueError: "
        r"Unrecognized model in .*model_type.*",
        ours[0],
    ), err


def test_the_replica_loop_orders_batches_survives_failures_and_gates_on_every_replica(cluster) -> None:
    """replica_pool's loop on real Ray actors of a stand-in class (no model: what is checked
    is the hand-out): batches come back in input order (ordered) or as they finish; a batch
    that raises yields None and the loop goes on; a replica whose constructor fails leaves
    the others the work, and none starting is an error; the first batch waits for every replica."""
    from constrained_serve.ray.replica_pool import PoolShape, ReplicaStartError, run_batches

    class Stub:
        def __init__(self, fail: bool = False):
            if fail:
                raise RuntimeError("no model here")
            self.started = time.time()

        def ready(self) -> str:
            return f"pid{os.getpid()}"

        def run(self, texts: list[str]) -> dict:
            if "raise" in texts:
                raise ValueError("this batch breaks")
            begun = time.time()
            time.sleep(float(texts[0]))
            return {"texts": texts, "pid": os.getpid(), "started": self.started, "begun": begun}

    stub = ray.remote(Stub).options(num_cpus=0)
    shape = PoolShape(2, 0, 0, wait_for_all=True, start_timeout_s=60, max_batch_retries=0)
    batches = [["1.5", "a"], ["0", "b"], ["raise"], ["0", "c"]]
    actors = [stub.remote(), stub.remote()]
    try:
        ordered = list(run_batches(ray, actors, batches, shape, ordered=True))
        assert [r and r["texts"] for r in ordered] == [batches[0], batches[1], None, batches[3]]
        assert len({r["pid"] for r in ordered if r}) == 2  # both replicas got batches
        # Gated: no batch ran before the later of the two replicas was up.
        assert min(r["begun"] for r in ordered if r) > max(r["started"] for r in ordered if r)
        unordered = list(run_batches(ray, actors, batches, shape, ordered=False))
        assert [r and r["texts"][-1] for r in unordered].index("a") > 0  # the slow batch came later
        assert sorted(str(r and r["texts"][-1]) for r in unordered) == ["None", "a", "b", "c"]
        # One replica cannot start: the other runs every batch.
        broken = [stub.remote(fail=True), stub.remote()]
        actors += broken
        one = list(run_batches(ray, broken, batches[:2] + batches[3:], shape, ordered=True))
        assert len({r["pid"] for r in one}) == 1 and [r["texts"][-1] for r in one] == ["a", "b", "c"]
        with pytest.raises(
            ReplicaStartError, match="^no replica could start: its constructor raised RuntimeError: no model here$"
        ):
            actors.append(stub.remote(fail=True))
            list(run_batches(ray, actors[-1:], batches, shape, ordered=True))
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_killed_replica_is_restarted_and_its_batch_retried(cluster, tiny_llama_dir, tmp_path) -> None:
    lines = input_lines(20)
    src = write_input(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    killed: list[int] = []

    def kill_one_replica() -> None:
        # Once rows flow, SIGKILL one replica's process: what the OOM killer or a lost node
        # does to an actor. (ray.kill needs a handle, which the job keeps to itself; the GCS
        # actor table gives the pid.)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if out.exists() and len(out.read_text().splitlines()) >= 4:
                alive = [
                    a
                    for a in ray._private.state.actors().values()
                    if a["ActorClassName"] == REPLICA_CLASS and a["State"] == "ALIVE"
                ]
                if alive:
                    os.kill(alive[0]["Pid"], signal.SIGKILL)
                    killed.append(alive[0]["Pid"])
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_replica)
    killer.start()
    # One replica: killing it leaves no other to take its batch; Ray must restart it.
    argv = ["extract", str(src), "-o", str(out), "--ray", "--replicas", "1", "--batch-size", "3"]
    assert main(argv + common_args(tiny_llama_dir, max_tokens=24)) == 0
    killer.join()
    assert killed, "no replica was killed: the test did not test anything"
    got = rows(out)
    assert Counter(row_key(r) for r in got) == Counter(expected_keys(lines))  # one row each, no duplicate
    restarts = [a["NumRestarts"] for a in ray._private.state.actors().values() if a["ActorClassName"] == REPLICA_CLASS]
    assert max(restarts) >= 1  # Ray restarted the actor it lost
    assert not any(r.get("error", {}).get("type") == "replica_failed" for r in got)  # its batch was retried


def test_driver_sigkill_then_resume_and_ctrl_c(cluster, tiny_llama_dir, tmp_path) -> None:
    """The CLI in a subprocess on the module's cluster, killed with SIGKILL once rows are
    out; the same command resumes, and stops at Ctrl-C: within seconds, keeping its rows,
    saying how to resume, printing none of Ray's noise. Output is in input order, so after
    each run the rows are exactly a prefix of one row per line: none lost, none twice."""
    lines = input_lines(40)
    src = write_input(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    address = ray.get_runtime_context().gcs_address
    # The CLI, saying at its end whether Ray Data was imported: a file job runs on Ray's
    # actors alone (Ray Data's import, pandas and pyarrow, and its actors cost seconds a run).
    cli = (
        "import sys; from constrained_serve.cli import main; code = main(); "
        "print('ray.data was imported' if 'ray.data' in sys.modules else '', file=sys.stderr); sys.exit(code)"
    )
    argv = [sys.executable, "-c", cli, "extract", str(src), "-o", str(out)]
    # One replica (an actor start per run is the cost here), small batches: rows land a few at a time.
    argv += ["--ray", "--ray-address", address, "--replicas", "1", "--batch-size", "2"]
    argv += common_args(tiny_llama_dir, max_tokens=24)[:-1]  # not -q: the Ctrl-C message is checked
    keys = expected_keys(lines)

    def out_lines() -> list[bytes]:
        return out.read_bytes().splitlines() if out.exists() else []

    def run_until(rows_out: int, sig: int) -> tuple[int, float, str]:
        # A new session, signalled as a terminal does: the whole process group.
        proc = subprocess.Popen(
            argv, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and proc.poll() is None and len(out_lines()) < rows_out:
                time.sleep(0.05)
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            sent = time.monotonic()
            os.killpg(proc.pid, sig)
            _, err = proc.communicate(timeout=120)
            return proc.returncode, time.monotonic() - sent, err.decode()
        finally:
            if proc.poll() is None:
                proc.kill()

    code, _, _ = run_until(3, signal.SIGKILL)
    assert code == -signal.SIGKILL
    data = out.read_bytes()
    killed = [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]  # a last line may be cut
    assert 3 <= len(killed) < len(keys) and [row_key(r) for r in killed] == keys[: len(killed)]

    code, took, err = run_until(len(killed) + 4, signal.SIGINT)  # resumes, then Ctrl-C
    assert code == 130, err[-3000:]
    assert took < 10, f"Ctrl-C took {took:.1f} s"  # measured 2-3 s on 2 busy cores
    got = rows(out)
    assert len(killed) + 4 <= len(got) < len(keys) and got[: len(killed)] == killed
    assert [row_key(r) for r in got] == keys[: len(got)]
    assert "to resume, rerun the same command" in err and f"{len(got) - len(killed)} rows written in this run" in err
    assert "ray.data was imported" not in err
    for noise in ("submit failed", "core_worker", ".cc:", "Traceback", "Token authentication", "\x1b["):
        assert noise not in err, err


@pytest.mark.slow
def test_default_model_on_ray_equals_local(cluster, default_model_dir, tmp_path) -> None:
    tickets = [json.loads(line) for line in open(EXAMPLES / "tickets.jsonl")][:4]
    src = write_input(tmp_path / "in.jsonl", [json.dumps(t) for t in tickets] + ["{oops"])
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    # A short closed schema: the default model completes it well within max_tokens.
    short = tmp_path / "short.schema.json"
    short.write_text(json.dumps(SHORT_SCHEMA))
    args = ["--schema", str(short), "--max-tokens", "96", "--threads", "1", "-q"]
    assert main(["extract", str(src), "-o", str(local)] + args) == 0
    # One replica: the real model on Ray equals it locally; two replicas' rows are checked
    # with the tiny model above (each replica loading the real model costs a minute here).
    assert main(["extract", str(src), "-o", str(on_ray), "--ray", "--replicas", "1", "--batch-size", "2"] + args) == 0
    got = rows(on_ray)
    assert without_cache_counts(got) == without_cache_counts(rows(local))
    assert sum("output" in r for r in got) >= 3 and got[-1]["error"]["type"] == "invalid_json"


def test_a_row_that_keeps_failing_becomes_an_error_row_and_the_batch_goes_on(tiny_llama_dir):
    """In a replica, a batch whose run raises is rerun row by row; the row that fails alone
    gets an error row, the others their outputs (the same replica code Ray runs)."""
    from constrained_serve import SamplingParams
    from constrained_serve.extract.inputs import InputItem
    from constrained_serve.ray.replica import KEY, OK, ROW, ExtractReplica, ReplicaConfig, item_record

    config = ReplicaConfig({"model": str(tiny_llama_dir), "max_num_seqs": 4}, SamplingParams(max_tokens=4), {}, False)
    replica = ExtractReplica(config)
    real = replica._extract
    calls = []

    def extract(items):
        calls.append([it.id for it in items])
        if any(it.id == "bad" for it in items):
            raise RuntimeError("this row breaks the engine")
        return real(items)

    replica._extract = extract
    items = [
        InputItem(i + 1, name, messages=[{"role": "user", "content": f"row {name}"}])
        for i, name in enumerate(["a", "bad", "c"])
    ]
    out = replica({"item": [item_record(it, i)["item"] for i, it in enumerate(items)]})
    assert calls[0] == ["a", "bad", "c"] and sorted(calls[1:]) == [["a"], ["bad"], ["c"]]
    rows = [json.loads(r) for r in out[ROW]]
    assert [r["id"] for r in rows] == ["a", "bad", "c"] and out[KEY] == [it.key for it in items]
    assert out[OK][1] is False and rows[1]["error"] == {
        "type": "runtime",
        "message": "RuntimeError: this row breaks the engine",
    }
    # The others ran on the model (4 tokens of a random model: cut at max_tokens, as locally).
    assert rows[0]["finish_reason"] == rows[2]["finish_reason"] == "length" and "finish_reason" not in rows[1]
