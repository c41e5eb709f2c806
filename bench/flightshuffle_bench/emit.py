"""How every benchmark reports: its JSON on stdout, and also in a file when asked."""

from __future__ import annotations

import json
from typing import Any


def emit(report: Any, path: str | None) -> None:
    """Print ``report`` as indented JSON, and write the same text to ``path`` if given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
