"""The memory the engine shares with its grammar workers: anonymous files mapped on both
sides (their fds passed to the worker at start), for the step's bitmask the mask workers
write rows into, and for the progress page each worker stamps before every item.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import time

import numpy as np

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def shared_file(nbytes: int, name: str) -> tuple[int, mmap.mmap]:
    """An anonymous file of ``nbytes`` mapped here; its fd is handed to workers (pass_fds)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, 0)
    else:  # not Linux: an unlinked temporary file does the same
        f = tempfile.TemporaryFile(prefix=name)
        fd = os.dup(f.fileno())
        f.close()
    os.ftruncate(fd, max(nbytes, 1))
    return fd, mmap.mmap(fd, max(nbytes, 1))


class SharedBitmask:
    """The step's bitmask ``[rows, width]`` int32, in memory the mask workers write into."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = int(rows), int(width)
        self.fd, self._map = shared_file(self.rows * self.width * 4, "cs-bitmask")
        self.array = np.ndarray((self.rows, self.width), dtype=np.int32, buffer=self._map)
        self.array.fill(-1)
        self.pinned = False

    def pin(self) -> bool:
        """Page-lock the rows for CUDA (cudaHostRegister), so the sampler's copy of a step's
        rows to the GPU is asynchronous instead of staged through a pageable bounce buffer
        while the CPU waits. False (and nothing changes) where CUDA cannot do it."""
        if self.pinned:
            return True
        try:
            import torch

            if not torch.cuda.is_available():
                return False
            err = torch.cuda.cudart().cudaHostRegister(self.array.ctypes.data, self.array.nbytes, 0)
        except Exception as e:  # noqa: BLE001 - an optimisation: the copy works unpinned too
            logger.warning("grammar bitmask not pinned (%s): its copies to the GPU stay synchronous", e)
            return False
        if int(getattr(err, "value", err)) != 0:
            logger.warning("grammar bitmask not pinned (cudaHostRegister: %s)", err)
            return False
        self.pinned = True
        return True

    def close(self) -> None:
        if self.pinned:
            import torch

            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
        # Once only: a closed fd number is soon another file's (a double close closes that).
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class ProgressCell:
    """What a worker is doing, in a shared page the engine reads without asking: the batch's
    seq, the item index (-1: not started; n: all done) and that item's start in wall
    (monotonic) and CPU seconds.

    A seqlock: the writer makes the generation odd, writes, makes it even; a reader retries
    until it sees the same even generation before and after. Without it a reader could see a
    half-written record (a new index with the old start) when the worker was descheduled
    mid-write; from a start of 0.0 an item seemed to have run for the machine's uptime and
    was killed after a few ms (CI once killed a 15 ms compile so). Every field is one aligned
    8-byte store through a typed memoryview (a single ``memcpy`` of 8 bytes; ``struct.pack_into``
    zero-fills its bytes first, so a reader could catch a generation of 0, which looks even).
    The memoryviews cost a third of numpy scalar stores: a worker writes before each item of
    a batch, 256 of them a step. One writer at a time; x86-64 and ARM64 keep such stores whole
    and, for one writer, in order."""

    def __init__(self, page: mmap.mmap):
        view = memoryview(page)
        self._ints = view[:24].cast("q")  # generation, seq, index
        self._times = view[24:40].cast("d")  # wall, CPU

    def write(self, seq: int, index: int, wall: float, cpu: float) -> None:
        # From the page's generation, not a count of our own: the engine also writes (the
        # reset before a worker starts), and the generation must never repeat.
        ints, times = self._ints, self._times
        gen = ints[0] | 1
        ints[0] = gen  # odd: writing
        ints[1], ints[2] = seq, index
        times[0], times[1] = wall, cpu
        ints[0] = gen + 1

    def read(self) -> tuple[int, int, float, float]:
        tries = 0
        while True:
            gen = self._ints[0]
            if gen % 2 == 0:
                record = (self._ints[1], self._ints[2], self._times[0], self._times[1])
                if self._ints[0] == gen:
                    return record
            tries += 1
            if tries % 64 == 0:
                time.sleep(0)  # the writer was descheduled mid-write: let it run
