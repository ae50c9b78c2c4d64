"""The Ray session of a job: find the cluster, and fail fast when there is none.

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
# Something answers at the port but it is not a Ray head (another service, a proxy): Ray
# asks it for a cluster id this many times, a second apart (its default, 20, made 30 s).
# Read by Ray when the driver joins; a user's own setting wins.
GCS_WAIT_ENV, JOIN_ATTEMPTS = "RAY_gcs_server_port_wait_time_s", 8
# Ray starts its workers at nice 15 (so that a worker's CPU spike cannot starve the raylet
# and GCS of a big cluster). In a cluster started for this job the replicas ARE the job,
# and at nice 15 any other process on the machine starves them: beside one spinning process
# on 2 cores a 12-row job took 110 s against 55-59 s at nice 0 (the local job: 35 s). A
# cluster started here runs its workers at the driver's priority, as the local job runs; a
# cluster the user runs keeps its own setting (``RAY_worker_niceness=0 ray start ...``).
NICENESS_ENV = "RAY_worker_niceness"


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
        why = "connection refused" if isinstance(e, ConnectionRefusedError) else str(e) or type(e).__name__
        raise RaySetupError(
            f"no Ray cluster answers at {host_port} ({why}); start one with `ray start --head`, "
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
        if joined is None:
            start_local_cluster(ray, **kwargs)
            return
        with _env_default(GCS_WAIT_ENV, str(JOIN_ATTEMPTS)):
            ray.init(address=joined, **kwargs)
    except ConnectionError as e:  # reachable, yet no Ray there (another service), or it refused us
        raise RaySetupError(f"cannot join a Ray cluster there: {e}", address) from None


def start_local_cluster(ray: Any, **kwargs: Any) -> None:
    """``ray.init`` of a new local cluster for this job: no dashboard, and workers at this
    process's own niceness (see NICENESS_ENV) unless the user set one."""
    with _env_default(NICENESS_ENV, str(os.getpriority(os.PRIO_PROCESS, 0))):
        ray.init(include_dashboard=False, **kwargs)


@contextlib.contextmanager
def _env_default(name: str, value: str) -> Iterator[None]:
    """$name=value for the block, unless the user set it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


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
