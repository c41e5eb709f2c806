//! Distributed SQL from Rust: start a local cluster of 2 worker processes, register a Parquet
//! file and run a query on the cluster with `DistributedContext`.
//!
//! The workers are this example's own binary started as `<binary> worker <flags>`: a worker
//! that runs DataFusion stages needs `flightshuffle_datafusion::worker_sources()`, which the
//! `flightshuffle-sql-worker` binary also serves.
//!
//! ```text
//! cargo run --release -p flightshuffle-datafusion --example distributed_sql
//! ```

use arrow::util::pretty::pretty_format_batches;
use datafusion::dataframe::DataFrameWriteOptions;
use datafusion::prelude::SessionContext;
use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle_datafusion::DistributedContext;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        // Started by the local cluster below: serve as one worker until the driver goes.
        let argv = std::iter::once(args[0].clone())
            .chain(args[2..].iter().cloned())
            .collect();
        flightshuffle::worker::main_with_args(argv, flightshuffle_datafusion::worker_sources())?;
        return Ok(());
    }
    tokio::runtime::Runtime::new()?.block_on(run())
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // A small Parquet file to query, written by single-process DataFusion.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sales.parquet").display().to_string();
    SessionContext::new()
        .sql(
            "SELECT column1 AS region, column2 AS amount \
             FROM (VALUES ('north', 10), ('south', 20), ('north', 5), ('east', 7))",
        )
        .await?
        .write_parquet(&path, DataFrameWriteOptions::new(), None)
        .await?;

    // Two worker processes on this machine (loopback, TLS, a random token), stopped on drop.
    let exe = std::env::current_exe()?.display().to_string();
    let mut config = LocalClusterConfig::new(2, vec![exe, "worker".into()]);
    config.memory_budget = 256 << 20;
    let cluster = LocalCluster::start(config).await?;
    let session = DistributedContext::default_config(2);
    let ctx = DistributedContext::new(cluster.driver.clone(), session)?;
    ctx.register_parquet("sales", &path).await?;
    ctx.sql("SET flightshuffle.small_query_rows = 0").await?; // distribute even this
    let result = ctx
        .sql("SELECT region, sum(amount) AS total FROM sales GROUP BY region ORDER BY region")
        .await?;
    println!("{}", pretty_format_batches(&result.batches)?);
    for s in &result.stages {
        let (id, rows, bytes) = (s.stage, s.rows, s.bytes);
        println!("stage {id}: {rows} rows, {bytes} bytes moved");
    }
    let plan = ctx.explain("SELECT count(*) FROM sales", false).await?;
    println!("{plan}");
    Ok(())
}
