"""The Ray session of a job: find the cluster, fail fast when there is none, keep Ray quiet.

``ray.init(address=...)`` with nothing listening there retries for minutes (Ray 2.60: about
35 s per attempt, 20 attempts) and prints a C++ warning for each; ``address="auto"`` with no
cluster raises a ConnectionError that tells a CLI user to set ``--address``, a flag we do not
have. So before ``ray.init`` the address is resolved the way Ray resolves it and its port
is dialled once: a refused or unreachable address is a ``RaySetupError`` within seconds,
which the CLI reports as a set-up error (exit 2) naming its own flag.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from .availability import require_ray

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster's port to accept a connection. A live head answers in
# milliseconds even across a data centre; an address that drops packets gets this long.
CONNECT_TIMEOUT_S = 10.0


class RaySetupError(ConnectionError):
    """No Ray cluster at the address asked for (or none running, for "auto"): nothing ran."""

    def __init__(self, message: str, address: str | None):
        super().__init__(message)
        self.address = address


def effective_address(address: str | None) -> str | None:
    """The address ray.init will use: ``address``, else $RAY_ADDRESS, else None (a new local cluster)."""
    if address:
        return address
    return os.environ.get("RAY_ADDRESS") or None


def check_address(address: str | None) -> str | None:
    """The cluster address to join (None: start a local cluster), checked to accept a
    connection; RaySetupError otherwise."""
    address = effective_address(address)
    if address is None or address == "local":
        return address
    target = address
    if address == "auto" or "://" not in address:
        try:
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # another Ray layout: ray.init resolves and reports it itself
            canonicalize_bootstrap_address = None
        if canonicalize_bootstrap_address is not None:
            try:
                target = canonicalize_bootstrap_address(address) or address
            except ConnectionError:
                raise RaySetupError(
                    "no running Ray cluster was found on this machine (start one with `ray start --head`, "
                    "or leave the address out to start a local cluster for this job)",
                    address,
                ) from None
            except ValueError as e:
                raise RaySetupError(f"not a Ray address ({e})", address) from None
    host_port = target.split("://", 1)[-1].rsplit("/", 1)[0]
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        if target == "auto":
            return address  # resolution unavailable (see above): ray.init decides
        raise RaySetupError(f"not a Ray address (expected HOST:PORT, got {address!r})", address)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        why = "connection refused: nothing listens there" if isinstance(e, ConnectionRefusedError) else str(e)
        raise RaySetupError(
            f"cannot reach a Ray cluster at {host_port} ({why}); start one with `ray start --head`, "
            "or leave the address out to start a local cluster for this job",
            address,
        ) from None
    return address


def init(ray: Any, address: str | None, log_to_driver: bool = True) -> None:
    """ray.init: join ``address`` (or $RAY_ADDRESS) after checking it answers, else start a
    local cluster without the dashboard (not needed here; Ray refuses dashboard options when
    joining a cluster). ``log_to_driver``: the workers' stdout and stderr printed here (the
    CLI turns it off without -v: a replica's problems come back as error rows)."""
    joined = check_address(address)
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": log_to_driver}
    try:
        if joined is not None:
            ray.init(address=joined, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)
    except ConnectionError as e:  # found and reachable, yet refused (a version mismatch, auth)
        raise RaySetupError(f"cannot join the Ray cluster: {e}", address) from None


@contextlib.contextmanager
def ray_session(address: str | None, log_to_driver: bool = True) -> Iterator[Any]:
    """Ray, connected: a running session is used as is; one started here is shut down on exit."""
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    logger.info("connecting to Ray (%s)", effective_address(address) or "a new local cluster")
    init(ray, address, log_to_driver)
    try:
        yield ray
    finally:
        ray.shutdown()


def quiet_ray(verbose: bool) -> None:
    """For the command line: Ray's own chatter off unless -v. Set before ray.init, read by the
    driver and by the processes of a cluster started here (their environment is ours).

    - RAY_BACKEND_LOG_LEVEL: the C++ core's stderr lines (``core_worker.cc``: an actor's
      constructor arguments live in the object store; on Ctrl-C, "Task ... submit failed ...
      killed by ray.kill" for the batches the shut-down pool still held). Only fatal ones
      are shown; every line still goes to the session's log files.
    - The token-authentication warning Ray 2.60 logs on every ``ray.init`` (its mode is
      unchanged: a local cluster uses tokens, a joined one keeps its own).
    - Ray Data's "progress bars disabled" and execution start/end lines.
    """
    if verbose:
        return
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    for name in ("ray.data", "ray._private.authentication"):
        logging.getLogger(name).setLevel(logging.ERROR)
