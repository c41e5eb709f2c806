"""flightshuffle's benchmarks and trials (``flightshuffle-bench``); not part of the wheel."""
