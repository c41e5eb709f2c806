"""flightshuffle: a distributed shuffle for Arrow data over Arrow Flight.

``Cluster`` starts a local cluster of worker processes (the embedded default) and shuffles
anything that exports the Arrow PyCapsule stream interface (pyarrow, Polars, DuckDB).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Self

from flightshuffle._native import (
    ChecksumError,
    NativeCluster,
    ShuffleError,
    WorkerLostError,
)

__all__ = [
    "ChecksumError",
    "Cluster",
    "ShuffleError",
    "ShuffleResult",
    "WorkerLostError",
    "parse_bytes",
    "worker_command",
]
__version__ = "0.1.0"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """Parse a byte size: an int, or a string such as ``"512MiB"``, ``"2GB"``, ``"1.5g"``."""
    if isinstance(value, bool):
        raise TypeError("a byte size must be an int or a string like '512MiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative: {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r} (examples: 1048576, '512MiB', '2GB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def worker_command() -> list[str]:
    """The command that starts one worker process: this interpreter running the worker module."""
    return [sys.executable, "-m", "flightshuffle.worker"]


def _exports_arrow(obj: Any) -> bool:
    """True for anything exporting the Arrow PyCapsule interface (stream or array)."""
    return hasattr(obj, "__arrow_c_stream__") or hasattr(obj, "__arrow_c_array__")


class ShuffleResult:
    """The reduce partitions of one shuffle, yielded in partition order as each is complete.

    Iterating yields ``pyarrow.Table`` (or ``polars.DataFrame`` with ``output="polars"``).
    ``partition_ids`` lists the partitions yielded so far. Leaving a ``with`` block or calling
    ``close()`` frees the shuffle's blocks on the workers.
    """

    def __init__(self, native: Any, output: str) -> None:
        self._native = native
        self._output = output
        self.partition_ids: list[int] = []

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = self._native.next_partition()
        if item is None:
            self.close()
            raise StopIteration
        index, table = item
        self.partition_ids.append(index)
        if self._output == "polars":
            import polars as pl

            return pl.from_arrow(table)
        return table

    def wait_mapped(self) -> dict[str, Any]:
        """Block until every map task finished; returns rows, bytes, maps, blocks, checksum."""
        return json.loads(self._native.wait_mapped())

    @property
    def shuffle_id(self) -> str:
        return self._native.shuffle_id

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Cluster:
    """A local cluster: ``workers`` worker processes on this machine, stopped on exit.

    ``memory_budget`` is each worker's block store budget (int bytes or ``"512MiB"``); blocks
    beyond it spill to fused segment files under ``spill_dir`` (a temporary directory by
    default). ``compression`` is ``"auto"`` (none on one host), ``"none"``, ``"lz4"`` or
    ``"zstd"``. ``timeout`` bounds every call and every wait, in seconds.
    """

    def __init__(
        self,
        workers: int = 4,
        memory_budget: int | str = "1GiB",
        spill_dir: str | None = None,
        compression: Literal["auto", "none", "lz4", "zstd"] = "auto",
        timeout: float = 600.0,
    ) -> None:
        if workers < 1:
            raise ValueError("a cluster needs at least one worker")
        self._native: Any = NativeCluster(
            workers,
            parse_bytes(memory_budget),
            None if spill_dir is None else str(spill_dir),
            compression,
            worker_command(),
            float(timeout),
        )
        self.workers = workers
        self.last_metrics: dict[str, Any] = {}

    def shuffle(
        self,
        data: Any,
        by: str | Sequence[str] | None = None,
        partitions: int | None = None,
        strategy: Literal["pull"] = "pull",
        partitioner: Literal["hash", "range", "round_robin"] | None = None,
        output: Literal["arrow", "polars"] = "arrow",
        map_bytes: int | str = "64MiB",
    ) -> ShuffleResult:
        """Shuffle ``data`` into ``partitions`` reduce partitions.

        ``data`` is anything with ``__arrow_c_stream__`` (pyarrow Table or RecordBatchReader,
        Polars DataFrame, DuckDB relation), read zero-copy and cut into map tasks of about
        ``map_bytes``. Rows are hashed on the ``by`` columns (``partitioner="hash"``, the
        default when ``by`` is given), ordered by them (``"range"``: the input is read fully
        first to sample boundaries), or dealt in turn (``"round_robin"``, the default without
        ``by``). Equal keys always land in the same partition.
        """
        keys = [by] if isinstance(by, str) else list(by or [])
        kind = partitioner or ("hash" if keys else "round_robin")
        if kind in ("hash", "range") and not keys:
            raise ValueError(f"partitioner {kind!r} needs key columns in by=")
        if output not in ("arrow", "polars"):
            raise ValueError(f"output must be 'arrow' or 'polars', not {output!r}")
        if not _exports_arrow(data):
            raise TypeError(
                f"cannot shuffle {type(data).__name__}: it does not export Arrow data "
                "(__arrow_c_stream__); pass a pyarrow Table, Polars DataFrame or DuckDB relation"
            )
        native = self._native.shuffle(
            data,
            keys,
            int(partitions or 2 * self.workers),
            strategy,
            kind,
            parse_bytes(map_bytes),
        )
        return ShuffleResult(native, output)

    def register_parquet(self, name: str, path: str) -> None:
        """Register a Parquet file or directory as table ``name`` for :meth:`sql`."""
        self._native.register_parquet(name, str(path))

    def sql(
        self,
        query: str,
        tables: dict[str, Any] | None = None,
        output: Literal["arrow", "polars"] = "arrow",
    ) -> Any:
        """Run SQL distributed on the cluster (DataFusion plans, flightshuffle exchanges).

        ``tables`` maps names to Parquet paths or to Arrow data (anything with
        ``__arrow_c_stream__``: pyarrow, Polars, DuckDB relations), which is written to Parquet
        in the cluster's scratch directory so every worker can scan it. ``EXPLAIN`` and
        ``EXPLAIN ANALYZE`` return the staged plan. Per-exchange figures of the last query are
        in :attr:`last_metrics`.
        """
        for name, source in (tables or {}).items():
            if isinstance(source, (str, os.PathLike)):
                self._native.register_parquet(name, os.fspath(source))
            elif _exports_arrow(source):
                self._native.register_arrow(name, source)
            else:
                raise TypeError(
                    f"table {name!r}: expected a Parquet path or Arrow data, "
                    f"not {type(source).__name__}"
                )
        table, metrics = self._native.sql(query)
        self.last_metrics = json.loads(metrics)
        if output == "polars":
            import polars as pl

            return pl.from_arrow(table)
        return table

    def sql_single_process(self, query: str) -> tuple[Any, float]:
        """Run ``query`` on single-process DataFusion in this process over the tables registered
        here (the baseline the cluster is compared with); returns (pyarrow.Table, seconds)."""
        return self._native.sql_single_process(query)

    def explain(self, query: str, analyze: bool = False) -> str:
        """The stages of ``query`` and the exchanges between them; ``analyze`` runs it and adds
        rows, bytes, blocks, spill and time per exchange."""
        return self._native.explain(query, analyze)

    def stats(self) -> list[dict[str, int]]:
        """Per-worker block store figures: memory, spilled and restored bytes, peak RSS."""
        return json.loads(self._native.stats_json())

    @property
    def worker_pids(self) -> list[int]:
        return list(self._native.worker_pids())

    @property
    def worker_addresses(self) -> list[str]:
        return list(self._native.worker_addresses())

    @property
    def spill_root(self) -> str | None:
        return self._native.spill_root()

    def close(self) -> None:
        """Stop every worker process."""
        self._native.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
