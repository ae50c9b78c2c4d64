"""Greedy sampling under a grammar masks only the rows whose argmax the grammar refuses
(kernels/sampling.py greedy_masked): it must pick what masking every row picks."""

import torch

from constrained_serve.kernels.sampling import apply_bitmask_torch, greedy_masked


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return apply_bitmask_torch(logits.float().clone(), bitmask).argmax(dim=-1)


def test_equals_masking_every_row_with_ties_and_empty_masks():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 1000  # not a multiple of 32: the last word is partial
    words = -(-vocab // 32)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(rows, vocab, generator=g).to(dtype)
        logits[5, [3, 700]] = 50.0  # a tie at the top; the first is allowed below, then refused
        logits[6, [3, 700]] = 50.0
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int32)
        bitmask[:20] = -1  # rows that allow everything: their argmax stands
        bitmask[6, 0] &= ~(1 << 3)  # row 6 refuses token 3: 700 wins the tie
        bitmask[7] = 0  # allows nothing: token 0, as the full mask gives
        got = greedy_masked(logits, bitmask)
        torch.testing.assert_close(got, reference(logits, bitmask))
        assert got[6] == 700
        assert greedy_masked(logits, None).tolist() == logits.argmax(dim=-1).tolist()


def test_the_callers_logits_are_left_alone():
    logits = torch.randn(4, 64)
    before = logits.clone()
    greedy_masked(logits, torch.zeros(4, 2, dtype=torch.int32))
    assert torch.equal(logits, before)
