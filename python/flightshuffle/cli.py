"""The ``flightshuffle`` command line: what users run (``sql``, ``serve``, ``online``,
``calibrate``, ``storage``, ``worker``, ``certs``). The benchmarks are ``flightshuffle-bench``, a package of the repository that the
wheel does not ship."""

from __future__ import annotations

import argparse
import json
import sys
import time

from flightshuffle import Cluster, ShuffleError
from flightshuffle.estimates import value_columns
from flightshuffle.online import plot_history


def _tables(specs: list[str]) -> dict[str, str]:
    """``--table name=path`` options as a mapping."""
    tables = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--table takes name=path, not {spec!r}")
        tables[name] = path
    return tables


def _cluster(args: argparse.Namespace) -> Cluster:
    """A local cluster of ``--workers``, or the workers at ``--addresses`` (a static
    cluster: ``--token-file`` and ``--tls-ca``, or ``--insecure``)."""
    if not getattr(args, "addresses", None):
        return Cluster(workers=args.workers, memory_budget=args.memory_budget)
    if not args.token_file:
        raise ValueError("--addresses needs --token-file (the token the workers were given)")
    with open(args.token_file) as f:
        token = f.readline().strip()
    if args.insecure:
        tls: object = False
    elif args.tls_ca:
        tls = {"ca": args.tls_ca}
    else:
        raise ValueError("--addresses needs --tls-ca (the CA of the workers' certificates)")
    addresses = [a for a in args.addresses.split(",") if a]
    return Cluster(addresses=addresses, token=token, tls=tls)


def _worker_addresses(p: argparse.ArgumentParser) -> None:
    """The options naming workers started by hand (``flightshuffle worker``)."""
    p.add_argument(
        "--addresses",
        metavar="HOST:PORT,...",
        help="use the workers running at these addresses instead of starting --workers",
    )
    p.add_argument("--token-file", help="with --addresses: a file holding the workers' token")
    p.add_argument("--tls-ca", help="with --addresses: the CA of the workers' certificates")
    p.add_argument(
        "--insecure", action="store_true", help="with --addresses: the workers speak plaintext"
    )


def _certs(args: argparse.Namespace) -> int:
    """A CA, one worker certificate naming the hosts, and a token, for a static cluster."""
    import os
    import secrets

    from flightshuffle._native import make_tls

    if not args.host:
        raise ValueError("name at least one --host the workers are reached at")
    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    ca, cert, key = make_tls(args.dir, list(args.host))
    token = os.path.join(args.dir, "token")
    if not os.path.exists(token):
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
    print(json.dumps({"ca": ca, "cert": cert, "key": key, "token_file": token}))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """What the ``auto`` strategy measures on this machine, as JSON."""
    with Cluster(workers=args.workers, memory_budget=args.memory_budget) as c:
        print(json.dumps(c.calibration(), indent=1, sort_keys=True))
    return 0


def _sql(args: argparse.Namespace) -> int:
    tables = _tables(args.table)
    with _cluster(args) as c:
        table = c.sql(args.query, tables=tables)
        if args.query.lstrip().lower().startswith("explain"):
            print("\n".join(table.column(0).to_pylist()))
        else:
            import polars as pl

            with pl.Config(tbl_rows=args.max_rows, tbl_cols=-1):
                print(pl.from_arrow(table))
            print(
                f"{table.num_rows} rows in {c.last_metrics.get('seconds', 0):.3f} s",
                file=sys.stderr,
            )
    return 0


def _serve(args: argparse.Namespace) -> int:
    """A local cluster serving Flight SQL until interrupted. The token and the CA go to
    owner-only files in a private directory (never to the terminal or a log)."""
    import os
    import signal
    import tempfile

    tables = _tables(args.table)
    with _cluster(args) as c:
        for name, path in tables.items():
            c.register_parquet(name, path)
        info = c.serve_flight_sql(host=args.host, port=args.port, results=args.results)
        secrets = tempfile.mkdtemp(prefix="flightshuffle-serve-")  # mode 0700
        paths = {"token_file": os.path.join(secrets, "token")}
        if info["ca"] is not None:
            paths["ca_file"] = os.path.join(secrets, "ca.pem")
        for key, text in (("token_file", info["token"]), ("ca_file", info["ca"])):
            if key in paths:
                fd = os.open(paths[key], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
        print(json.dumps({"uri": info["uri"], **paths}), flush=True)
        print("serving Flight SQL; Ctrl-C stops", file=sys.stderr, flush=True)

        def stop(*_: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            for path in paths.values():
                os.remove(path)
            os.rmdir(secrets)
    return 0


def _report(args: argparse.Namespace) -> int:
    """An event log as an HTML page (the newest log when given a directory)."""
    import os

    from flightshuffle.report import report

    path = args.log
    if os.path.isdir(path):
        logs = sorted(
            (os.path.join(path, f) for f in os.listdir(path) if f.endswith(".jsonl")),
            key=os.path.getmtime,
        )
        if not logs:
            raise ValueError(f"no event log (*.jsonl) in {path}")
        path = logs[-1]
    page = report(path)
    out = args.output or os.path.splitext(path)[0] + ".html"
    with open(out, "w") as f:
        f.write(page)
    print(out)
    return 0


def first_within(history: list, final, keys: list[str], names: list[str], rel: float):
    """The first partial result whose every estimate is within ``rel`` of the final answer."""
    want = final.estimates.select(keys + names)
    for r in history:
        got = r.estimates.select(keys + names).join(want, on=keys, how="full", suffix="_f")
        ok = got.height == want.height
        for n in names:
            err = ((got[n] - got[f"{n}_f"]).abs() / got[f"{n}_f"].abs()).fill_nan(0.0)
            ok = ok and err.null_count() == 0 and float(err.max() or 0.0) <= rel
        if ok:
            return r
    return final


def _online(args: argparse.Namespace) -> int:
    tables = _tables(args.table)
    if not tables:
        raise ValueError(
            "online needs its tables: --table NAME=PATH (repeatable); "
            "`flightshuffle-bench online` runs it on generated TPC-H data"
        )
    return run_online(args, tables, args.sql)


def run_online(args: argparse.Namespace, tables: dict[str, str], query: str) -> int:
    """``online`` on ``tables``: the rounds, the report as JSON, the plot if asked."""
    with Cluster(workers=args.workers, memory_budget=args.memory_budget) as c:

        def timed(rounds: int, show: bool | None = None) -> tuple[list, float]:
            start = time.perf_counter()
            history = list(
                c.online(
                    query,
                    rounds=rounds,
                    tables=tables,
                    engine=args.engine,
                    seed=args.seed,
                    progress=show,
                    min_splits=4 * args.rounds,  # the same splits for every run
                )
            )
            return history, time.perf_counter() - start

        cold = None
        if args.compare:
            # The first query on fresh workers pays one-time costs (first DataFusion session,
            # first Parquet reads); run the non-streaming form once first so both timed runs
            # are warm.
            cold = timed(1, False)[1]
        history, streaming = timed(args.rounds)
        final = history[-1]
        est = final.estimates
        names = [n for n in est.columns if f"{n}_low" in est.columns]
        keys = [k for k in value_columns(est.columns) if k not in names]
        interval = [n for n in names if est[f"{n}_low"].null_count() == 0]
        close = first_within(history, final, keys, interval, args.within)
        report = {
            "query": query,
            "workers": args.workers,
            "rounds": len(history),
            "splits": final.maps_total,
            "engine": args.engine,
            "streaming_seconds": streaming,
            "first_estimate_seconds": history[0].elapsed,
            "within": args.within,
            "within_seconds": close.elapsed,
            "within_progress": close.progress,
            "within_over_full": close.elapsed / streaming,
        }
        if args.compare:
            # Same splits, one round: the shuffle is folded once, after every map ran.
            non_streaming = timed(1, False)[1]
            report["cold_non_streaming_seconds"] = cold
            report["non_streaming_seconds"] = non_streaming
            report["streaming_over_non_streaming"] = streaming / non_streaming
            report["within_over_non_streaming"] = close.elapsed / non_streaming
            start = time.perf_counter()
            c.sql(query, tables=tables)
            report["distributed_sql_seconds"] = time.perf_counter() - start
    with pl_config():
        print(est)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot_history(history, keys, interval or names, args.plot, args.top)
        print(f"plot written to {args.plot}")
    return 0


def pl_config():
    import polars as pl

    return pl.Config(tbl_cols=12, tbl_rows=20, tbl_width_chars=160)


def online_arguments(o: argparse.ArgumentParser) -> None:
    """The options of ``online`` besides its query and tables."""
    o.add_argument("--workers", type=int, default=2)
    o.add_argument("--memory-budget", default="2GiB")
    o.add_argument("--rounds", type=int, default=10)
    o.add_argument("--engine", default="datafusion", choices=["datafusion", "duckdb"])
    o.add_argument("--seed", type=int, default=None)
    o.add_argument("--within", type=float, default=0.05, help="relative error to report")
    o.add_argument(
        "--compare",
        action="store_true",
        help="also time the same query in one round (non-streaming) and as distributed SQL",
    )
    o.add_argument("--plot", help="write estimate/interval vs time (PNG; needs matplotlib)")
    o.add_argument("--top", type=int, default=4, help="groups to plot")
    o.add_argument("--json", help="also write the report as JSON to this file")


def parse_age(text: str) -> float:
    """``"90"``, ``"30m"``, ``"12h"`` or ``"7d"`` as seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    scale = units.get(t[-1:], 0)
    number = t[:-1] if scale else t
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"--older-than {text!r}: give seconds or a number with s, m, h or d")
    return value


def _sweep(args: argparse.Namespace) -> int:
    from flightshuffle._native import storage_sweep

    options = {}
    for kv in args.option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {kv!r}: expected KEY=VALUE")
        options[key] = value
    gone = storage_sweep(args.url, options, parse_age(args.older_than), args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for path, size in gone:
        print(f"{verb} {path} ({size} bytes)")
    total = sum(size for _, size in gone)
    print(f"{verb} {len(gone)} object(s), {total} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flightshuffle", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser(
        "calibrate", help="measure this machine as the auto strategy does; print JSON"
    )
    k.add_argument("--workers", type=int, default=2)
    k.add_argument("--memory-budget", default="1GiB")
    k.set_defaults(run=_calibrate)

    q = sub.add_parser("sql", help="run one SQL query on a local cluster")
    q.add_argument("query")
    q.add_argument("--workers", type=int, default=2)
    q.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a Parquet file or directory (repeatable)",
    )
    q.add_argument("--memory-budget", default="2GiB")
    q.add_argument("--max-rows", type=int, default=20)
    _worker_addresses(q)
    q.set_defaults(run=_sql)

    sv = sub.add_parser(
        "serve",
        help="serve Arrow Flight SQL on a local cluster (ADBC, JDBC, BI tools)",
        description="Start a local cluster and serve Arrow Flight SQL from this process until "
        "Ctrl-C. Prints one JSON line: the uri, and files holding the token (send "
        "'authorization: Bearer <token>') and the CA certificate to trust.",
    )
    sv.add_argument("--workers", type=int, default=2)
    sv.add_argument(
        "--table", action="append", default=[], metavar="NAME=PATH", help="Parquet table"
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    sv.add_argument(
        "--results",
        choices=["workers", "driver"],
        default="workers",
        help="where clients read results: straight from the workers holding them (default; "
        "clients must reach the workers) or from this endpoint",
    )
    sv.add_argument("--memory-budget", default="2GiB")
    _worker_addresses(sv)
    sv.set_defaults(run=_serve)

    rp = sub.add_parser(
        "report",
        help="an event log as a self-contained HTML timeline",
        description="Render an event log (Cluster(event_log=DIR)) as one HTML page: tasks per "
        "worker on a timeline, recovery marked, per-stage quantiles. Prints the page's path.",
    )
    rp.add_argument("log", help="a .jsonl event log, or a directory (its newest log)")
    rp.add_argument("-o", "--output", help="the page (default: the log's name with .html)")
    rp.set_defaults(run=_report)

    o = sub.add_parser(
        "online",
        help="online aggregation: estimates with 95%% intervals that refine every round",
    )
    o.add_argument("--sql", required=True, help="the aggregate query")
    o.add_argument(
        "--table", action="append", default=[], metavar="NAME=PATH", help="Parquet table"
    )
    online_arguments(o)
    o.set_defaults(run=_online)

    st = sub.add_parser("storage", help="object stores of durable shuffles")
    st_sub = st.add_subparsers(dest="storage_command", required=True)
    sw = st_sub.add_parser(
        "sweep",
        help="delete objects that crashed clusters left (stopped clusters leave none)",
        description="Delete the objects of flightshuffle runs under URL last modified more "
        "than --older-than ago (no other object is touched). Credentials come from the AWS_* "
        "environment (a command line is visible to other users); --option names the others.",
    )
    sw.add_argument("url", help="the cluster's storage= URL, e.g. s3://bucket/prefix")
    sw.add_argument(
        "--older-than", required=True, help="an age: seconds, or 30m, 12h, 7d (required)"
    )
    sw.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an object_store option such as aws_endpoint=... (repeatable)",
    )
    sw.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    sw.set_defaults(run=_sweep)

    ce = sub.add_parser(
        "certs",
        help="make a CA, a worker certificate and a token for workers started by hand",
        description="Write ca.pem, ca.key, worker.pem, worker.key (private files) naming the "
        "given hosts, and a random token file unless one is there. Workers serve "
        "--tls-cert worker.pem --tls-key worker.key --tls-ca ca.pem --token-file token; the "
        "driver trusts ca.pem (Cluster(addresses=..., tls={'ca': ...})).",
    )
    ce.add_argument("dir", help="directory for the files (made private)")
    ce.add_argument(
        "--host", action="append", default=[], help="a name or IP the workers are reached at"
    )
    ce.set_defaults(run=_certs)

    # Listed in the help; its arguments are the worker's own (`flightshuffle worker --help`), so
    # they are handed over before argparse sees them.
    sub.add_parser(
        "worker", help="run one worker process (for clusters started by hand)", add_help=False
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        from flightshuffle import worker

        worker.main(argv[1:])
        return 0
    args = p.parse_args(argv)
    try:
        return args.run(args)
    except (ShuffleError, ValueError) as e:
        print(f"flightshuffle: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        # A missing or unreadable file: one line, as for a SQL error, not a traceback.
        where = f": {e.filename}" if e.filename else ""
        print(f"flightshuffle: {e.strerror or e}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
