"""Where the benchmarks find the binaries cargo builds."""

from __future__ import annotations

import os
from pathlib import Path


def shuffle_binary() -> str:
    """The Rust shuffle bench: ``$FLIGHTSHUFFLE_SHUFFLE_BENCH``, else the release build in the
    cargo target dir (``cargo build --release --workspace --bins``; scripts/bench.sh does it)."""
    given = os.environ.get("FLIGHTSHUFFLE_SHUFFLE_BENCH")
    if given:
        return given
    target = os.environ.get("CARGO_TARGET_DIR") or str(
        Path.home() / ".cache" / "flightshuffle-target"
    )
    path = Path(target) / "release" / "flightshuffle-shuffle-bench"
    if not path.exists():
        raise ValueError(
            f"{path} is not built: cargo build --release --workspace --bins (scripts/bench.sh "
            "builds it), or set FLIGHTSHUFFLE_SHUFFLE_BENCH"
        )
    return str(path)
