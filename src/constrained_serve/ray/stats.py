"""The Ray job's summary: the local job's counters, plus what each replica did."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..extract.job import JobStats


@dataclass
class ReplicaStats:
    rows: int = 0
    ok: int = 0
    completion_tokens: int = 0
    first_start: float = float("inf")  # the span of its batches (model load not counted),
    last_finish: float = 0.0  # on the replica's own clock

    @property
    def busy_s(self) -> float:
        return max(self.last_finish - self.first_start, 0.0)


@dataclass
class RayJobStats(JobStats):
    """JobStats (rows, valid rate, tokens, throughput) and per-replica rows and busy time.
    Rows that never came back from a replica (its batch failed every retry) count as failed
    and in ``lost``; rows of bad input lines are counted under the replica that passed them on."""

    replicas: dict[str, ReplicaStats] = field(default_factory=dict)
    lost: int = 0

    def add_replica_row(self, row: Mapping[str, Any], replica: str, started: float, finished: float) -> None:
        self.add(row)
        r = self.replicas.setdefault(replica, ReplicaStats())
        r.rows += 1
        r.ok += "error" not in row
        r.completion_tokens += (row.get("usage") or {}).get("completion_tokens", 0)
        r.first_start = min(r.first_start, started)
        r.last_finish = max(r.last_finish, finished)

    def summary(self) -> str:
        lines = [super().summary()]
        if self.lost:
            lines.append(f"lost: {self.lost} rows whose batch failed on every retry (written as error rows)")
        for name, r in sorted(self.replicas.items()):
            rate = f"{r.rows / r.busy_s:.2f} rows/s" if r.busy_s > 0 else "n/a"
            lines.append(
                f"replica {name}: {r.rows} rows ({r.ok} ok), {r.completion_tokens} generated tokens, "
                f"{r.busy_s:.1f}s from its first batch to its last, {rate}"
            )
        return "\n".join(lines)
