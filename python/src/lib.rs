//! `flightshuffle._native`: the Python bindings. A `NativeCluster` owns a tokio runtime and a
//! local cluster; `shuffle()` takes anything exporting the Arrow PyCapsule stream interface
//! (zero-copy import) and returns a `NativeShuffle` yielding partitions as Arrow tables.

mod functions;
mod hosted;
mod job;
mod online;
mod script;
mod sql;
mod stage;

use flightshuffle::cluster::{HostedCluster, LocalCluster, LocalClusterConfig, TlsSetting};
use flightshuffle::strategy::StrategyOptions;
use flightshuffle::Error;
use hosted::Workers;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3_arrow::input::AnyRecordBatch;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pyo3::create_exception!(
    _native,
    ShuffleError,
    PyException,
    "A shuffle or cluster failed."
);
pyo3::create_exception!(
    _native,
    WorkerLostError,
    ShuffleError,
    "A worker process was lost."
);
pyo3::create_exception!(
    _native,
    ChecksumError,
    ShuffleError,
    "A block failed its CRC32C check."
);

/// Map an exchange error to the Python exception a user can catch.
pub fn to_py(e: Error) -> PyErr {
    to_py_ref(&e)
}

pub fn to_py_ref(e: &Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::WorkerLost { .. } => WorkerLostError::new_err(msg),
        Error::Checksum { .. } => ChecksumError::new_err(msg),
        Error::Remote { code, .. } if *code == flightshuffle::transport_code::Code::DataLoss => {
            ChecksumError::new_err(msg)
        }
        Error::Remote { code, .. }
            if *code == flightshuffle::transport_code::Code::InvalidArgument =>
        {
            pyo3::exceptions::PyValueError::new_err(msg)
        }
        Error::InvalidArgument(_) | Error::SchemaMismatch { .. } => {
            pyo3::exceptions::PyValueError::new_err(msg)
        }
        _ => ShuffleError::new_err(msg),
    }
}

/// How often a blocking call checks for Ctrl-C.
const SIGNAL_CHECK: std::time::Duration = std::time::Duration::from_millis(200);

/// Run `fut` on the runtime without the GIL, checking Python's signals every
/// [`SIGNAL_CHECK`]: on Ctrl-C the future is dropped (its work is cancelled: running tasks are
/// aborted on the workers when their calls go away) and `KeyboardInterrupt` is raised.
pub fn wait<T: Send, F: std::future::Future<Output = T> + Send>(
    py: Python<'_>,
    rt: &Rt,
    fut: F,
) -> PyResult<T> {
    let mut fut = std::pin::pin!(fut);
    loop {
        let step = py.detach(|| {
            rt.block_on(async { tokio::time::timeout(SIGNAL_CHECK, fut.as_mut()).await })
        });
        match step {
            Ok(v) => return Ok(v),
            Err(_) => py.check_signals()?,
        }
    }
}

/// The driver's tokio runtime. Dropping it never waits for blocking threads: the last owner may
/// be dropped by Python's garbage collector while holding the GIL, and a blocking thread may be
/// waiting for the GIL inside a Python data source — waiting there would deadlock.
pub struct Rt(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for Rt {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &tokio::runtime::Runtime {
        match &self.0 {
            Some(rt) => rt,
            None => unreachable!("the runtime is only taken when dropped"),
        }
    }
}

impl Drop for Rt {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

#[pyclass(module = "flightshuffle._native")]
struct NativeCluster {
    rt: Arc<Rt>,
    cluster: Arc<Mutex<Option<Workers>>>,
    sql: Mutex<Option<Arc<flightshuffle_datafusion::DistributedContext>>>,
    /// The context of online SQL and its tables.
    online: Arc<online::Sessions>,
    /// Single-process DataFusion over the same tables: the baseline of benchmarks.
    local: datafusion::prelude::SessionContext,
    /// Output shuffles of Python map stages (datasets), by id.
    stages: stage::Stages,
    /// Strategy knobs of every shuffle, stage and query of this cluster (speculation).
    strategy: flightshuffle::strategy::StrategyOptions,
}

pub(crate) fn runtime() -> PyResult<Rt> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("flightshuffle-driver")
        .build()
        .map(|rt| Rt(Some(rt)))
        .map_err(|e| ShuffleError::new_err(format!("cannot start runtime: {e}")))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn cluster_config(
    workers: usize,
    memory_budget: u64,
    spill_dir: Option<String>,
    compression: String,
    worker_command: Vec<String>,
    timeout_secs: f64,
    tls: &str,
    tls_files: Option<(String, String, String)>,
) -> PyResult<LocalClusterConfig> {
    let mut cfg = LocalClusterConfig::new(workers, worker_command);
    cfg.memory_budget = memory_budget;
    cfg.spill_dir = spill_dir.map(Into::into);
    cfg.compression = compression;
    cfg.driver.rpc_timeout = Duration::from_secs_f64(timeout_secs.max(1.0));
    cfg.tls = tls_setting(tls, tls_files)?;
    Ok(cfg)
}

/// `tls`: "on" (a CA made for the cluster), "mutual" (clients show certificates too) or
/// "off"; with `files` (ca, cert, key), those certificates instead of made ones.
pub(crate) fn tls_setting(
    tls: &str,
    files: Option<(String, String, String)>,
) -> PyResult<TlsSetting> {
    let mutual = match tls {
        "off" if files.is_none() => return Ok(TlsSetting::Off),
        "on" => false,
        "mutual" => true,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "tls must be True, False, \"mutual\" or a dict of ca, cert and key files, not \
                 {other:?}"
            )))
        }
    };
    Ok(match files {
        Some((ca, cert, key)) => TlsSetting::Files {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
            mutual,
        },
        None => TlsSetting::Local { mutual },
    })
}

/// The cluster's strategy knobs, checked: a known strategy, a parity the worker count allows,
/// a speculation factor above 1.
fn strategy_options(
    workers: usize,
    strategy: &str,
    parity: u32,
    speculation: Option<f64>,
) -> PyResult<StrategyOptions> {
    let strategy: flightshuffle::strategy::Strategy = strategy.parse().map_err(to_py)?;
    flightshuffle::check_parity(workers, parity)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    if speculation.is_some_and(|k| !(k.is_finite() && k > 1.0)) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "speculation must be a factor above 1 (a map slower than that many times the median \
             is copied), or None",
        ));
    }
    Ok(StrategyOptions {
        speculation,
        strategy,
        parity,
        ..Default::default()
    })
}

/// A cluster's options, from the dict `Cluster` passes (its keys are these field names).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct ClusterOptions {
    /// Bytes per worker.
    memory_budget: u64,
    /// Parent of the workers' spill directories (local), the driver's scratch (hosted).
    spill_dir: Option<String>,
    /// none, lz4, zstd or auto.
    compression: String,
    /// Seconds a driver call may take.
    timeout_secs: f64,
    /// A map slower than this factor of the median gets a backup attempt.
    speculation: Option<f64>,
    /// The exchange strategy of every shuffle.
    strategy: String,
    /// Parity shards per stripe.
    parity: u32,
    /// "on", "mutual" or "off".
    tls: String,
    /// (ca, cert, key) files of your own.
    tls_files: Option<(String, String, String)>,
}

impl ClusterOptions {
    fn strategy_options(&self, workers: usize) -> PyResult<StrategyOptions> {
        strategy_options(workers, &self.strategy, self.parity, self.speculation)
    }
}

/// With `auto` as the cluster's default, calibrate the machine now, not in the first exchange.
async fn calibrate_for(
    driver: &Arc<flightshuffle::driver::Driver>,
    opts: &StrategyOptions,
) -> flightshuffle::Result<()> {
    if opts.strategy == flightshuffle::strategy::Strategy::Auto {
        driver.calibration().await?;
    }
    Ok(())
}

#[pymethods]
impl NativeCluster {
    /// Start a local cluster of `workers` processes, each started by `worker_command`.
    #[new]
    fn new(
        py: Python<'_>,
        workers: usize,
        worker_command: Vec<String>,
        options: ClusterOptions,
    ) -> PyResult<Self> {
        let opts = options.strategy_options(workers)?;
        let rt = runtime()?;
        let cfg = cluster_config(
            workers,
            options.memory_budget,
            options.spill_dir,
            options.compression,
            worker_command,
            options.timeout_secs,
            &options.tls,
            options.tls_files,
        )?;
        let cluster = py
            .detach(|| {
                rt.block_on(async {
                    let cluster = LocalCluster::start(cfg).await?;
                    calibrate_for(&cluster.driver, &opts).await?;
                    Ok::<_, flightshuffle::Error>(cluster)
                })
            })
            .map_err(to_py)?;
        Ok(Self::with_workers(rt, Workers::Local(cluster), opts))
    }

    /// A driver for workers hosted elsewhere (Ray actors) at `addresses`; `replace(slot)`
    /// starts a lost worker's replacement and returns its address. In `options`, `tls_files`
    /// (ca, cert, key) are the files the workers serve, `tls` "on", "mutual" or "off", and
    /// `spill_dir` the driver's scratch directory.
    #[staticmethod]
    fn connect(
        py: Python<'_>,
        addresses: Vec<String>,
        token: String,
        replace: Py<PyAny>,
        options: ClusterOptions,
    ) -> PyResult<Self> {
        let opts = options.strategy_options(addresses.len())?;
        let creds = hosted::credentials(token, tls_setting(&options.tls, options.tls_files)?)?;
        let cfg = flightshuffle::driver::DriverConfig {
            rpc_timeout: Duration::from_secs_f64(options.timeout_secs.max(1.0)),
            ..Default::default()
        };
        let scratch = options.spill_dir;
        let rt = runtime()?;
        let hosted = py
            .detach(|| {
                rt.block_on(async {
                    let c = HostedCluster::connect(
                        &addresses,
                        &creds,
                        cfg,
                        scratch.map(Into::into),
                        Some(hosted::py_replacer(replace)),
                    )
                    .await?;
                    calibrate_for(&c.driver, &opts).await?;
                    Ok::<_, flightshuffle::Error>(c)
                })
            })
            .map_err(to_py)?;
        Ok(Self::with_workers(rt, Workers::Hosted(hosted), opts))
    }

    /// Run a map stage of Python tasks into a new shuffle of `partitions` partitions (hash on
    /// `keys`, round-robin when empty). A task is `(body, input_stage | None, input_partition,
    /// split | None)` with a split `(path, row_group, start, rows, columns)`.
    /// Returns `(stage id, rows written)`.
    fn run_stage(
        &self,
        py: Python<'_>,
        schema: pyo3_arrow::PySchema,
        partitions: u32,
        keys: Vec<String>,
        tasks: Vec<PyTask>,
    ) -> PyResult<(u64, u64)> {
        let driver = self.driver()?;
        let tasks = stage_tasks(tasks);
        let run = stage::run_stage(
            &driver,
            &self.stages,
            schema.into_inner(),
            partitions,
            keys,
            tasks,
            self.strategy,
        );
        wait(py, &self.rt, run)?.map_err(to_py)
    }

    /// Every partition of a stage as a list of pyarrow Tables, in partition order.
    fn read_stage(&self, py: Python<'_>, stage_id: u64) -> PyResult<Vec<Py<PyAny>>> {
        let driver = self.driver()?;
        let read = stage::read_stage(&driver, &self.stages, stage_id);
        let (schema, parts) = wait(py, &self.rt, read)?.map_err(to_py)?;
        parts
            .into_iter()
            .map(|b| {
                Ok(pyo3_arrow::PyTable::try_new(b, schema.clone())?
                    .into_pyarrow(py)?
                    .unbind())
            })
            .collect()
    }

    /// Free a stage's blocks on every worker.
    fn drop_stage(&self, py: Python<'_>, stage_id: u64) -> PyResult<()> {
        let driver = self.driver()?;
        py.detach(|| {
            self.rt
                .block_on(stage::drop_stage(&driver, &self.stages, stage_id))
        })
        .map_err(to_py)
    }

    /// Start a streaming job: the tasks run in `rounds` rounds (in the given order), each
    /// round's blocks are folded by the Python reducer described by `reducer`.
    #[pyo3(signature = (schema, partitions, keys, tasks, weights, rounds, reducer))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        schema: pyo3_arrow::PySchema,
        partitions: u32,
        keys: Vec<String>,
        tasks: Vec<PyTask>,
        weights: Vec<u64>,
        rounds: usize,
        reducer: Vec<u8>,
    ) -> PyResult<stage::NativeStream> {
        let driver = self.driver()?;
        stage::start_stream(
            &self.rt,
            &driver,
            &self.stages,
            schema.into_inner(),
            partitions,
            keys,
            stage_tasks(tasks),
            weights,
            rounds,
            reducer,
        )
        .map_err(to_py)
    }

    /// Online aggregation of SQL with the native map side: `sql` is the statistics query,
    /// `splits` cut the fact table (path, file bytes, file rows, first row, rows) in the order
    /// they are read, folded in an early first round and then `rounds` rounds as they commit;
    /// with `top` (column, divisor, null as zero, descending, k) each fold sends only the
    /// groups that can be among the first k in that order. `tables` are (name, Parquet path,
    /// a version of its files). Returns the stream and the staged plan's text.
    #[pyo3(signature = (sql, tables, splits, rounds, top=None))]
    fn online_sql(
        &self,
        py: Python<'_>,
        sql: String,
        tables: Vec<online::TableTuple>,
        splits: Vec<online::SplitTuple>,
        rounds: usize,
        top: Option<online::TopTuple>,
    ) -> PyResult<(stage::NativeStream, String)> {
        let driver = self.driver()?;
        online::start(
            py,
            &self.rt,
            &self.online,
            driver,
            self.strategy,
            sql,
            tables,
            splits,
            rounds,
            top,
        )
    }

    fn worker_pids(&self) -> Vec<u32> {
        self.with(|c| c.pids()).unwrap_or_default()
    }

    /// Lost workers replaced, map outputs recomputed, blocks rebuilt from parity and jobs
    /// run again whole so far.
    fn recovery(&self) -> (u64, u64, u64, u64) {
        self.with(|c| {
            let d = c.driver();
            (
                d.replacements(),
                d.recomputed_maps(),
                d.rebuilt_blocks(),
                d.reruns(),
            )
        })
        .unwrap_or_default()
    }

    /// The CA workers' certificates are signed by (PEM), and under mutual TLS the client
    /// certificate and key (PEM); None on a plaintext cluster.
    #[allow(clippy::type_complexity)]
    fn tls(&self) -> Option<(String, Option<(String, String)>)> {
        self.with(|c| {
            c.driver()
                .credentials()
                .tls
                .as_ref()
                .map(|t| (t.ca.clone(), t.identity.clone()))
        })
        .flatten()
    }

    /// The cluster token (for advanced clients: every call carries `Bearer <token>`).
    fn token(&self) -> Option<String> {
        self.with(|c| c.driver().token().to_string())
    }

    fn worker_addresses(&self) -> Vec<String> {
        self.with(|c| c.driver().addresses()).unwrap_or_default()
    }

    fn spill_root(&self) -> Option<String> {
        self.with(|c| c.scratch().display().to_string())
    }

    /// Per-worker block store statistics, as a JSON list.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let driver = self.driver()?;
        let stats = wait(py, &self.rt, driver.stats())?.map_err(to_py)?;
        let list: Vec<serde_json::Value> = stats
            .iter()
            .map(|s| {
                serde_json::json!({
                    "blocks": s.blocks, "memory_bytes": s.memory_bytes,
                    "memory_budget": s.memory_budget, "spilled_bytes": s.spilled_bytes,
                    "spilled_blocks": s.spilled_blocks, "spill_files": s.spill_files,
                    "restored_bytes": s.restored_bytes, "restored_blocks": s.restored_blocks,
                    "peak_rss_bytes": s.peak_rss_bytes, "rss_bytes": s.rss_bytes,
                    "shuffles": s.shuffles, "admitted_tasks": s.admitted_tasks,
                    "waited_tasks": s.waited_tasks, "overdraft_tasks": s.overdraft_tasks,
                    "peak_granted_bytes": s.peak_granted_bytes,
                    "peak_running_tasks": s.peak_running_tasks,
                    "peak_operator_bytes": s.peak_operator_bytes,
                    "peak_unspillable_bytes": s.peak_unspillable_bytes,
                    "granted_bytes": s.granted_bytes, "running_tasks": s.running_tasks,
                })
            })
            .collect();
        Ok(serde_json::Value::from(list).to_string())
    }

    #[pyo3(signature = (data, by, partitions, strategy, partitioner, map_bytes, input_bytes=None, parity=None))]
    #[allow(clippy::too_many_arguments)]
    fn shuffle(
        &self,
        py: Python<'_>,
        data: AnyRecordBatch,
        by: Vec<String>,
        partitions: u32,
        strategy: Option<String>,
        partitioner: String,
        map_bytes: usize,
        input_bytes: Option<usize>,
        parity: Option<u32>,
    ) -> PyResult<job::NativeShuffle> {
        let strategy = strategy.unwrap_or_else(|| self.strategy.strategy.to_string());
        let driver = self.driver()?;
        let parity = parity.unwrap_or(self.strategy.parity);
        flightshuffle::check_parity(driver.num_workers(), parity)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        let reader = data.into_reader()?;
        let opts = job::JobOptions {
            by,
            partitions,
            strategy,
            partitioner,
            map_bytes,
            speculation: self.strategy.speculation,
            input_bytes,
            parity,
        };
        job::NativeShuffle::start(py, self.rt.clone(), driver, reader, opts)
    }

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
        let batches = wait(py, &self.rt, async {
            local.sql(&query).await?.collect().await
        })?
        .map_err(|e| sql::df_err(e.into()))?;
        let seconds = start.elapsed().as_secs_f64();
        let schema = batches
            .first()
            .map(|b| b.schema())
            .unwrap_or_else(|| Arc::new(arrow::datatypes::Schema::empty()));
        let table = pyo3_arrow::PyTable::try_new(batches, schema)?;
        Ok((table.into_pyarrow(py)?.unbind(), seconds))
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

    /// This machine's calibration for the `auto` strategy (measured on first use), as JSON.
    fn calibration_json(&self, py: Python<'_>) -> PyResult<String> {
        let driver = self.driver()?;
        let c = wait(py, &self.rt, driver.calibration())?.map_err(to_py)?;
        Ok(flightshuffle::calibration_json(&c).to_string())
    }

    /// Stop every worker process. Safe to call more than once.
    fn close(&self, py: Python<'_>) {
        self.sql.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.online.close();
        let taken = self
            .cluster
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        py.detach(move || drop(taken));
    }
}

impl NativeCluster {
    fn with_workers(rt: Rt, workers: Workers, strategy: StrategyOptions) -> Self {
        NativeCluster {
            rt: Arc::new(rt),
            cluster: Arc::new(Mutex::new(Some(workers))),
            sql: Mutex::new(None),
            online: Arc::default(),
            local: datafusion::prelude::SessionContext::new_with_config(
                datafusion::prelude::SessionConfig::new().with_target_partitions(
                    std::thread::available_parallelism().map_or(2, |n| n.get()),
                ),
            ),
            stages: Default::default(),
            strategy,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Workers) -> T) -> Option<T> {
        self.cluster
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .map(f)
    }

    fn sql_context(&self) -> PyResult<Arc<flightshuffle_datafusion::DistributedContext>> {
        let mut slot = self.sql.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ctx) = slot.as_ref() {
            return Ok(ctx.clone());
        }
        let driver = self.driver()?;
        let _runtime = self.rt.enter();
        let config =
            flightshuffle_datafusion::DistributedContext::default_config(driver.num_workers());
        let ctx = Arc::new(
            flightshuffle_datafusion::DistributedContext::new(driver, config)
                .map_err(sql::df_err)?
                // SQL stages recover from lineage (every stage input can be read again);
                // parity protects shuffles and dataset stages.
                .with_strategy_options(flightshuffle::strategy::StrategyOptions {
                    parity: 0,
                    ..self.strategy
                }),
        );
        *slot = Some(ctx.clone());
        Ok(ctx)
    }

    fn driver(&self) -> PyResult<Arc<flightshuffle::driver::Driver>> {
        self.with(|c| c.driver().clone())
            .ok_or_else(|| ShuffleError::new_err("the cluster is closed"))
    }
}

/// A strategy name from Python (None: the cluster's default).
fn parse_strategy(name: Option<String>) -> PyResult<Option<flightshuffle::strategy::Strategy>> {
    name.map(|s| s.parse().map_err(to_py)).transpose()
}

/// A task from Python: `(body, input stage | None, input partition, split | None)`, a split
/// being `(path, row group, first row, rows, columns)`.
type PyTask = (Vec<u8>, Option<u64>, u32, Option<PySplit>);
type PySplit = (String, u32, u64, u64, Vec<String>);

fn stage_tasks(tasks: Vec<PyTask>) -> Vec<stage::DatasetTask> {
    tasks
        .into_iter()
        .map(|(body, shuffle, partition, split)| stage::DatasetTask {
            body,
            input: shuffle.map(|s| (s, partition)),
            split: split.map(|(path, row_group, start, rows, columns)| {
                flightshuffle::proto::FileSplit {
                    path,
                    row_group,
                    start,
                    rows,
                    columns,
                }
            }),
        })
        .collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    flightshuffle::worker::init_logging();
    m.add_class::<NativeCluster>()?;
    m.add_class::<job::NativeShuffle>()?;
    m.add_class::<stage::NativeStream>()?;
    m.add_function(wrap_pyfunction!(functions::datafusion_query, m)?)?;
    m.add_function(wrap_pyfunction!(functions::run_worker, m)?)?;
    m.add_function(wrap_pyfunction!(hosted::make_tls, m)?)?;
    m.add_function(wrap_pyfunction!(hosted::make_cert_request, m)?)?;
    m.add_function(wrap_pyfunction!(hosted::sign_cert_request, m)?)?;
    m.add("ShuffleError", m.py().get_type::<ShuffleError>())?;
    m.add("WorkerLostError", m.py().get_type::<WorkerLostError>())?;
    m.add("ChecksumError", m.py().get_type::<ChecksumError>())?;
    Ok(())
}
