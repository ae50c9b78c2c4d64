"""What Ray writes to the terminal of ``extract --ray``, kept to what a user needs (without -v).

- Python loggers: the token-authentication warning Ray 2.60 logs on every ``ray.init`` (the
  mode is unchanged: a local cluster uses tokens, a joined one keeps its own); Ray Data's
  "progress bars disabled" and its execution start and end lines. Set to ERROR.
- The replicas' stdout and stderr are not forwarded (``log_to_driver=False``): what goes
  wrong in a replica comes back as error rows.
- ``colorama``, imported by Ray, writes a colour reset (ESC [0m) to stdout at exit.
- The C++ core's lines, below.

Ray's core writes its log lines straight to file descriptor 2 of the driver, whatever
Python's logging says: ``core_worker.cc`` on every run (an actor's constructor arguments
live in the object store), ``gcs_client.cc`` while it retries an address, "Task ... submit
failed ... killed by ray.kill" on Ctrl-C. ``RAY_BACKEND_LOG_LEVEL`` hides them but prints a
line of its own ("Set ray log level from environment variable") and thins Ray's log files.
So for the length of the job, descriptor 2 is a pipe: a thread passes every line on to the
terminal except those in Ray's C++ format (``[2026-01-01 00:00:00,000 W pid tid] file.cc:N:``),
which go to this module's logger at DEBUG; fatal ones (``F``) still pass. ``sys.stderr``
(the progress line, the summary) writes to the terminal itself, not through the pipe.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# [date time,ms LEVEL pid tid] file.cc:line: message, to the end of its line (LEVEL: D I W E;
# not F). Not anchored: it may follow a progress line that ends in "\r", not "\n".
NATIVE_LINE = re.compile(rb"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWE] \d+ \d+\] \S+:\d+: [^\n]*\n?")


def _pump(read_fd: int, out_fd: int) -> None:
    """Copy lines from the pipe to the terminal, less Ray's; until every writer is gone."""
    with open(read_fd, "rb", buffering=0) as pipe, open(out_fd, "wb", buffering=0) as out:
        for line in io.BufferedReader(pipe):  # type: ignore[arg-type]
            for native in NATIVE_LINE.findall(line):
                logger.debug("ray: %s", native.decode("utf-8", "replace").rstrip())
            kept = NATIVE_LINE.sub(b"", line)
            try:
                if kept:
                    out.write(kept)
            except OSError:  # the terminal went away: nothing left to show
                return


@contextlib.contextmanager
def native_logs_filtered(enabled: bool = True) -> Iterator[None]:
    """Within it, Ray's C++ log lines on descriptor 2 are dropped (see the module doc)."""
    if not enabled:
        yield
        return
    try:
        sys.stderr.flush()
        terminal = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2 (an embedding host): nothing to filter
        yield
        return
    read_fd, write_fd = os.pipe()
    # sys.stderr (the progress line, the summary, logging) keeps descriptor 2 and so goes
    # through the pipe too, in order with the rest; it decided whether it is a terminal before.
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, os.dup(terminal)), name="ray-native-logs", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last write end here closes: the pump drains and ends
        os.close(terminal)
        # Processes started in the job (a local cluster's agents) may still hold the pipe:
        # the daemon pump then outlives this block, and ends with them or with this process.
        pump.join(timeout=1.0)


def quiet_ray_loggers(verbose: bool) -> None:
    """Ray's Python loggers that speak on every run, to ERROR (unless -v)."""
    if verbose:
        return
    for name in ("ray.data", "ray._private.authentication"):
        logging.getLogger(name).setLevel(logging.ERROR)


def no_color_reset_at_exit() -> None:
    """Drop the exit handler of the colorama Ray imported (ESC [0m on stdout at exit, after
    our last line). Called once Ray ran: it registers the handler when first used."""
    colorama = sys.modules.get("colorama.initialise")
    reset_all = getattr(colorama, "reset_all", None)
    if reset_all is not None:
        atexit.unregister(reset_all)
