"""The progress board's arithmetic, without Ray: each replica's latest report, summed; a
cleared or stale entry counts no more; the driver's reader never raises. The board on a
cluster, fed by a real replica while it decodes: test_pipeline.py."""

from __future__ import annotations

from constrained_serve.ray.progress_board import BoardActivity, ProgressBoard


def test_the_board_sums_latest_reports_and_forgets_cleared_and_stale_ones() -> None:
    now = [0.0]
    board = ProgressBoard(stale_s=10.0, clock=lambda: now[0])
    assert board.totals() == (0, 0)
    board.report("a", 4, 10)
    board.report("b", 2, 3)
    board.report("a", 4, 25)  # a's latest report replaces its earlier one
    assert board.totals() == (6, 28)
    board.report("a", 0, 0)  # a's batch ended: its rows are on their way to the driver
    assert board.totals() == (2, 3)
    now[0] = 9.0
    board.report("c", 1, 1)
    now[0] = 10.5  # b has not reported for 10.5 s: it died mid-batch
    assert board.totals() == (1, 1)


def test_the_reader_returns_its_last_value_and_never_raises() -> None:
    class GoneBoard:  # a board whose actor died: every call fails
        class totals:  # noqa: N801 - an actor method's shape: board.totals.remote()
            @staticmethod
            def remote() -> None:
                raise RuntimeError("the actor died")

    activity = BoardActivity(min_interval_s=0.0)
    assert activity() == (0, 0)  # no board yet
    activity.attach(GoneBoard())
    assert activity() == (0, 0)
    activity.detach()
    assert activity() == (0, 0)
