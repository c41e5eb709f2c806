"""The ``flightshuffle`` and ``flightshuffle-bench`` command lines: every subcommand's
``--help`` prints and exits 0 (a bare ``%`` in one help string once made ``flightshuffle --help``
a traceback); the user's command lists only what users run; bad input is one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flightshuffle import cli
from flightshuffle_bench import cli as bench_cli

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "flightshuffle"


def help_of(capsys: pytest.CaptureFixture[str], main, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def commands_of(capsys: pytest.CaptureFixture[str], main) -> list[str]:
    commands = re.search(r"\{([a-z,-]+)\}", help_of(capsys, main, ["--help"]))
    assert commands is not None
    return commands.group(1).split(",")


def test_the_user_command_lists_only_user_commands_and_each_prints_its_help(capsys):
    names = commands_of(capsys, cli.main)
    assert sorted(names) == [
        "calibrate",
        "certs",
        "online",
        "report",
        "serve",
        "sql",
        "storage",
        "worker",
    ]
    for name in names:
        if name != "worker":  # its --help is the worker's own, below
            assert "usage: flightshuffle " + name in help_of(capsys, cli.main, [name, "--help"])


def test_flightshuffle_worker_hands_its_arguments_to_the_worker():
    """`flightshuffle worker --help` is the worker's own help, and a bad worker argument is the
    worker's one-line error (argparse once swallowed every `--flag` after `worker`)."""
    import subprocess
    import sys

    run = [sys.executable, "-m", "flightshuffle.cli", "worker"]
    out = subprocess.run([*run, "--help"], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--memory-budget" in out.stdout, out.stdout + out.stderr
    bad = subprocess.run(
        [*run, "--no-such-flag"], check=False, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "no-such-flag" in bad.stderr, bad.stderr


def test_every_bench_command_prints_its_help(capsys):
    names = commands_of(capsys, bench_cli.main)
    assert {"tpch", "shuffle", "strategy-sweep", "kill-trials", "soak", "online"} <= set(names)
    assert {"online-bench", "online-bound", "skew-bench", "storage-bench"} <= set(names)
    for name in names:
        usage = help_of(capsys, bench_cli.main, [name, "--help"])
        assert "usage: flightshuffle-bench " + name in usage


def test_the_shipped_package_holds_no_benchmark_and_never_imports_one():
    """What `pip install .` ships is python/flightshuffle: no bench or trial module in it, and no
    module of it importing the bench package."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    benches = {"killtrials", "soak", "onlinebench", "skewbench", "samplebound", "tpch", "bench"}
    assert not modules & benches, modules & benches
    for path in PACKAGE.glob("*.py"):
        assert "flightshuffle_bench" not in path.read_text(), path


def test_online_without_tables_is_one_clear_line(capsys):
    code = cli.main(["online", "--sql", "SELECT count(*) FROM t"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "--table" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["tpch", "--sf", "0.01", "--queries", "99"],
        ["tpch", "--sf", "-1"],
        ["tpch", "--queries", "1,x"],
        ["online-bench", "--sf", "0.01", "--queries", "0"],
        ["online-bench", "--sf", "nan"],
        ["online", "--sf", "0"],  # flightshuffle-bench online: TPC-H data
        ["online-bound", "--sf", "inf"],
    ],
)
def test_bad_tpch_arguments_are_refused_before_any_data_is_made(
    argv, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench_cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "queries 1 to 22" in err or "query numbers" in err or "scale factor" in err, err
    assert not (tmp_path / "data").exists(), "nothing generated"


def test_a_missing_table_file_is_one_line_not_a_traceback(tmp_path, capsys):
    """`flightshuffle sql --table t=<missing path>`: one line on stderr naming the path, exit 1
    (before: a Python traceback ending in FileNotFoundError)."""
    missing = str(tmp_path / "nowhere" / "lineitem.parquet")
    code = cli.main(["sql", "--workers", "1", "--table", f"t={missing}", "SELECT 1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert missing in err or "nowhere" in err, err


def _worker(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:

    return subprocess.run(
        [sys.executable, "-m", "flightshuffle.worker", "--spill-dir", "/tmp", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_certs_makes_private_files_a_worker_and_a_static_cluster_use(tmp_path, capsys):
    import json
    import stat

    assert cli.main(["certs", str(tmp_path / "c"), "--host", "127.0.0.1"]) == 0
    files = json.loads(capsys.readouterr().out)
    for path in files.values():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    token = Path(files["token_file"]).read_text().strip()
    assert len(token) == 32
    worker = subprocess.Popen(
        [sys.executable, "-m", "flightshuffle.worker", "--spill-dir", str(tmp_path / "s"),
         "--token-file", files["token_file"], "--tls-cert", files["cert"],
         "--tls-key", files["key"], "--tls-ca", files["ca"]],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        addr = worker.stdout.readline().split()[1]
        from flightshuffle import Cluster

        with Cluster(addresses=[addr], token=token, tls={"ca": files["ca"]}) as c:
            assert c.runtime == "static"
            assert c.sql("SELECT 41 + 1 AS x").column("x").to_pylist() == [42]
        with pytest.raises(Exception, match="token|Unauthenticated|authoriz"):
            Cluster(addresses=[addr], token="wrong", tls={"ca": files["ca"]})
    finally:
        worker.kill()
        worker.wait()


def test_a_static_cluster_refuses_unclear_settings_before_dialing():
    from flightshuffle import Cluster

    with pytest.raises(ValueError, match="needs token="):
        Cluster(addresses=["127.0.0.1:1"], tls=False)
    with pytest.raises(ValueError, match='needs tls=\\{"ca": path\\}'):
        Cluster(addresses=["127.0.0.1:1"], token="t")
    with pytest.raises(ValueError, match="host:port"):
        Cluster(addresses=["nowhere"], token="t", tls=False)
    with pytest.raises(ValueError, match="twice"):
        Cluster(addresses=["a:1", "a:1"], token="t", tls=False)
    with pytest.raises(ValueError, match="workers=3 but addresses= names 1"):
        Cluster(workers=3, addresses=["a:1"], token="t", tls=False)
    with pytest.raises(ValueError, match="token= is for workers at addresses="):
        Cluster(workers=1, token="t")


def test_a_worker_refuses_a_token_file_others_can_read_and_an_address_nobody_can_dial(
    tmp_path,
):
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    token.chmod(0o644)
    out = _worker("--token-file", str(token))
    assert out.returncode != 0 and "chmod 600" in out.stderr, out.stderr
    assert "secret-token" not in out.stderr + out.stdout
    token.chmod(0o600)
    out = _worker("--token-file", str(token), "--listen", "0.0.0.0:0", "--insecure")
    assert out.returncode != 0 and "--advertise" in out.stderr, out.stderr
    empty = tmp_path / "empty"
    empty.write_text("")
    empty.chmod(0o600)
    out = _worker("--token-file", str(empty))
    assert out.returncode != 0 and "is empty" in out.stderr, out.stderr
