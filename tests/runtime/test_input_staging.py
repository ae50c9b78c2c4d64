"""The runner's step inputs go through persistent buffers (input_staging.py)."""

import numpy as np
import torch

from constrained_serve.runtime.input_staging import InputStaging


def test_parts_come_back_as_views_in_order_and_the_buffer_grows():
    s = InputStaging(torch.device("cpu"))
    a, b, c = s.i64.upload([[1, 2, 3], [], [7]])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [] and c.tolist() == [7]
    assert a.dtype == torch.int64 and a.data_ptr() == s.i64.hosts[s.i64.turn].data_ptr()  # views: no copy on CPU
    big = list(range(10_000))  # past the initial capacity
    (x,) = s.i32.upload([big])
    assert x.dtype == torch.int32 and x.tolist() == big and s.i32.hosts[0].numel() >= 10_000
    t, p = s.f32.upload([[0.5, 1.0], np.array([0.25], dtype=np.float32)])
    assert t.dtype == torch.float32 and t.tolist() == [0.5, 1.0] and p.tolist() == [0.25]


def test_a_steps_views_survive_the_next_upload_not_the_one_after():
    """The pipelined loop prepares step N+1 while step N's copy may still be queued: the two
    host buffers alternate, so step N's inputs hold until step N+2 is prepared (by then
    reading step N's tokens has waited for its copy)."""
    s = InputStaging(torch.device("cpu"))
    (first,) = s.i64.upload([[5, 6]])
    (second,) = s.i64.upload([[8, 9]])
    assert first.tolist() == [5, 6] and second.tolist() == [8, 9]
    s.i64.upload([[1, 2]])
    assert first.tolist() == [1, 2] and second.tolist() == [8, 9]
