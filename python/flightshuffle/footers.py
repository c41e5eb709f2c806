"""Parquet footers as online aggregation reads them on the driver: row counts for the splits,
and which columns can hold no null. A footer is parsed once per file version (path, size and
modification time), however many queries read it."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any


@functools.lru_cache(maxsize=4096)
def _footer(path: str, size: int, mtime_ns: int) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata


def metadata(path: str) -> Any:
    """The file's ``pyarrow.parquet.FileMetaData``."""
    st = os.stat(path)
    return _footer(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def version(files: list[str]) -> str:
    """What changes when any of ``files`` is rewritten, added or removed."""
    import hashlib

    stats = [(os.path.abspath(f), os.stat(f)) for f in files]
    text = repr([(f, s.st_size, s.st_mtime_ns) for f, s in stats])
    return hashlib.sha1(text.encode()).hexdigest()


def file_rows(path: str) -> int:
    return metadata(path).num_rows


def never_null(tables: Iterable[list[str]]) -> set[str]:
    """Column names that are required (cannot hold a null) in every file of ``tables`` (each a
    list of Parquet files) that has a column of that name."""
    required: set[str] = set()
    nullable: set[str] = set()
    for files in tables:
        for f in files:
            for field in metadata(f).schema.to_arrow_schema():
                (nullable if field.nullable else required).add(field.name)
    return required - nullable
