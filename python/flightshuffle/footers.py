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
    """Column names that cannot hold a null in any of ``tables`` (each a list of Parquet
    files): required in every file of each table that has the column. A table reads a
    column some of its files lack as null there, so a column missing from one file of a
    table, or nullable anywhere, is not one of them."""
    required: set[str] = set()
    unsafe: set[str] = set()
    for files in tables:
        present: set[str] = set()
        everywhere: set[str] | None = None
        for f in files:
            schema = metadata(f).schema.to_arrow_schema()
            present |= set(schema.names)
            here = {field.name for field in schema if not field.nullable}
            everywhere = here if everywhere is None else everywhere & here
        required |= everywhere or set()
        unsafe |= present - (everywhere or set())
    return required - unsafe
