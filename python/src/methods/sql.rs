//! Distributed SQL: registering Parquet tables, queries and their plans, and the
//! single-process baseline over the same tables.

use crate::cluster::NativeCluster;
use crate::{sql, to_py, wait};
use flightshuffle_datafusion::flight_sql::{OnlineRunner, Results, Rounds};
use pyo3::prelude::*;
use std::sync::Arc;

#[pymethods]
impl NativeCluster {
    /// Register a Parquet file or directory as a SQL table.
    fn register_parquet(&self, py: Python<'_>, name: String, path: String) -> PyResult<()> {
        let ctx = self.sql_context()?;
        let local = &self.local;
        wait(py, &self.rt, async {
            sql::register(&ctx, &name, &path).await?;
            flightshuffle_datafusion::context::replace_parquet(local, &name, &path)
                .await
                .map_err(sql::df_err)
        })?
    }

    /// Run a query on single-process DataFusion in this process over the same registered
    /// tables (a baseline); returns (pyarrow.Table, seconds).
    fn sql_single_process(&self, py: Python<'_>, query: String) -> PyResult<(Py<PyAny>, f64)> {
        let start = std::time::Instant::now();
        let local = &self.local;
        let (batches, schema) = wait(py, &self.rt, async {
            let df = local.sql(&query).await?;
            // The plan's schema: a result with no rows keeps its columns.
            let schema: arrow::datatypes::SchemaRef = Arc::new(df.schema().as_arrow().clone());
            Ok::<_, datafusion::error::DataFusionError>((df.collect().await?, schema))
        })?
        .map_err(|e| sql::df_err(e.into()))?;
        let seconds = start.elapsed().as_secs_f64();
        let schema = batches.first().map(|b| b.schema()).unwrap_or(schema);
        let table = pyo3_arrow::PyTable::try_new(batches, schema)?;
        Ok((table.into_pyarrow(py)?.unbind(), seconds))
    }

    /// Serve Arrow Flight SQL on `host:port` (0: any free port) over this cluster's SQL
    /// session; returns (uri, token, CA PEM or None without TLS). A second call replaces the
    /// first endpoint. Under TLS the endpoint has a certificate of its own, for `localhost`,
    /// `127.0.0.1` and `host`, signed by a CA made for it. With `results="workers"` a query's
    /// rows are read from the workers that hold them (the CA PEM then holds the cluster's CA
    /// too); under mutual TLS, and with `results="driver"`, from the endpoint.
    /// `online(sql)`, when given, runs a polled query online: it returns an iterator of
    /// (fraction read, pyarrow.Table of estimates) rounds, or None when it does not.
    #[pyo3(signature = (host, port, results="workers", online=None))]
    fn serve_flight_sql(
        &self,
        host: String,
        port: u16,
        results: &str,
        online: Option<Py<PyAny>>,
    ) -> PyResult<(String, String, Option<String>)> {
        let ctx = self.sql_context()?;
        let driver = self.driver()?;
        let listener = std::net::TcpListener::bind((host.as_str(), port)).map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!("cannot listen on {host}:{port}: {e}"))
        })?;
        let made = match driver.credentials().tls.is_some() {
            true => Some(
                flightshuffle::transport::tls::MadeTls::generate(std::slice::from_ref(&host))
                    .map_err(to_py)?,
            ),
            false => None,
        };
        let tls = made.as_ref().map(|m| m.server().config());
        let cluster_tls = driver.credentials().tls.clone();
        let results_at = match (results, &cluster_tls) {
            ("driver", _) => Results::Driver,
            // A client has no certificate of the cluster's to show the workers.
            ("workers", Some(t)) if t.identity.is_some() => Results::Driver,
            ("workers", Some(_)) => Results::Workers("grpc+tls".into()),
            ("workers", None) => Results::Workers("grpc+tcp".into()),
            (other, _) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "results must be 'workers' or 'driver', not {other:?}"
                )))
            }
        };
        let ca = made.as_ref().map(|m| match (&results_at, &cluster_tls) {
            (Results::Workers(_), Some(t)) => format!("{}\n{}", m.ca.trim_end(), t.ca),
            _ => m.ca.clone(),
        });
        let _runtime = self.rt.enter();
        let server = flightshuffle_datafusion::flight_sql::serve(
            ctx,
            listener,
            driver.token(),
            tls,
            driver.num_workers(),
            results_at,
            online.map(online_runner),
        )
        .map_err(sql::df_err)?;
        let scheme = if made.is_some() {
            "grpc+tls"
        } else {
            "grpc+tcp"
        };
        let uri = format!("{scheme}://{host}:{}", server.addr.port());
        *self.flight_sql.lock().unwrap_or_else(|p| p.into_inner()) = Some(server);
        Ok((uri, driver.token().to_string(), ca))
    }

    /// The event log of the last SQL query or shuffle job (with `Cluster(event_log=...)`):
    /// whichever was started last.
    fn last_event_log(&self) -> PyResult<Option<String>> {
        let ctx = self.sql_context()?;
        let job = self
            .last_job_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let started = |p: &std::path::PathBuf| {
            std::fs::metadata(p)
                .and_then(|m| m.created().or_else(|_| m.modified()))
                .ok()
        };
        let last = match (ctx.last_event_log(), job) {
            (Some(q), Some(j)) => Some(if started(&j) > started(&q) { j } else { q }),
            (q, j) => q.or(j),
        };
        Ok(last.map(|p| p.display().to_string()))
    }

    /// Run a query on the cluster; returns (pyarrow.Table, metrics as JSON).
    #[pyo3(signature = (query, strategy=None))]
    fn sql(
        &self,
        py: Python<'_>,
        query: String,
        strategy: Option<String>,
    ) -> PyResult<(Py<PyAny>, String)> {
        let ctx = self.sql_context()?;
        let strategy = parse_strategy(strategy)?;
        let result = wait(py, &self.rt, ctx.sql_with(&query, strategy))?.map_err(sql::df_err)?;
        let metrics = sql::metrics_json(&result);
        let table = pyo3_arrow::PyTable::try_new(result.batches, result.schema)?;
        Ok((table.into_pyarrow(py)?.unbind(), metrics))
    }

    /// The staged plan of a query; with `analyze`, run it and add per-exchange figures.
    #[pyo3(signature = (query, analyze, strategy=None))]
    fn explain(
        &self,
        py: Python<'_>,
        query: String,
        analyze: bool,
        strategy: Option<String>,
    ) -> PyResult<String> {
        let ctx = self.sql_context()?;
        let strategy = parse_strategy(strategy)?;
        wait(py, &self.rt, ctx.explain_with(&query, analyze, strategy))?.map_err(sql::df_err)
    }
}

/// A strategy name from Python (None: the cluster's default).
fn parse_strategy(name: Option<String>) -> PyResult<Option<flightshuffle::strategy::Strategy>> {
    name.map(|s| s.parse().map_err(to_py)).transpose()
}

/// A Python `online(sql)` as the Flight SQL endpoint's online runner (called on a blocking
/// thread; the GIL is taken for each step).
fn online_runner(online: Py<PyAny>) -> OnlineRunner {
    Arc::new(move |query: &str| {
        Python::attach(|py| {
            let rounds = online.call1(py, (query,)).map_err(|e| e.to_string())?;
            if rounds.is_none(py) {
                return Ok(None);
            }
            let rounds = rounds.bind(py).try_iter().map_err(|e| e.to_string())?;
            Ok(Some(Box::new(PyRounds(rounds.unbind())) as Rounds))
        })
    })
}

/// A Python iterator of (fraction, table) rounds.
struct PyRounds(Py<pyo3::types::PyIterator>);

impl Iterator for PyRounds {
    type Item = Result<(f64, arrow::array::RecordBatch), String>;

    fn next(&mut self) -> Option<Self::Item> {
        Python::attach(|py| {
            let item = match self.0.bind(py).clone().next()? {
                Ok(item) => item,
                Err(e) => return Some(Err(e.to_string())),
            };
            Some(round(&item).map_err(|e| e.to_string()))
        })
    }
}

/// One round: its fraction and its estimates as one batch.
fn round(item: &Bound<'_, PyAny>) -> PyResult<(f64, arrow::array::RecordBatch)> {
    let (fraction, table): (f64, pyo3_arrow::input::AnyRecordBatch) = item.extract()?;
    let (batches, schema) = table.into_table()?.into_inner();
    let batch = arrow::compute::concat_batches(&schema, &batches)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok((fraction, batch))
}
