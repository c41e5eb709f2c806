//! Module-level functions of `_native`: the worker entry point, single-process DataFusion
//! queries (map tasks of online SQL on DuckDB's side, baselines), the shuffle bench and
//! TPC-H data generation and query text.

use crate::{cluster_config, runtime, script, sql, to_py, ShuffleError};
use exchange::bench::{shuffle_bench as run_bench, BenchConfig};
use pyo3::prelude::*;
use pyo3_arrow::input::AnyRecordBatch;
use std::sync::Arc;

/// Run a worker process (`python -m flightshuffle.worker ...`) until it is stopped. Besides
/// SQL stages it runs Python map tasks and folds (`flightshuffle._exec`).
#[pyfunction]
pub fn run_worker(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    let mut sources = exchange_datafusion::worker_sources();
    sources.register(script::PYTHON_KIND, Arc::new(script::PythonSource));
    sources.register_reducer(script::PYTHON_KIND, Arc::new(script::PythonReducer));
    py.detach(|| exchange::worker::main_with_args(argv, sources))
        .map_err(to_py)
}

/// Run a query on single-process DataFusion over in-memory Arrow tables (`{name: table}`);
/// used by map tasks on workers (online SQL) and as a baseline.
#[pyfunction]
pub fn datafusion_query(
    py: Python<'_>,
    query: String,
    tables: std::collections::HashMap<String, AnyRecordBatch>,
) -> PyResult<Py<PyAny>> {
    use datafusion::datasource::MemTable;
    let ctx = datafusion::prelude::SessionContext::new_with_config(
        datafusion::prelude::SessionConfig::new().with_target_partitions(1),
    );
    for (name, data) in tables {
        let (batches, schema) = data.into_table()?.into_inner();
        let table = MemTable::try_new(schema, vec![batches]).map_err(|e| sql::df_err(e.into()))?;
        ctx.register_table(name.as_str(), Arc::new(table))
            .map_err(|e| sql::df_err(e.into()))?;
    }
    let batches = py
        .detach(|| {
            let rt = query_runtime()?;
            rt.block_on(async {
                let df = ctx.sql(&query).await?;
                let schema = Arc::new(df.schema().as_arrow().clone());
                Ok((schema, df.collect().await?))
            })
        })
        .map_err(|e: datafusion::error::DataFusionError| sql::df_err(e.into()))?;
    let table = pyo3_arrow::PyTable::try_new(batches.1, batches.0)?;
    Ok(table.into_pyarrow(py)?.unbind())
}

/// A small runtime for `datafusion_query`, shared by all calls in this process.
fn query_runtime() -> datafusion::error::Result<&'static tokio::runtime::Runtime> {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("flightshuffle-query")
        .build()
        .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
    Ok(RT.get_or_init(|| rt))
}

/// `shuffle-bench`: returns the JSON report.
#[pyfunction]
#[pyo3(signature = (rows, workers, partitions, memory_budget, maps, batch_rows, seed, compression, worker_command, sequential=false, strategy="pull".to_string(), parity=0, tls="on".to_string()))]
#[allow(clippy::too_many_arguments)]
pub fn shuffle_bench(
    py: Python<'_>,
    rows: u64,
    workers: usize,
    partitions: u32,
    memory_budget: u64,
    maps: u32,
    batch_rows: usize,
    seed: u64,
    compression: String,
    worker_command: Vec<String>,
    sequential: bool,
    strategy: String,
    parity: u32,
    tls: String,
) -> PyResult<String> {
    let rt = runtime()?;
    let cluster = cluster_config(
        workers,
        memory_budget,
        None,
        compression,
        worker_command,
        600.0,
        &tls,
        None,
    )?;
    let cfg = BenchConfig {
        rows,
        partitions,
        maps,
        batch_rows,
        seed,
        cluster,
        sequential,
        strategy: strategy.parse().map_err(to_py)?,
        parity,
    };
    let report = py.detach(|| rt.block_on(run_bench(cfg))).map_err(to_py)?;
    Ok(serde_json::to_string_pretty(&report).unwrap_or_default())
}

/// Write TPC-H tables at scale factor `sf` as Parquet under `out/<table>/`.
#[pyfunction]
pub fn tpch_generate(py: Python<'_>, sf: f64, out: String, progress: bool) -> PyResult<()> {
    py.detach(|| tpch::generate(sf, std::path::Path::new(&out), progress))
        .map_err(ShuffleError::new_err)
}

/// TPC-H query `n` (1..=22) for scale factor `sf`, and whether its result order is fixed.
#[pyfunction]
pub fn tpch_query(n: usize, sf: f64) -> PyResult<(String, bool)> {
    tpch::query(n, sf)
        .map(|q| (q, tpch::is_ordered(n)))
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("no TPC-H query {n}")))
}
