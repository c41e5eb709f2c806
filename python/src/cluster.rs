//! The `NativeCluster` class: what it holds, how it is made from [`ClusterOptions`] (local
//! worker processes, or workers hosted elsewhere such as Ray actors), and its lifecycle methods
//! (workers, recovery, TLS, statistics, calibration, close). The methods of each domain
//! (datasets, online aggregation, shuffles, SQL) are in `methods/`.

use crate::hosted::{self, Workers};
use crate::{online, runtime, sql, stage, to_py, wait, Rt, ShuffleError};
use flightshuffle::cluster::{HostedCluster, LocalCluster, LocalClusterConfig, TlsSetting};
use flightshuffle::strategy::StrategyOptions;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A cluster driven from Python: its runtime, its workers (local processes or hosted), the
/// SQL and online contexts, and the dataset stages run so far.
#[pyclass(module = "flightshuffle._native")]
pub struct NativeCluster {
    pub(crate) rt: Arc<Rt>,
    pub(crate) cluster: Arc<Mutex<Option<Workers>>>,
    pub(crate) sql: Mutex<Option<Arc<flightshuffle_datafusion::DistributedContext>>>,
    /// The context of online SQL and its tables.
    pub(crate) online: Arc<online::Sessions>,
    /// Single-process DataFusion over the same tables: the baseline of benchmarks.
    pub(crate) local: datafusion::prelude::SessionContext,
    /// Output shuffles of Python map stages (datasets), by id.
    pub(crate) stages: stage::Stages,
    /// Strategy knobs of every shuffle, stage and query of this cluster (speculation).
    pub(crate) strategy: flightshuffle::strategy::StrategyOptions,
    /// Where each SQL query writes its event log (`Cluster(event_log=...)`).
    pub(crate) event_log: Option<String>,
    /// Queries reading at most this many rows run whole on the driver
    /// (`Cluster(small_query_rows=...)`, the default of `flightshuffle.small_query_rows`).
    pub(crate) small_query_rows: Option<u64>,
    /// The event log of the last shuffle job started from Python.
    pub(crate) last_job_log: Mutex<Option<std::path::PathBuf>>,
    /// The event log of the job Python is running (online aggregation), and the one the
    /// driver wrote to before it.
    pub(crate) py_job_log: Mutex<Option<crate::job::PyJobLog>>,
    /// The Flight SQL endpoint, once served (stopped with the cluster).
    pub(crate) flight_sql: Mutex<Option<flightshuffle_datafusion::flight_sql::FlightSqlServer>>,
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
    /// Durable shuffles: an object store URL, and object_store's options for it.
    storage: Option<String>,
    storage_options: Option<std::collections::BTreeMap<String, String>>,
    /// Whether map outputs are written to the store (false: it is only the tier below the
    /// workers' disk).
    durable: bool,
    /// Spill file bytes per worker past which segments move to the store.
    disk_budget: Option<u64>,
    /// Where each SQL query writes its event log.
    event_log: Option<String>,
    /// The default of `flightshuffle.small_query_rows` in this cluster's SQL sessions.
    small_query_rows: u64,
}

impl ClusterOptions {
    /// The store durable shuffles write to, if one was named.
    fn storage_config(&self) -> PyResult<Option<flightshuffle::StorageConfig>> {
        match &self.storage {
            None => Ok(None),
            Some(url) => flightshuffle::StorageConfig::new(
                url.clone(),
                self.storage_options.clone().unwrap_or_default(),
            )
            .map(Some)
            .map_err(to_py),
        }
    }

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
        let storage = options.storage_config()?;
        let mut cfg = cluster_config(
            workers,
            options.memory_budget,
            options.spill_dir,
            options.compression,
            worker_command,
            options.timeout_secs,
            &options.tls,
            options.tls_files,
        )?;
        cfg.driver.storage = storage;
        cfg.driver.durable = options.durable;
        cfg.disk_budget = options.disk_budget;
        // Ctrl-C while the workers start drops the start: the processes started so far are
        // killed, and every worker exits when its driver's pipe closes.
        let cluster = wait(py, &rt, async {
            let cluster = LocalCluster::start(cfg).await?;
            calibrate_for(&cluster.driver, &opts).await?;
            Ok::<_, flightshuffle::Error>(cluster)
        })?
        .map_err(to_py)?;
        Ok(Self {
            event_log: options.event_log,
            small_query_rows: Some(options.small_query_rows),
            ..Self::with_workers(rt, Workers::Local(cluster), opts)
        })
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
        let supervisor = Supervisor::Replacer(hosted::py_replacer(replace));
        Self::connect_hosted(py, addresses, token, supervisor, options)
    }

    /// A driver for workers a supervisor runs at fixed `addresses` (a static cluster, see
    /// `HostedCluster::connect_static`): a lost worker's slot waits up to `restart_wait`
    /// seconds for a new process at its address, then (`take_over`) a survivor takes it over.
    /// In `options`, `tls_files` (ca, cert, key): the CA to verify the workers with (cert and
    /// key are the driver's own, for mutual TLS).
    #[staticmethod]
    fn connect_static(
        py: Python<'_>,
        addresses: Vec<String>,
        token: String,
        restart_wait: f64,
        take_over: bool,
        options: ClusterOptions,
    ) -> PyResult<Self> {
        let wait_for = Duration::from_secs_f64(restart_wait.max(0.0));
        let supervisor = Supervisor::Restarts(wait_for, take_over);
        Self::connect_hosted(py, addresses, token, supervisor, options)
    }

    /// Take worker `worker` out of the cluster for good (see `Driver::retire_worker`): the
    /// driver lets go of it, then its process stops (here for a local cluster; the Ray runtime
    /// kills its actor). Returns the retired worker's address.
    fn remove_worker(&self, py: Python<'_>, worker: usize) -> PyResult<String> {
        let driver = self.driver()?;
        let left = driver.num_workers().saturating_sub(1);
        if self.strategy.parity > 0 {
            flightshuffle::check_parity(left, self.strategy.parity).map_err(|e| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "worker {worker} cannot be removed: {e}"
                ))
            })?;
        }
        let retired = wait(
            py,
            &self.rt,
            async move { driver.retire_worker(worker).await },
        )?
        .map_err(to_py)?;
        self.with(|c| {
            if let Workers::Local(local) = c {
                local.stop_removed(worker);
            }
        });
        Ok(retired.addr)
    }

    fn worker_pids(&self) -> Vec<u32> {
        self.with(|c| c.pids()).unwrap_or_default()
    }

    /// Lost workers replaced, map outputs recomputed, blocks rebuilt from parity and jobs
    /// run again whole so far.
    fn recovery(&self) -> (u64, u64, u64, u64, u64) {
        self.with(|c| {
            let d = c.driver();
            (
                d.replacements(),
                d.recomputed_maps(),
                d.rebuilt_blocks(),
                d.reruns(),
                d.restored_blocks(),
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

    /// Work done on the cluster so far: (map tasks committed, their rows, bytes, spilled
    /// bytes, exchanges planned, exchanges sealed); progress bars take differences.
    fn progress(&self) -> [u64; 6] {
        self.with(|c| c.driver().progress().snapshot())
            .unwrap_or_default()
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
    /// Requests to the object store of durable shuffles (driver and workers), as JSON.
    fn storage_stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let driver = self.driver()?;
        let s = wait(py, &self.rt, driver.storage_stats())?.map_err(to_py)?;
        Ok(serde_json::json!({
            "puts": s.puts, "put_parts": s.put_parts, "gets": s.gets, "lists": s.lists,
            "deletes": s.deletes, "bytes_written": s.bytes_written, "bytes_read": s.bytes_read,
        })
        .to_string())
    }

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
                    "disk_bytes": s.disk_bytes, "tiered_segments": s.tiered_segments,
                    "tiered_bytes": s.tiered_bytes,
                })
            })
            .collect();
        Ok(serde_json::Value::from(list).to_string())
    }

    /// This machine's calibration for the `auto` strategy (measured on first use), as JSON.
    fn calibration_json(&self, py: Python<'_>) -> PyResult<String> {
        let driver = self.driver()?;
        let c = wait(py, &self.rt, driver.calibration())?.map_err(to_py)?;
        Ok(flightshuffle::calibration_json(&c).to_string())
    }

    /// Stop every worker process. Safe to call more than once.
    fn close(&self, py: Python<'_>) {
        self.flight_sql
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
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
    pub(crate) fn with_workers(rt: Rt, workers: Workers, strategy: StrategyOptions) -> Self {
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
            flight_sql: Mutex::new(None),
            event_log: None,
            small_query_rows: None,
            last_job_log: Mutex::new(None),
            py_job_log: Mutex::new(None),
        }
    }

    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Workers) -> T) -> Option<T> {
        self.cluster
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .map(f)
    }

    pub(crate) fn sql_context(
        &self,
    ) -> PyResult<Arc<flightshuffle_datafusion::DistributedContext>> {
        let mut slot = self.sql.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ctx) = slot.as_ref() {
            return Ok(ctx.clone());
        }
        let driver = self.driver()?;
        let _runtime = self.rt.enter();
        let mut config =
            flightshuffle_datafusion::DistributedContext::default_config(driver.num_workers());
        if let Some(rows) = self.small_query_rows {
            let mut options = flightshuffle_datafusion::FlightshuffleOptions::default();
            options.small_query_rows = rows;
            config = config.with_option_extension(options);
        }
        let mut ctx = flightshuffle_datafusion::DistributedContext::new(driver, config)
            .map_err(sql::df_err)?
            // SQL stages recover from lineage (every stage input can be read again);
            // parity protects shuffles and dataset stages.
            .with_strategy_options(flightshuffle::strategy::StrategyOptions {
                parity: 0,
                ..self.strategy
            });
        if let Some(dir) = &self.event_log {
            ctx = ctx.with_event_log(dir);
        }
        let ctx = Arc::new(ctx);
        *slot = Some(ctx.clone());
        Ok(ctx)
    }

    pub(crate) fn driver(&self) -> PyResult<Arc<flightshuffle::driver::Driver>> {
        self.with(|c| c.driver().clone())
            .ok_or_else(|| ShuffleError::new_err("the cluster is closed"))
    }
}

/// What brings a hosted cluster's lost worker back.
enum Supervisor {
    /// A Python callable that starts a replacement and returns its address (Ray).
    Replacer(flightshuffle::driver::Replacer),
    /// Nothing here: a supervisor restarts the process at its address within this time; if
    /// not, a survivor takes the slot over when the flag is set.
    Restarts(Duration, bool),
}

impl NativeCluster {
    /// A driver for workers at `addresses`, started by something else (see
    /// [`Supervisor`]), calibrated before it returns.
    fn connect_hosted(
        py: Python<'_>,
        addresses: Vec<String>,
        token: String,
        supervisor: Supervisor,
        options: ClusterOptions,
    ) -> PyResult<Self> {
        let opts = options.strategy_options(addresses.len())?;
        let storage = options.storage_config()?;
        let creds = hosted::credentials(token, tls_setting(&options.tls, options.tls_files)?)?;
        let cfg = flightshuffle::driver::DriverConfig {
            rpc_timeout: Duration::from_secs_f64(options.timeout_secs.max(1.0)),
            storage,
            durable: options.durable,
            ..Default::default()
        };
        let scratch = options.spill_dir.map(Into::into);
        let rt = runtime()?;
        let hosted = wait(py, &rt, async {
            let c = match supervisor {
                Supervisor::Replacer(r) => {
                    HostedCluster::connect(&addresses, &creds, cfg, scratch, Some(r)).await?
                }
                Supervisor::Restarts(wait_for, take_over) => {
                    HostedCluster::connect_static(
                        &addresses, &creds, cfg, scratch, wait_for, take_over,
                    )
                    .await?
                }
            };
            calibrate_for(&c.driver, &opts).await?;
            Ok::<_, flightshuffle::Error>(c)
        })?
        .map_err(to_py)?;
        Ok(Self {
            event_log: options.event_log,
            small_query_rows: Some(options.small_query_rows),
            ..Self::with_workers(rt, Workers::Hosted(hosted), opts)
        })
    }
}
