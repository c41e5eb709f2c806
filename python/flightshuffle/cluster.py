"""``Cluster``: a local cluster of worker processes (or workers hosted on Ray) and what runs on
it: shuffles, distributed SQL, datasets and online aggregation. Re-exported by the package."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self

from flightshuffle._native import (
    NativeCluster,
)
from flightshuffle.progress import PartitionProgress, QueryProgress, showing
from flightshuffle.shuffle_result import ShuffleResult

if TYPE_CHECKING:
    from flightshuffle.dataset import Dataset, Grouped
    from flightshuffle.online import OnlineResult

Strategy = Literal["pull", "merged", "push", "two-level", "auto", "store", "store-two-level"]
#: Exchange strategies a shuffle or a query can ask for.
STRATEGIES: tuple[str, ...] = (
    "pull",
    "merged",
    "push",
    "two-level",
    "auto",
    "store",
    "store-two-level",
)


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
    """The command that starts one worker process: this interpreter running the worker module,
    or ``$FLIGHTSHUFFLE_WORKER_COMMAND`` (e.g. the Rust ``flightshuffle-sql-worker`` binary,
    which runs SQL stages and shuffles of Arrow data but no Python tasks)."""
    custom = os.environ.get("FLIGHTSHUFFLE_WORKER_COMMAND", "").strip()
    if custom:
        return shlex.split(custom)
    return [sys.executable, "-m", "flightshuffle.worker"]


def _exports_arrow(obj: Any) -> bool:
    """True for anything exporting the Arrow PyCapsule interface (stream or array)."""
    return hasattr(obj, "__arrow_c_stream__") or hasattr(obj, "__arrow_c_array__")


def _size_of(data: Any) -> int | None:
    """The bytes of an in-memory table (pyarrow Table or RecordBatch, Polars DataFrame), for
    ``auto``'s estimate of the number of map tasks; None for streams and lazy relations."""
    try:
        if hasattr(data, "nbytes") and hasattr(data, "num_rows"):  # pyarrow Table, RecordBatch
            return int(data.nbytes)
        if hasattr(data, "estimated_size") and hasattr(data, "height"):  # Polars DataFrame
            return int(data.estimated_size())
    except (TypeError, ValueError, AttributeError):  # only a hint: never fail the shuffle
        return None
    return None


def _tls_setting(tls: Any) -> tuple[str, tuple[str, str, str] | None]:
    """``Cluster(tls=...)`` as the native mode ("on", "off", "mutual") and certificate files."""
    if tls is True:
        return "on", None
    if tls is False:
        return "off", None
    if tls == "mutual":
        return "mutual", None
    if isinstance(tls, dict):
        unknown = set(tls) - {"ca", "cert", "key", "mutual"}
        missing = {"ca", "cert", "key"} - set(tls)
        if unknown or missing:
            raise ValueError(
                f"tls= needs PEM file paths ca, cert and key (and optionally mutual); "
                f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        files = (str(tls["ca"]), str(tls["cert"]), str(tls["key"]))
        return ("mutual" if tls.get("mutual") else "on"), files
    raise ValueError(f'tls must be True, False, "mutual" or a dict of files, not {tls!r}')


def _storage_options(storage: Any, options: dict[str, str] | None) -> dict[str, str] | None:
    """``storage_options`` checked: string keys and values, and only with ``storage``."""
    if options is None:
        return None
    if storage is None:
        raise ValueError("storage_options= needs storage= (an object store URL)")
    if not isinstance(options, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in options.items()
    ):
        raise ValueError("storage_options must be a dict of str to str")
    return dict(options)


class Cluster:
    """A local cluster: ``workers`` worker processes on this machine, stopped on exit.

    ``memory_budget`` is each worker's block store budget (int bytes or ``"512MiB"``); blocks
    beyond it spill to fused segment files under ``spill_dir`` (a temporary directory by
    default). ``compression`` is ``"auto"`` (none on one host), ``"none"``, ``"lz4"`` or
    ``"zstd"``. ``timeout`` bounds every call and every wait, in seconds. ``speculation=k``
    turns on speculative execution: once half of a stage's map tasks are done, one still
    running after k times their median duration (and at least a second) is started again on
    another worker and the first attempt to finish is kept (off by default, as in Spark; tasks
    fed from this process, such as ``shuffle()`` input, are not copied).

    ``parity=r`` (0, 1 or 2; at least r + 1 workers) protects shuffles and dataset stages with
    Reed-Solomon parity (EC-Shuffle's forward coding): their blocks go to the worker that owns
    each partition (without merging, whatever the strategy), every map encodes r parity shards
    per stripe of its output onto other workers, and the blocks a lost worker held are rebuilt
    from the survivors and the parity instead of running their maps again (up to r workers
    lost at once). SQL queries recover from lineage and do not use it.

    ``tls`` secures every connection (driver to workers, worker to worker): ``True`` (the
    default) makes a CA and a certificate for this cluster when it starts; ``"mutual"`` also
    makes workers ask every client for a certificate signed by that CA; a dict
    ``{"ca": ..., "cert": ..., "key": ...}`` (PEM file paths, optionally ``"mutual": True``)
    uses certificates of your own, which must name ``127.0.0.1``; ``False`` speaks plaintext
    on loopback, where anyone who can read loopback traffic sees the token and the data.

    ``runtime="ray"`` hosts the workers on Ray instead of this machine (see
    :mod:`flightshuffle.ray_runtime`): one actor per worker in a placement group spread across
    nodes, each with ``ray_resources`` (default ``{"CPU": 1}``; also ``"memory"``, ``"GPU"``
    and custom resources); ``ray_address`` goes to ``ray.init`` when Ray is not initialised
    (None: a local instance or ``RAY_ADDRESS``, ``"auto"``, ``"ray://head:10001"``). The
    driver stays in this process and data moves between workers over Flight. ``spill_dir``
    then names the driver's scratch directory for tables given as Arrow data, which workers on
    other machines must see at the same path; workers spill to a temporary directory of their
    node. Made certificates name the nodes alive at start.

    ``addresses=["host1:7000", ...]`` (with ``token=`` and ``tls={"ca": path}``) dials workers
    you run with ``flightshuffle worker`` (:mod:`flightshuffle.static_runtime`); a lost one is
    recovered once its supervisor restarts it at its address (waited up to ``restart_wait`` s),
    or else (``take_over=True``, the default) on a stand-in process that a surviving worker
    starts beside itself for the lost slot; ``take_over=False`` fails the job instead.

    ``storage="s3://bucket/prefix"`` (or ``"file:///shared/dir"``) makes every shuffle
    *durable*: each map task's output is also written to that object store as one object
    (its blocks plus an index), and the manifest records each block's byte range. A worker
    lost after its maps committed then costs no map re-run: its blocks are read back by range
    onto its replacement (``recovery()["restored_blocks"]``). ``storage_options`` are
    ``object_store``'s options (``aws_endpoint``, ``aws_access_key_id``,
    ``aws_secret_access_key``, ``aws_region``, ``aws_allow_http``, ...); S3 credentials may
    also come from the ``AWS_*`` environment. They are sent to workers over the cluster's
    authenticated channel and never logged. The cluster checks at start that it can write to
    the store; objects are deleted with their shuffle. ``storage_stats()`` counts requests.
    Blocks forwarded by ``auto`` are not in the store (recovered as without it); pull,
    merged, push and two-level are durable end to end.

    ``disk_budget`` (bytes, with ``storage=``) makes the store the tier below each worker's
    local disk: past that many bytes of spill files, a worker moves its oldest closed spill
    segments to the store and reads their blocks back by range (``stats()`` shows
    ``disk_bytes``, ``tiered_segments``, ``tiered_bytes``). ``durable=False`` keeps the store
    as that tier only: map outputs are not written to it.

    ``event_log`` (a directory, created private) makes every SQL query write its event log
    there, one JSON object per line: tasks starting and ending (worker, attempt, rows, bytes,
    spill), exchanges chosen and sealed, workers lost and replaced, maps recomputed, blocks
    restored or rebuilt, and each stage's figures. ``last_event_log`` is the last query's
    file, ``last_report()`` its timeline as an HTML page (``flightshuffle report`` from the
    shell).

    ``small_query_rows``: a SQL query whose scans read at most this many rows in all runs
    whole on the driver, as one DataFusion process would, since stages would cost more than
    they spread (``EXPLAIN`` says so; ``SET flightshuffle.small_query_rows`` changes it per
    session). None takes ``FLIGHTSHUFFLE_SMALL_QUERY_ROWS`` from the environment if set, else
    2,000,000; 0 distributes every query.
    """

    def __init__(
        self,
        workers: int | None = None,
        memory_budget: int | str = "1GiB",
        spill_dir: str | None = None,
        compression: Literal["auto", "none", "lz4", "zstd"] = "auto",
        timeout: float = 600.0,
        speculation: float | None = None,
        strategy: Strategy = "pull",
        parity: int = 0,
        tls: bool | Literal["mutual"] | dict[str, Any] = True,
        runtime: Literal["local", "ray"] = "local",
        ray_address: str | None = None,
        ray_resources: dict[str, float] | None = None,
        storage: str | None = None,
        storage_options: dict[str, str] | None = None,
        durable: bool = True,
        disk_budget: int | str | None = None,
        event_log: str | os.PathLike[str] | None = None,
        addresses: Sequence[str] | None = None,
        token: str | None = None,
        restart_wait: float = 60.0,
        take_over: bool = True,
        small_query_rows: int | None = None,
    ) -> None:
        if addresses is not None:
            if runtime != "local":
                raise ValueError("addresses= names workers already running: not with runtime=")
            if workers is not None and workers != len(addresses):
                raise ValueError(f"workers={workers} but addresses= names {len(addresses)}")
            workers = len(addresses)
        elif token is not None:
            raise ValueError("token= is for workers at addresses=; a started cluster makes one")
        workers = 4 if workers is None else workers
        if workers < 1:
            raise ValueError("a cluster needs at least one worker")
        if storage is None and strategy in ("store", "store-two-level"):
            raise ValueError(
                f"strategy={strategy!r} exchanges through an object store: it needs storage="
            )
        if storage is None and (disk_budget is not None or not durable):
            raise ValueError(
                "disk_budget= and durable=False need storage= (the store spill segments move to)"
            )
        tls_mode, tls_files = _tls_setting(tls) if addresses is None else ("on", None)
        if parity not in (0, 1, 2):
            raise ValueError(f"parity must be 0, 1 or 2, not {parity!r}")
        if runtime not in ("local", "ray"):
            raise ValueError(f'runtime must be "local" or "ray", not {runtime!r}')
        self.runtime = runtime
        self._ray: Any = None
        # What the native cluster is made with (NativeCluster's ClusterOptions).
        options = {
            "memory_budget": parse_bytes(memory_budget),
            "spill_dir": None if spill_dir is None else str(spill_dir),
            "compression": compression,
            "timeout_secs": float(timeout),
            "speculation": None if speculation is None else float(speculation),
            "strategy": strategy,
            "parity": int(parity),
            "tls": tls_mode,
            "tls_files": tls_files,
            "storage": None if storage is None else str(storage),
            "storage_options": _storage_options(storage, storage_options),
            "durable": bool(durable),
            "disk_budget": None if disk_budget is None else parse_bytes(disk_budget),
            "event_log": None if event_log is None else os.fspath(event_log),
            "small_query_rows": _small_query_rows(small_query_rows),
        }
        if addresses is not None:
            from flightshuffle import static_runtime

            self.runtime = "static"
            self._native = static_runtime.connect(
                addresses, token, tls, restart_wait, take_over, options
            )
        elif runtime == "ray":
            self._native = self._start_on_ray(workers, options, tls, ray_address, ray_resources)
        else:
            self._native = NativeCluster(workers, worker_command(), options)
        self.strategy = strategy
        self.parity = parity
        self.workers = workers
        self.last_metrics: dict[str, Any] = {}
        self.last_online_plan = ""
        """The staged plan of the last online SQL query (its statistics query's stages)."""
        # Parquet paths of tables registered here (for online SQL).
        self._tables: dict[str, str] = {}
        self._arrow_tables = 0

    def _start_on_ray(
        self,
        workers: int,
        options: dict[str, Any],
        tls: Any,
        ray_address: str | None,
        ray_resources: dict[str, float] | None,
    ) -> NativeCluster:
        from flightshuffle.ray_runtime import RayWorkers

        _tls_setting(tls)  # validated before any actor starts
        parity = options["parity"]
        if parity > 0 and workers < parity + 1:
            raise ValueError(f"parity={parity} needs at least {parity + 1} workers")
        timeout = options["timeout_secs"]
        # Placing and starting workers waits at most `timeout` (and never over 2 minutes).
        startup = min(timeout, 120.0)
        self._ray = ray = RayWorkers(workers, ray_address, ray_resources, tls, startup)
        try:
            compression = options["compression"]
            if compression == "auto":  # LZ4 pays off between machines, not on one (FACTS.md)
                compression = "none" if len(ray.node_ips) <= 1 else "lz4"
            addresses = ray.start(
                [
                    "--memory-budget",
                    str(options["memory_budget"]),
                    "--compression",
                    compression,
                    "--timeout-secs",
                    str(max(1, int(timeout))),
                ]
                + (
                    []
                    if options["disk_budget"] is None
                    else ["--disk-budget", str(options["disk_budget"])]
                )
            )
            options = {**options, "tls": ray.tls_mode, "tls_files": ray.tls_files}
            return NativeCluster.connect(addresses, ray.token, ray.replace, options)
        except BaseException:
            ray.stop()
            raise

    def shuffle(
        self,
        data: Any,
        by: str | Sequence[str] | None = None,
        partitions: int | None = None,
        strategy: Strategy | None = None,
        partitioner: Literal["hash", "range", "round_robin"] | None = None,
        output: Literal["arrow", "polars"] = "arrow",
        map_bytes: int | str = "64MiB",
        parity: int | None = None,
        progress: bool | None = None,
    ) -> ShuffleResult:
        """Shuffle ``data`` into ``partitions`` reduce partitions.

        ``data`` is anything with ``__arrow_c_stream__`` (pyarrow Table or RecordBatchReader,
        Polars DataFrame, DuckDB relation), read zero-copy and cut into map tasks of about
        ``map_bytes``. Rows are hashed on the ``by`` columns (``partitioner="hash"``, the
        default when ``by`` is given), ordered by them (``"range"``: the input is read fully
        first to sample boundaries), or dealt in turn (``"round_robin"``, the default without
        ``by``). Equal keys always land in the same partition.

        ``strategy`` (default: the cluster's) is one of :data:`STRATEGIES`: ``"pull"`` leaves
        every map output where it ran; ``"merged"`` merges the small outputs each worker holds
        into a few large blocks per partition while the maps run (Riffle); ``"push"`` sends
        each partition's blocks to the worker that reduces it while the maps run, which
        merges them (Magnet); ``"two-level"`` pushes within a row of a √N grid and reads
        within a column (Seer), for many workers; ``"store"`` (with ``storage=``) exchanges
        through the object store: every map writes one object, readers fetch their partition
        from each object by range (Seer's direct exchange); ``"store-two-level"`` adds Seer's
        second level, which gathers each column of partitions of a group of map objects into
        one object first: about 2·p·√p requests instead of p², for many maps and partitions;
        ``"auto"`` on a durable cluster weighs both against Flight. ``parity`` (default: the cluster's) protects
        this shuffle with that many parity shards per stripe (see :class:`Cluster`).
        A bar of partitions read shows on a terminal (``progress=False`` hides it).
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
        count = 2 * self.workers if partitions is None else int(partitions)
        native = self._native.shuffle(
            data,
            keys,
            count,
            strategy,
            kind,
            parse_bytes(map_bytes),
            _size_of(data),
            None if parity is None else int(parity),
        )
        return ShuffleResult(native, output, PartitionProgress(count, showing(progress)))

    def register_parquet(self, name: str, path: str) -> None:
        """Register a Parquet file or directory as table ``name`` for :meth:`sql`."""
        self._native.register_parquet(name, str(path))
        self._tables[name] = os.fspath(path)

    # -- datasets: Polars and DuckDB work on the workers ----------------------------------------

    def read_parquet(self, paths: Any, min_splits: int | None = None) -> Dataset:
        """A distributed dataset over Parquet files (a file, a directory, a glob, or a list).
        Each row group is one input split (row groups are cut into row ranges when there would
        be fewer than ``min_splits`` splits, by default two per worker)."""
        from flightshuffle.dataset import Dataset, Source, make_splits, parquet_files

        splits, schema = make_splits(parquet_files(paths), min_splits or 2 * self.workers)
        return Dataset(self, Source(splits, schema))

    def from_arrow(self, data: Any, min_splits: int | None = None) -> Dataset:
        """A distributed dataset over Arrow data (pyarrow, Polars, DuckDB relation, anything
        with ``__arrow_c_stream__``); it is written to Parquet in the cluster's scratch
        directory so every worker can read its splits."""
        path = self._write_arrow(data, "dataset")
        return self.read_parquet(path, min_splits)

    def _never_null(self, names: list[str]) -> set[str]:
        """Columns that hold no null in every file of the registered tables ``names`` (an
        unknown table is reported later, by the query)."""
        from flightshuffle import footers
        from flightshuffle.dataset import parquet_files

        try:
            return footers.never_null(
                parquet_files(self._tables[n]) for n in names if n in self._tables
            )
        except (OSError, ValueError):
            return set()

    def _write_arrow(self, data: Any, stem: str) -> str:
        """Write Arrow data to a new Parquet file in the cluster's scratch directory (streamed,
        row groups of 128Ki rows: the input splits of datasets); returns its path."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not _exports_arrow(data):
            raise TypeError(f"expected Arrow data (__arrow_c_stream__), not {type(data).__name__}")
        if not re.fullmatch(r"[A-Za-z0-9_]+", stem):
            raise ValueError(f"table name {stem!r} must be letters, digits and underscores")
        if hasattr(data, "__arrow_c_stream__"):
            reader = pa.RecordBatchReader.from_stream(data)
        else:
            reader = pa.Table.from_batches([pa.record_batch(data)]).to_reader()
        if not self.spill_root:
            raise RuntimeError("the cluster is closed")
        # The cluster's own private root (0700, removed when it closes): no other cluster,
        # even one sharing ``spill_dir``, reads or replaces these files.
        root = os.path.join(self.spill_root, "datasets")
        os.makedirs(root, mode=0o700, exist_ok=True)
        self._arrow_tables += 1
        path = os.path.join(root, f"{stem}-{self._arrow_tables}.parquet")
        rows = 128 * 1024
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "wb") as f, pq.ParquetWriter(f, reader.schema) as w:
            pending, count = [], 0
            for batch in reader:
                pending.append(batch)
                count += batch.num_rows
                if count >= rows:
                    w.write_table(pa.Table.from_batches(pending), row_group_size=rows)
                    pending, count = [], 0
            if pending:
                w.write_table(pa.Table.from_batches(pending), row_group_size=rows)
        return path

    def online(
        self,
        query: str | Grouped,
        rounds: int = 10,
        tables: dict[str, Any] | None = None,
        engine: Literal["datafusion", "duckdb"] = "datafusion",
        seed: int | None = None,
        confidence: float = 0.95,
        progress: bool | None = None,
        min_splits: int | None = None,
    ) -> Iterator[OnlineResult]:
        """Online aggregation: a generator of partial results, one per round, refining until the
        final (exact) one.

        ``query`` is SQL (``SELECT keys, SUM/COUNT/AVG/MIN/MAX(expr) ... FROM t [WHERE ...]
        GROUP BY keys``, with ratios ``SUM(a) / SUM(b)``, inner and left joins, a derived
        table that computes columns, and subqueries that run first, exactly or as semi and
        anti joins: docs/guide/online.md) over
        ``tables`` (as in :meth:`sql`) or a table registered here, run by ``engine``
        (DataFusion or DuckDB); or a ``dataset.group_by(keys).agg(exprs)`` with
        Polars expressions. The input is read in sampling units, in a random order
        (``seed``), in ``rounds`` rounds. SQL on DataFusion: at least 64 units (or
        ``min_splits``) of at least 8,192 rows within a row group, several per map task,
        after an early first round of one task per worker; otherwise one split per map task,
        at least ``min_splits`` (default ``2 * rounds``). Each result has ``.progress``
        (fraction of the input read), ``.final`` and ``.estimates`` (a Polars DataFrame:
        keys, then per aggregate ``name``, ``name_low``, ``name_high``, the estimate and its
        ``confidence`` interval from the spread between the units read, and
        ``name_reliable``, false while the group was seen in fewer than 5 units; MIN/MAX have
        no interval). A tqdm bar shows progress on a terminal."""
        from flightshuffle import online as ol
        from flightshuffle.dataset import Grouped, make_splits, parquet_files, shuffled

        started = time.perf_counter()

        if engine not in ("datafusion", "duckdb"):
            raise ValueError(f"engine must be 'datafusion' or 'duckdb', not {engine!r}")
        if not 0 < confidence < 1:
            raise ValueError("confidence must be between 0 and 1")
        want = max(min_splits or 0, 2 * rounds)
        plan = None
        if isinstance(query, Grouped):
            if query.aggs is None:
                raise ValueError(
                    "online aggregation supports sum, mean, count, len, min and max of "
                    "row-wise expressions"
                )
            if any(node.op is None for node in query.base.operators):
                raise ValueError("online aggregation cannot follow a repartition")
            base = query.base
            files = sorted({s.path for s in base.source.splits})
            splits, _ = make_splits(files, want)
            pre = [node.op for node in base.operators]
            aggs = [ol.AggRef(a.name, a.kind) for a in query.aggs]
            stats: Any = ol.PolarsStats(query.keys, query.aggs)
            keys, columns, order, limit = query.keys, None, None, None
        elif isinstance(query, str):
            for name, source in (tables or {}).items():
                if isinstance(source, (str, os.PathLike)):
                    self._tables[name] = os.fspath(source)
                else:
                    self._tables[name] = self._write_arrow(source, name)

            plan, kept = ol.plan_online_sql(self, query, engine)
            if engine == "datafusion":
                results = ol.run_sql(
                    self, plan, self._tables, rounds, want, seed, confidence, progress, started
                )
                return ol.forgetting(self, results, kept) if kept else results
            ol.forget(self, kept)
            if plan.table not in self._tables:
                raise ValueError(
                    f"unknown table {plan.table!r}: pass it in tables= or register_parquet() it"
                )
            splits, schema = make_splits(parquet_files(self._tables[plan.table]), want)
            columns = [c for c in schema.names if c in plan.columns] or None
            pre, aggs, keys = [], plan.aggs, plan.keys
            stats = ol.SqlStats(engine, plan.table, plan.stats, plan.keys, plan.stat_of, plan.aggs)
            order, limit = plan.order, plan.limit
        else:
            raise TypeError("online() takes SQL text or a dataset.group_by(...).agg(...)")
        return ol.run(
            self,
            shuffled(splits, seed),
            pre,
            stats,
            columns,
            keys,
            aggs,
            rounds,
            confidence,
            progress,
            order,
            limit,
            plan,
            started,
        )

    def sql(
        self,
        query: str,
        tables: dict[str, Any] | None = None,
        output: Literal["arrow", "polars"] = "arrow",
        strategy: Strategy | None = None,
        progress: bool | None = None,
    ) -> Any:
        """Run SQL distributed on the cluster (DataFusion plans, flightshuffle exchanges).

        ``tables`` maps names to Parquet paths or to Arrow data (anything with
        ``__arrow_c_stream__``: pyarrow, Polars, DuckDB relations), which is written to Parquet
        in the cluster's scratch directory so every worker can scan it. ``EXPLAIN`` and
        ``EXPLAIN ANALYZE`` return the staged plan. Per-exchange figures of the last query are
        in :attr:`last_metrics`. ``strategy`` sets the strategy of every exchange of this query
        (default: ``SET flightshuffle.strategy = '...'`` if the session ran one, else the
        cluster's). A bar of exchanges done (with rows, bytes and spill written) shows on a
        terminal (``progress=False`` hides it).
        """
        for name, source in (tables or {}).items():
            if isinstance(source, (str, os.PathLike)):
                self.register_parquet(name, os.fspath(source))
            elif _exports_arrow(source):
                self.register_parquet(name, self._write_arrow(source, name))
            else:
                raise TypeError(
                    f"table {name!r}: expected a Parquet path or Arrow data, "
                    f"not {type(source).__name__}"
                )
        with QueryProgress(self._native, "sql", showing(progress)):
            table, metrics = self._native.sql(query, strategy)
        self.last_metrics = json.loads(metrics)
        if output == "polars":
            import polars as pl

            return pl.from_arrow(table)
        return table

    def sql_single_process(self, query: str) -> tuple[Any, float]:
        """Run ``query`` on single-process DataFusion in this process over the tables registered
        here (the baseline the cluster is compared with); returns (pyarrow.Table, seconds)."""
        return self._native.sql_single_process(query)

    def explain(self, query: str, analyze: bool = False, strategy: Strategy | None = None) -> str:
        """The stages of ``query`` and the exchanges between them; ``analyze`` runs it and adds
        rows, bytes, blocks, spill and time per exchange."""
        return self._native.explain(query, analyze, strategy)

    def calibration(self) -> dict[str, float]:
        """What the ``auto`` strategy measured on this machine (on first use, or when the
        cluster started with ``strategy="auto"``): per-core partition, encode and decode rates,
        the cost of one small block, disk write/read rates, request latency, transport rate."""
        return json.loads(self._native.calibration_json())

    def stats(self) -> list[dict[str, int]]:
        """Per-worker figures: the block store's memory, spilled and restored bytes; RSS now
        and at peak; task admission (tasks admitted, waited, over the budget, the most bytes
        granted and tasks running at once; ``granted_bytes`` and ``running_tasks`` now: a cancelled
        Python task keeps its grant until its body stops); DataFusion operators' peak bytes, and
        of those the hash join build sides' (``peak_unspillable_bytes``)."""
        return json.loads(self._native.stats_json())

    def remove_worker(self, worker: int) -> None:
        """Take worker ``worker`` out of the cluster for good, losing nothing: every shuffle
        still alive (held datasets, a result being read) must be durable (``storage=``) and
        complete, and is read from its objects in the store from then on; the worker's process
        (its Ray actor) stops (a static cluster's keeps running), and the last worker takes
        its index. Call it between jobs. Refused with ``ValueError`` or ``ShuffleError`` (naming the shuffle) when that would
        lose rows, and with nothing changed."""
        if not isinstance(worker, int) or worker < 0:
            raise ValueError(f"worker must be an index 0..{self.workers - 1}, not {worker!r}")
        self._native.remove_worker(worker)
        if self._ray is not None:
            self._ray.remove(worker)
        self.workers -= 1

    @property
    def worker_pids(self) -> list[int]:
        if self._ray is not None:
            return self._ray.pids()
        return list(self._native.worker_pids())

    def recovery(self) -> dict[str, int]:
        """What worker loss cost so far: ``replacements`` (lost workers given a new process),
        ``recomputed_maps`` (map outputs run again from their lineage because the worker
        holding them was lost), ``rebuilt_blocks`` (blocks rebuilt from parity) and
        ``rerun_jobs`` (jobs run again whole: a loss their stages could not recover from) and
        ``restored_blocks`` (blocks of durable shuffles read back from the object store)."""
        replacements, recomputed, rebuilt, reruns, restored = self._native.recovery()
        return {
            "replacements": replacements,
            "recomputed_maps": recomputed,
            "rebuilt_blocks": rebuilt,
            "rerun_jobs": reruns,
            "restored_blocks": restored,
        }

    def storage_stats(self) -> dict[str, int]:
        """Requests made to the object store of durable shuffles (``storage=``), by the driver
        and the live workers: ``puts`` (objects written, by one PUT or one multipart upload),
        ``put_parts``, ``gets`` (ranged GETs), ``lists``, ``deletes``, ``bytes_written`` and
        ``bytes_read``. All zero without a store."""
        return json.loads(self._native.storage_stats_json())

    def connection_info(self) -> dict[str, Any]:
        """How to reach the workers with your own Flight client: ``addresses`` (``host:port``
        strings), ``token`` (send it as ``authorization: Bearer <token>`` on every call) and
        ``ca`` (PEM text of the certificate authority; None: the workers speak plaintext on
        loopback). Under mutual TLS also ``cert`` and ``key`` (PEM text of a client
        certificate the workers accept). The token grants running code on every worker: keep
        it secret."""
        info: dict[str, Any] = {
            "addresses": self.worker_addresses,
            "token": self._native.token(),
            "ca": None,
        }
        tls = self._native.tls()
        if tls is not None:
            info["ca"], identity = tls
            if identity is not None:
                info["cert"], info["key"] = identity
        return info

    @property
    def last_event_log(self) -> str | None:
        """The event log of the last SQL query (``Cluster(event_log=DIR)``), or None."""
        return self._native.last_event_log()

    def last_report(self) -> str:
        """The last SQL query's event log as a self-contained HTML page (a timeline of its
        tasks per worker, recovery marked, per-stage quantiles); needs ``event_log=``."""
        from flightshuffle.report import report

        path = self.last_event_log
        if path is None:
            raise ValueError("no event log: start the cluster with event_log=DIR and run a query")
        return report(path)

    def serve_flight_sql(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        results: Literal["workers", "driver"] = "workers",
    ) -> dict[str, Any]:
        """Serve Arrow Flight SQL from this process over the cluster's SQL session (its tables,
        ``SET flightshuffle.*``), until the cluster closes; returns ``{"uri", "token", "ca"}``.

        Any Flight SQL client runs distributed SQL through it, e.g. ADBC::

            import adbc_driver_flightsql.dbapi as flight_sql
            from adbc_driver_flightsql import DatabaseOptions

            info = cluster.serve_flight_sql()
            conn = flight_sql.connect(info["uri"], db_kwargs={
                DatabaseOptions.AUTHORIZATION_HEADER.value: "Bearer " + info["token"],
                DatabaseOptions.TLS_ROOT_CERTS.value: info["ca"],
            }, autocommit=True)

        Every call needs ``authorization: Bearer <token>`` (the cluster's token: keep it
        secret). Under TLS (the default) the endpoint has a certificate of its own for
        ``localhost``, ``127.0.0.1`` and ``host``, signed by the CA in ``ca``; on a plaintext
        cluster the URI is ``grpc+tcp://`` and ``ca`` is None. Port 0 picks a free port; a
        second call replaces the first endpoint. ``results="workers"`` (the default) leaves
        each query's rows on the workers that made them, read by the client straight from
        them (``ca`` then also holds the cluster's CA); ``results="driver"`` hands every result
        out from the endpoint. ``PollFlightInfo`` (ADBC's incremental execution) runs a query
        online aggregation supports online, one endpoint per round. See
        ``docs/guide/flight-sql.md``."""
        from flightshuffle.online import flight_sql_rounds

        online = functools.partial(flight_sql_rounds, self)
        uri, token, ca = self._native.serve_flight_sql(host, int(port), results, online)
        return {"uri": uri, "token": token, "ca": ca}

    @property
    def worker_addresses(self) -> list[str]:
        return list(self._native.worker_addresses())

    @property
    def spill_root(self) -> str | None:
        return self._native.spill_root()

    @property
    def native(self) -> NativeCluster:
        """The native driver of this cluster (``flightshuffle._native.NativeCluster``): what the
        dataset and online modules drive; its calls block without ``wait()``'s Ctrl-C."""
        return self._native

    def close(self) -> None:
        """Stop every worker process (and, on Ray, every worker actor)."""
        self._native.close()
        if self._ray is not None:
            self._ray.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SMALL_QUERY_ROWS = 2_000_000
"""The default of ``Cluster(small_query_rows=)``: rows read at most by a query run whole."""


def _small_query_rows(rows: int | None) -> int:
    """``small_query_rows=`` as given, else ``FLIGHTSHUFFLE_SMALL_QUERY_ROWS``, else the
    default; a clear error for a negative or non-integer value."""
    import operator

    where = "small_query_rows"
    if rows is None:
        env = os.environ.get("FLIGHTSHUFFLE_SMALL_QUERY_ROWS", "").strip()
        if not env:
            return SMALL_QUERY_ROWS
        where = "FLIGHTSHUFFLE_SMALL_QUERY_ROWS"
        try:
            rows = int(env)
        except ValueError:
            raise ValueError(f"{where}={env!r} is not a row count") from None
    try:
        count = operator.index(rows)  # ints, numpy ints; not floats or bools
    except TypeError:
        count = -1
    if isinstance(rows, bool) or not 0 <= count < 2**64:
        raise ValueError(f"{where} must be a row count (0 or more), not {rows!r}")
    return count
