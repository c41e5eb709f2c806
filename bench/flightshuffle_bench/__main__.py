"""``python -m flightshuffle_bench``."""

import sys

from flightshuffle_bench.cli import main

sys.exit(main())
