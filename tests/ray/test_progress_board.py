"""The progress board's arithmetic, without Ray: each replica's latest report on its batch;
a cleared or stale entry counts no more, nor does a batch whose rows reached the driver;
the driver's reader never raises. The board on a cluster, fed by a real replica while it
decodes: test_pipeline.py."""

from __future__ import annotations

from constrained_serve.ray.progress_board import BoardActivity, ProgressBoard, totals


def test_the_board_keeps_each_replicas_latest_report_and_forgets_cleared_and_stale_ones() -> None:
    now = [0.0]
    board = ProgressBoard(stale_s=10.0, clock=lambda: now[0])
    assert board.entries() == [] and totals(board.entries()) == (0, 0)
    board.report("a", 1.0, 4, 10)
    board.report("b", 2.0, 2, 3)
    board.report("a", 1.0, 4, 25)  # a's latest report replaces its earlier one
    assert sorted(board.entries()) == [("a", 1.0, 4, 25), ("b", 2.0, 2, 3)]
    assert totals(board.entries()) == (6, 28)
    board.report("a", 1.0, 0, 0)  # a's batch ended: its rows are on their way to the driver
    assert totals(board.entries()) == (2, 3)
    now[0] = 9.0
    board.report("c", 3.0, 1, 1)
    now[0] = 10.5  # b has not reported for 10.5 s: it died mid-batch
    assert board.entries() == [("c", 3.0, 1, 1)]


def test_batches_the_driver_has_rows_of_are_left_out() -> None:
    entries = [("a", 1.0, 4, 40), ("b", 2.0, 2, 3), ("a", 5.0, 1, 1)]
    assert totals(entries) == (7, 44)
    # a's first batch came back (a read of the board from before its clear): its rows are
    # counted as rows, its tokens from their usage; a's next batch still counts.
    assert totals(entries, {("a", 1.0)}) == (3, 4)


def test_the_reader_returns_nothing_in_flight_without_a_board_and_never_raises() -> None:
    class GoneBoard:  # a board whose actor died: every call fails
        class entries:  # noqa: N801 - an actor method's shape: board.entries.remote()
            @staticmethod
            def remote() -> None:
                raise RuntimeError("the actor died")

    activity = BoardActivity(min_interval_s=0.0)
    assert activity() == (0, 0)  # no board yet
    activity.attach(GoneBoard())
    assert activity() == (0, 0)
    activity.delivered("a", 1.0)
    activity.detach()
    assert activity() == (0, 0)
