//! `flightshuffle-sql-worker`: a worker that can also run DataFusion stage tasks.

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if let Err(e) =
        flightshuffle::worker::main_with_args(argv, flightshuffle_datafusion::worker_sources())
    {
        eprintln!("flightshuffle-sql-worker: {e}");
        std::process::exit(2);
    }
}
