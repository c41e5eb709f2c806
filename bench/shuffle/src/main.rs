//! `flightshuffle-shuffle-bench`: generated lineitem-like rows through a local cluster of worker
//! processes, output multiset checked, times and references printed as JSON (see `bench.rs`).
//! `flightshuffle-bench shuffle` (the Python bench package) and `scripts/bench.sh` run it.

mod bench;

use clap::Parser;
use flightshuffle::cluster::{LocalClusterConfig, TlsSetting};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "flightshuffle-shuffle-bench",
    about = "shuffle generated rows, check and time it"
)]
struct Args {
    #[arg(long, default_value_t = 10_000_000)]
    rows: u64,
    #[arg(long, default_value_t = 4)]
    workers: usize,
    #[arg(long, default_value_t = 16)]
    partitions: u32,
    /// Memory budget per worker, in bytes.
    #[arg(long, default_value_t = 2 << 30)]
    memory_budget: u64,
    /// Map tasks (0: four per worker).
    #[arg(long, default_value_t = 0)]
    maps: u32,
    #[arg(long, default_value_t = 65_536)]
    batch_rows: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// none, lz4, zstd or auto.
    #[arg(long, default_value = "auto")]
    compression: String,
    /// Parity shards per stripe (0: none).
    #[arg(long, default_value_t = 0)]
    parity: u32,
    /// pull, merged, push, two-level or auto.
    #[arg(long, default_value = "pull")]
    strategy: String,
    /// Start the reducers only once the map side is sealed.
    #[arg(long)]
    sequential: bool,
    /// TLS between the processes: on, off or mutual.
    #[arg(long, default_value = "on")]
    tls: String,
    /// Seconds any one driver call may take.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Workers already running at these addresses (comma-separated host:port) instead of a
    /// local cluster; with --token-file and --tls-ca (or --tls off).
    #[arg(long, value_delimiter = ',')]
    addresses: Vec<String>,
    /// With --addresses: the file holding the workers' token.
    #[arg(long)]
    token_file: Option<std::path::PathBuf>,
    /// With --addresses: the CA of the workers' certificates.
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    /// The command that starts one worker (program and arguments), after `--`.
    #[arg(last = true)]
    worker_command: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(report) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("flightshuffle-shuffle-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<serde_json::Value, String> {
    let tls = match args.tls.as_str() {
        "off" => TlsSetting::Off,
        "on" => TlsSetting::Local { mutual: false },
        "mutual" => TlsSetting::Local { mutual: true },
        other => return Err(format!("--tls takes on, off or mutual, not {other:?}")),
    };
    let hosted = if args.addresses.is_empty() {
        if args.worker_command.is_empty() {
            return Err("name the worker command after `--`, or --addresses".into());
        }
        None
    } else {
        let path = args
            .token_file
            .as_ref()
            .ok_or("--addresses needs --token-file")?;
        let token = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .trim()
            .to_string();
        let tls = match (&args.tls_ca, args.tls.as_str()) {
            (_, "off") => None,
            (Some(ca), _) => Some(flightshuffle::transport::tls::ClientTls {
                ca: std::fs::read_to_string(ca).map_err(|e| format!("{}: {e}", ca.display()))?,
                identity: None,
            }),
            (None, _) => return Err("--addresses needs --tls-ca (or --tls off)".into()),
        };
        Some((
            args.addresses.clone(),
            flightshuffle::transport::Credentials { token, tls },
        ))
    };
    let mut cluster = LocalClusterConfig::new(args.workers, args.worker_command);
    cluster.memory_budget = args.memory_budget;
    cluster.compression = args.compression;
    cluster.driver.rpc_timeout = Duration::from_secs_f64(args.timeout.max(1.0));
    cluster.tls = tls;
    let cfg = bench::BenchConfig {
        rows: args.rows,
        partitions: args.partitions,
        maps: args.maps,
        batch_rows: args.batch_rows,
        seed: args.seed,
        cluster,
        hosted,
        sequential: args.sequential,
        strategy: args.strategy.parse().map_err(|e| format!("{e}"))?,
        parity: args.parity,
    };
    let rt = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    rt.block_on(bench::shuffle_bench(cfg))
        .map_err(|e| e.to_string())
}
