"""flightshuffle: a distributed shuffle for Arrow data over Arrow Flight.

``Cluster`` starts a local cluster of worker processes (the embedded default) and shuffles
anything that exports the Arrow PyCapsule stream interface (pyarrow, Polars, DuckDB); runs SQL
distributed (DataFusion); runs Polars functions and DuckDB SQL on the workers over distributed
datasets (``read_parquet`` / ``from_arrow``); and runs online aggregation (``online``).
"""

from __future__ import annotations

from flightshuffle._native import ChecksumError, ShuffleError, WorkerLostError
from flightshuffle.cluster import (
    STRATEGIES,
    Cluster,
    ShuffleResult,
    Strategy,
    parse_bytes,
    worker_command,
)

__all__ = [
    "STRATEGIES",
    "ChecksumError",
    "Cluster",
    "ShuffleError",
    "ShuffleResult",
    "Strategy",
    "WorkerLostError",
    "parse_bytes",
    "worker_command",
]
__version__ = "0.1.0"
