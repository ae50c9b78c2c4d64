"""How many threads the CPU forward uses, adapted to what the machine gives it.

A forward on CPU is a few hundred short OpenMP parallel regions (each linear, norm and
attention op), each ending in a barrier where every thread waits for the slowest. When
another process takes one of the cores (another job, a test run, even the engine's own
grammar worker), the thread that lost its core holds up every barrier for a scheduler time
slice: measured on a 2-core VM with one busy-looping process beside it, SmolLM2-135M chat
fell from 284 to 12 output tokens/s with 2 threads, and ran at 269 with 1. vLLM avoids
this by pinning its threads; a library inside someone else's process cannot.

So the engine measures instead: every forward's seconds per token, kept per step size (a
power-of-two bucket of the step's token count, since a decode step of 8 rows and a prefill
chunk of 512 tokens cost very differently per token). Now and then, and within a few steps
when steps of a size become much slower than usual, it runs a few steps with half the
threads (or twice, back up to the configured count) and keeps whichever count was faster
than the steps just before the probe on the same step sizes. A probe that starts out much
slower ends after one step, and a probe that lost is tried again after twice as long, so on
a steady machine the probes cost well under 1%.
After a switch down, the way back up is probed soon (after ``recover_after`` steps, then
twice as long after each loss): contention is often brief (a neighbour's start-up, a test
run), and a tuner that waited its routine 1024 steps kept a 2-core engine on one thread,
1.5x slower, for a whole benchmark after a busy warm-up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class ThreadTuner:
    """Chooses torch's intra-op thread count between 1 and ``max_threads`` from timed steps.
    ``observe(num_tokens, seconds)`` after each forward; it calls ``set_threads`` to switch."""

    max_threads: int
    probe_every: int = 1024  # steps between routine probes (doubled after each that lost, to 8x)
    recover_after: int = 128  # steps before probing back up after a switch down (doubled after each loss)
    first_probe: int = 16  # steps before the first probe: a machine busy from the start shows no slowdown
    probe_steps: int = 3  # measured steps in a probe (after one unmeasured warm-up step)
    slowdown: float = 2.0  # a step this much slower per token than usual for its size: probe now
    gain: float = 1.1  # the probed count must be this much faster to be kept
    set_threads: Callable[[int], None] = torch.set_num_threads
    threads: int = 0  # current count (0: max_threads)
    # seconds per token, an exponential average per (threads, size bucket)
    usual: dict[tuple[int, int], float] = field(default_factory=dict)
    # the last few seconds per token per (threads, size bucket): what a probe is measured
    # against, the machine as it is now rather than the long average (see _baseline)
    recent: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    switches: int = 0  # counts kept after a probe (for tests and stats)
    _since_probe: int = 0
    _interval: dict[int, int] = field(default_factory=dict)  # per probed count
    _probe: int = 0  # thread count being probed (0: none)
    _pending: int = 0  # thread count to probe once _pending_steps reach probe_steps (0: none)
    _pending_steps: int = 0
    _probe_seen: list[tuple[int, float]] = field(default_factory=list)
    _warm: bool = False

    def __post_init__(self) -> None:
        self.max_threads = max(1, int(self.max_threads))
        self.threads = self.threads or self.max_threads

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return max(1, int(num_tokens)).bit_length()

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0 or self.max_threads == 1:
            return
        per_token, b = seconds / num_tokens, self.bucket(num_tokens)
        if self._probe:
            self._observe_probe(b, per_token)
            return
        usual = self.usual.get((self.threads, b))
        self._learn(self.threads, b, per_token)
        self._since_probe += 1
        if self._pending:  # a slowdown seen: probe once a few steps show the machine as it is now
            self._pending_steps += 1
            if self._pending_steps >= self.probe_steps:
                self._start_probe(self._pending)
            return
        contended = usual is not None and per_token > self.slowdown * usual and self._since_probe >= 8
        for cand in self._candidates():
            # A slowdown calls for fewer threads, never more: probing up then costs most.
            if contended and cand < self.threads:
                # The probe is measured against the steps after the slowdown, not before it.
                for key in [k for k in self.recent if k[0] == self.threads]:
                    del self.recent[key]
                self._pending, self._pending_steps = cand, 0
                return
            if self._since_probe >= self._interval.setdefault(cand, self.first_probe):
                self._start_probe(cand)
                return

    def _candidates(self) -> list[int]:
        down, up = max(1, self.threads // 2), min(self.max_threads, self.threads * 2)
        return [c for c in (down, up) if c != self.threads]

    def _learn(self, threads: int, b: int, per_token: float) -> None:
        old = self.usual.get((threads, b))
        self.usual[(threads, b)] = per_token if old is None else 0.8 * old + 0.2 * per_token
        last = self.recent.setdefault((threads, b), [])
        last.append(per_token)
        del last[: -self.probe_steps]

    def _baseline(self, threads: int, b: int) -> float | None:
        """What a probe must beat: the median of the last few steps of this size at the
        current count (after a slowdown, only steps since it). The long average lags a change
        of load: with one busy-looping process beside a 2-core engine, 2 threads became 3x
        slower per token and 1 thread 1.7x, but a probe at the first slow step met an average
        only 1.4x up, lost, and was not tried again for 1024 steps: the engine kept a third of
        its speed (benchmarks/busy_machine.py, 2026-12-07)."""
        last = self.recent.get((threads, b))
        if not last:
            return self.usual.get((threads, b))
        return sorted(last)[len(last) // 2]

    def _start_probe(self, cand: int) -> None:
        self._probe, self._probe_seen, self._warm, self._pending = cand, [], False, 0
        self._since_probe = 0
        self.set_threads(cand)

    def _observe_probe(self, b: int, per_token: float) -> None:
        if not self._warm:  # the first step after a switch also pays for waking the new team
            self._warm = True
            return
        self._probe_seen.append((b, per_token))
        base = self._baseline(self.threads, b)
        clearly_worse = base is not None and per_token > 1.4 * base  # no need to see more
        if len(self._probe_seen) < self.probe_steps and not clearly_worse:
            return
        bases = [(self._baseline(self.threads, bb), t) for bb, t in self._probe_seen]
        ratios = [base / t for base, t in bases if base is not None]
        speedup = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 0.0
        cand, self._probe = self._probe, 0
        for bb, t in self._probe_seen:
            self._learn(cand, bb, t)
        if speedup >= self.gain:
            logger.info("CPU forward: %d threads instead of %d (%.2fx faster per token)", cand, self.threads, speedup)
            went_down, self.threads = cand < self.threads, cand
            self.switches += 1
            self._interval = {c: self._first_interval(c, went_down) for c in self._candidates()}
        else:
            self.set_threads(self.threads)
            # Lost: twice as long before the next probe this way, never under its base wait.
            self._interval[cand] = min(8 * self.probe_every, max(self._base_wait(cand), 2 * self._interval[cand]))

    def _first_interval(self, cand: int, went_down: bool) -> int:
        """Steps before the first probe of ``cand`` after a switch to ``self.threads``."""
        if (cand < self.threads) == went_down:
            return self.first_probe  # on the same way: 4 -> 2 may be followed by 2 -> 1
        return self._base_wait(cand)

    def _base_wait(self, cand: int) -> int:
        """Back up (after a switch down): recover_after. Down: the routine probe_every."""
        return self.recover_after if cand > self.threads else self.probe_every
