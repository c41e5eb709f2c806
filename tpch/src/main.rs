//! `tpch`: generate TPC-H Parquet data, run the 22 queries on a local flightshuffle cluster
//! with answers checked against single-process DataFusion, and benchmark both (JSON).

use clap::{Parser, Subcommand};
use datafusion::prelude::{SessionConfig, SessionContext};
use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle_datafusion::DistributedContext;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "tpch", about = "TPC-H on a flightshuffle local cluster")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// Scale factor.
    #[arg(long, default_value_t = 1.0)]
    sf: f64,
    /// Data directory (default: data/tpch-sf<SF>); generated when missing.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Queries to run, e.g. 1,3,18 (default: all 22).
    #[arg(long, value_delimiter = ',')]
    queries: Vec<usize>,
    /// Block store budget per worker, in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    memory_budget: u64,
    /// Runs per query (the minimum time is reported).
    #[arg(long, default_value_t = 1)]
    iterations: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Write the 8 tables as Parquet.
    Generate {
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        #[arg(long)]
        out: PathBuf,
    },
    /// Run the queries distributed, check answers, print a table of times.
    Run(RunArgs),
    /// Like run, printing JSON with single-process DataFusion times measured in the same run.
    Bench(RunArgs),
    /// Print the staged plan of one query.
    Explain {
        #[command(flatten)]
        args: RunArgs,
        #[arg(long)]
        analyze: bool,
    },
    /// Host a worker process (used by the local cluster).
    Worker {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() {
    let cli = Cli::parse();
    flightshuffle::worker::init_logging();
    if let Command::Worker { args } = &cli.command {
        let argv = std::iter::once("tpch-worker".to_string())
            .chain(args.iter().cloned())
            .collect();
        if let Err(e) =
            flightshuffle::worker::main_with_args(argv, flightshuffle_datafusion::worker_sources())
        {
            eprintln!("tpch worker: {e}");
            std::process::exit(2);
        }
        return;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tpch: cannot start runtime: {e}");
            std::process::exit(2);
        }
    };
    let code = match rt.block_on(run(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tpch: {e}");
            2
        }
    };
    std::process::exit(code);
}

fn data_dir(args: &RunArgs) -> PathBuf {
    args.data
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("data/tpch-sf{}", args.sf)))
}

async fn run(command: Command) -> Result<i32, String> {
    match command {
        Command::Generate { sf, out } => {
            tpch::generate(sf, &out, true)?;
            println!("wrote TPC-H SF{sf} to {}", out.display());
            Ok(0)
        }
        Command::Run(args) => run_queries(args, false).await,
        Command::Bench(args) => run_queries(args, true).await,
        Command::Explain { args, analyze } => {
            let (_cluster, dctx) = start(&args).await?;
            for q in queries(&args) {
                let sql = tpch::query(q, args.sf).ok_or("no such query")?;
                println!("-- q{q:02}");
                println!(
                    "{}",
                    dctx.explain(&sql, analyze)
                        .await
                        .map_err(|e| e.to_string())?
                );
            }
            Ok(0)
        }
        Command::Worker { .. } => Ok(0),
    }
}

fn queries(args: &RunArgs) -> Vec<usize> {
    if args.queries.is_empty() {
        (1..=22).collect()
    } else {
        args.queries.clone()
    }
}

async fn start(args: &RunArgs) -> Result<(LocalCluster, DistributedContext), String> {
    let dir = data_dir(args);
    if !tpch::is_generated(&dir) {
        eprintln!("generating TPC-H SF{} in {}", args.sf, dir.display());
        tpch::generate(args.sf, &dir, true)?;
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cfg = LocalClusterConfig::new(
        args.workers,
        vec![exe.to_string_lossy().into_owned(), "worker".into()],
    );
    cfg.memory_budget = args.memory_budget;
    let cluster = LocalCluster::start(cfg).await.map_err(|e| e.to_string())?;
    let dctx = DistributedContext::new(
        cluster.driver.clone(),
        DistributedContext::default_config(args.workers),
    )
    .map_err(|e| e.to_string())?;
    tpch::register(dctx.session(), &dir)
        .await
        .map_err(|e| e.to_string())?;
    Ok((cluster, dctx))
}

async fn run_queries(args: RunArgs, json_out: bool) -> Result<i32, String> {
    let (cluster, dctx) = start(&args).await?;
    let local = SessionContext::new_with_config(
        SessionConfig::new().with_target_partitions(args.workers.max(2)),
    );
    tpch::register(&local, &data_dir(&args))
        .await
        .map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    let mut failed = 0;
    if !json_out {
        println!(
            "{:>5} {:>12} {:>12} {:>7} {:>7} {:>12}  answer",
            "query", "cluster s", "local s", "ratio", "stages", "shuffled MB"
        );
    }
    let (mut total_c, mut total_l) = (0.0, 0.0);
    for q in queries(&args) {
        let sql = tpch::query(q, args.sf).ok_or_else(|| format!("no query {q}"))?;
        let (mut best_c, mut best_l) = (f64::MAX, f64::MAX);
        let mut outcome = Ok(());
        let (mut stages, mut shuffled) = (0, 0u64);
        for _ in 0..args.iterations.max(1) {
            let t = Instant::now();
            let expected = async { local.sql(&sql).await?.collect().await }
                .await
                .map_err(|e| e.to_string());
            best_l = best_l.min(t.elapsed().as_secs_f64());
            let got = dctx.sql(&sql).await.map_err(|e| e.to_string());
            outcome = match (&expected, &got) {
                (Ok(e), Ok(g)) => {
                    best_c = best_c.min(g.seconds);
                    stages = g.stages.len();
                    shuffled = g.stages.iter().map(|s| s.bytes).sum();
                    tpch::check::compare(e, &g.batches, tpch::is_ordered(q))
                }
                (Err(e), _) => Err(format!("single-process DataFusion failed: {e}")),
                (_, Err(e)) => Err(format!("cluster failed: {e}")),
            };
            if outcome.is_err() {
                break;
            }
        }
        let ok = outcome.is_ok();
        if ok {
            total_c += best_c;
            total_l += best_l;
        } else {
            failed += 1;
        }
        if !json_out {
            println!(
                "{:>5} {:>12.3} {:>12.3} {:>7.2} {:>7} {:>12.1}  {}",
                format!("q{q:02}"),
                best_c,
                best_l,
                best_c / best_l,
                stages,
                shuffled as f64 / 1e6,
                match &outcome {
                    Ok(()) => "ok".to_string(),
                    Err(e) => format!("WRONG: {e}"),
                }
            );
        }
        rows.push(json!({
            "query": q, "cluster_s": best_c, "single_process_s": best_l,
            "ratio": best_c / best_l, "stages": stages, "shuffled_bytes": shuffled,
            "answer_ok": ok, "error": outcome.err(),
        }));
    }
    let stats = cluster.driver.stats().await.map_err(|e| e.to_string())?;
    if json_out {
        let report = json!({
            "sf": args.sf, "workers": args.workers, "iterations": args.iterations,
            "queries": rows,
            "total_cluster_s": total_c, "total_single_process_s": total_l,
            "ratio": total_c / total_l, "failed": failed,
            "peak_rss_bytes_per_worker": stats.iter().map(|s| s.peak_rss_bytes).collect::<Vec<_>>(),
            "spilled_bytes": stats.iter().map(|s| s.spilled_bytes).sum::<u64>(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "{:>5} {:>12.3} {:>12.3} {:>7.2}",
            "total",
            total_c,
            total_l,
            total_c / total_l
        );
        println!(
            "{} of {} answers match single-process DataFusion",
            rows.len() - failed,
            rows.len()
        );
    }
    Ok(if failed == 0 { 0 } else { 1 })
}
