"""The ``flightshuffle`` and ``flightshuffle-bench`` command lines: every subcommand's
``--help`` prints and exits 0 (a bare ``%`` in one help string once made ``flightshuffle --help``
a traceback); the user's command lists only what users run; bad input is one line."""

from __future__ import annotations

import re
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
    assert sorted(names) == ["calibrate", "online", "report", "serve", "sql", "storage", "worker"]
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
