//! Module-level functions of `_native`: the worker entry point and single-process DataFusion
//! queries (map tasks of online SQL on DuckDB's side, baselines).

use crate::{script, sql, to_py};
use pyo3::prelude::*;
use pyo3_arrow::input::AnyRecordBatch;
use std::sync::Arc;

/// Run a worker process (`python -m flightshuffle.worker ...`) until it is stopped. Besides
/// SQL stages it runs Python map tasks and folds (`flightshuffle._exec`).
#[pyfunction]
pub fn run_worker(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    let mut sources = flightshuffle_datafusion::worker_sources();
    sources.register(script::PYTHON_KIND, Arc::new(script::PythonSource));
    sources.register_reducer(script::PYTHON_KIND, Arc::new(script::PythonReducer));
    py.detach(|| flightshuffle::worker::main_with_args(argv, sources))
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

/// Delete (or with `dry_run` list) what crashed clusters left in the object store at `url`:
/// objects of flightshuffle runs older than `older_than_secs`; returns (path, bytes) of each.
#[pyfunction]
pub fn storage_sweep(
    py: Python<'_>,
    url: String,
    options: std::collections::BTreeMap<String, String>,
    older_than_secs: f64,
    dry_run: bool,
) -> PyResult<Vec<(String, u64)>> {
    let cfg = flightshuffle::StorageConfig::new(url, options).map_err(to_py)?;
    let older = std::time::Duration::from_secs_f64(older_than_secs.max(0.0));
    let rt = crate::runtime()?;
    crate::wait(py, &rt, async move {
        let storage = flightshuffle::storage::Storage::open(&cfg)?;
        flightshuffle::storage::sweep(&storage, older, dry_run).await
    })?
    .map_err(to_py)
}
