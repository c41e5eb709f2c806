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
