"""The runner's step inputs go through two persistent buffers (input_staging.py)."""

import torch

from constrained_serve.input_staging import InputStaging


def test_parts_come_back_as_views_in_order_and_the_buffer_grows():
    s = InputStaging(torch.device("cpu"))
    a, b, c = s.i64.upload([[1, 2, 3], [], [7]])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [] and c.tolist() == [7]
    assert a.dtype == torch.int64 and a.data_ptr() == s.i64.dev.data_ptr()  # views: no copy on CPU
    big = list(range(10_000))  # past the initial capacity
    (x,) = s.i32.upload([big])
    assert x.dtype == torch.int32 and x.tolist() == big and s.i32.host.numel() >= 10_000


def test_a_step_overwrites_the_previous_steps_views():
    """What makes reuse safe is the step's end (the sampled tokens read on the host); a caller
    that keeps a step's inputs past the next prepare sees the new values."""
    s = InputStaging(torch.device("cpu"))
    (first,) = s.i64.upload([[5, 6]])
    s.i64.upload([[8, 9]])
    assert first.tolist() == [8, 9]
