"""``ShuffleResult``: the reduce partitions of a shuffle, as a local or Ray cluster yields them.
Re-exported by the package."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Self

from flightshuffle.progress import PartitionProgress


class ShuffleResult:
    """The reduce partitions of one shuffle, yielded in partition order as each is complete.

    Iterating yields ``pyarrow.Table`` (or ``polars.DataFrame`` with ``output="polars"``).
    ``partition_ids`` lists the partitions yielded so far. Leaving a ``with`` block or calling
    ``close()`` frees the shuffle's blocks on the workers.
    """

    def __init__(self, native: Any, output: str, bar: PartitionProgress | None = None) -> None:
        self._native = native
        self._output = output
        self._bar = bar or PartitionProgress(0, False)
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
        self._bar.read(table.num_rows)
        if self._output == "polars":
            import polars as pl

            return pl.from_arrow(table)
        return table

    def wait_mapped(self) -> dict[str, Any]:
        """Block until every map task finished; returns rows, bytes, maps, blocks, merges,
        checksum and, under ``auto``, ``strategy_choice`` (its pick and predicted times)."""
        return json.loads(self._native.wait_mapped())

    @property
    def shuffle_id(self) -> str:
        return self._native.shuffle_id

    def close(self) -> None:
        self._bar.close()
        self._native.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
