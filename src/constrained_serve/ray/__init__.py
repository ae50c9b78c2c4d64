"""Extraction across GPUs and machines on Ray Data (``pip install 'constrained-serve[ray]'``).

``extract(...)`` runs the JSONL extraction job of ``constrained-serve extract`` on a Ray
cluster: one Engine replica per GPU (or per share of a CPU machine), the same rows, error
rows and resume semantics as the local job. See docs/ray.md.

Importing this package does not import Ray; ``extract`` does, and raises
``RayNotInstalledError`` (an ImportError) naming the extra to install when it is missing.
"""

from .availability import INSTALL_HINT, RayNotInstalledError, require_ray
from .entry import extract
from .pipeline import REPLICA_FAILED, RayOptions, run_job
from .replica import ExtractReplica, ReplicaConfig
from .replica_pool import ReplicaStartError
from .session import RaySetupError
from .stats import RayJobStats, ReplicaStats

__all__ = [
    "INSTALL_HINT",
    "REPLICA_FAILED",
    "ExtractReplica",
    "RayJobStats",
    "RayNotInstalledError",
    "RayOptions",
    "RaySetupError",
    "ReplicaConfig",
    "ReplicaStartError",
    "ReplicaStats",
    "extract",
    "require_ray",
    "run_job",
]
