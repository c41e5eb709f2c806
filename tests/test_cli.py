"""The ``flightshuffle`` command line's help: every subcommand's ``--help`` prints and exits 0
(a bare ``%`` in one help string once made ``flightshuffle --help`` a traceback)."""

from __future__ import annotations

import re

import pytest
from flightshuffle import cli


def help_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_subcommand_prints_its_help(capsys):
    top = help_of(capsys, ["--help"])
    commands = re.search(r"\{([a-z,-]+)\}", top)
    assert commands is not None, top
    names = commands.group(1).split(",")
    assert {"tpch", "sql", "shuffle-bench", "online", "online-bound"} <= set(names)
    for name in names:
        assert "usage: flightshuffle " + name in help_of(capsys, [name, "--help"])


@pytest.mark.parametrize(
    "argv",
    [
        ["tpch", "--sf", "0.01", "--queries", "99"],
        ["tpch", "--sf", "-1"],
        ["tpch", "--queries", "1,x"],
        ["online-bench", "--sf", "0.01", "--queries", "0"],
        ["online-bench", "--sf", "nan"],
        ["online", "--sf", "0"],
        ["online-bound", "--sf", "inf"],
    ],
)
def test_bad_tpch_arguments_are_refused_before_any_data_is_made(
    argv, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
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
