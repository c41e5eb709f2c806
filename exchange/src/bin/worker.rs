//! `flightshuffle-worker`: a worker process for Rust hosts and pure-SQL deployments.

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if let Err(e) =
        flightshuffle::worker::main_with_args(argv, flightshuffle::worker::builtin_sources())
    {
        eprintln!("flightshuffle-worker: {e}");
        std::process::exit(2);
    }
}
