//! `flightshuffle._native`: the Python bindings. A `NativeCluster` owns a tokio runtime and a
//! local cluster; `shuffle()` takes anything exporting the Arrow PyCapsule stream interface
//! (zero-copy import) and returns a `NativeShuffle` yielding partitions as Arrow tables.

mod job;

use exchange::bench::{shuffle_bench as run_bench, BenchConfig};
use exchange::cluster::{LocalCluster, LocalClusterConfig};
use exchange::Error;
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
    let msg = e.to_string();
    match &e {
        Error::WorkerLost { .. } => WorkerLostError::new_err(msg),
        Error::Checksum { .. } => ChecksumError::new_err(msg),
        Error::Remote { code, .. } if *code == exchange::transport_code::Code::DataLoss => {
            ChecksumError::new_err(msg)
        }
        Error::Remote { code, .. } if *code == exchange::transport_code::Code::InvalidArgument => {
            pyo3::exceptions::PyValueError::new_err(msg)
        }
        Error::InvalidArgument(_) | Error::SchemaMismatch { .. } => {
            pyo3::exceptions::PyValueError::new_err(msg)
        }
        _ => ShuffleError::new_err(msg),
    }
}

#[pyclass(module = "flightshuffle._native")]
struct NativeCluster {
    rt: Arc<tokio::runtime::Runtime>,
    cluster: Arc<Mutex<Option<LocalCluster>>>,
}

fn runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("flightshuffle-driver")
        .build()
        .map_err(|e| ShuffleError::new_err(format!("cannot start runtime: {e}")))
}

fn cluster_config(
    workers: usize,
    memory_budget: u64,
    spill_dir: Option<String>,
    compression: String,
    worker_command: Vec<String>,
    timeout_secs: f64,
) -> LocalClusterConfig {
    let mut cfg = LocalClusterConfig::new(workers, worker_command);
    cfg.memory_budget = memory_budget;
    cfg.spill_dir = spill_dir.map(Into::into);
    cfg.compression = compression;
    cfg.driver.rpc_timeout = Duration::from_secs_f64(timeout_secs.max(1.0));
    cfg
}

#[pymethods]
impl NativeCluster {
    #[new]
    #[pyo3(signature = (workers, memory_budget, spill_dir, compression, worker_command, timeout_secs))]
    fn new(
        py: Python<'_>,
        workers: usize,
        memory_budget: u64,
        spill_dir: Option<String>,
        compression: String,
        worker_command: Vec<String>,
        timeout_secs: f64,
    ) -> PyResult<Self> {
        let rt = runtime()?;
        let cfg = cluster_config(
            workers,
            memory_budget,
            spill_dir,
            compression,
            worker_command,
            timeout_secs,
        );
        let cluster = py
            .detach(|| rt.block_on(LocalCluster::start(cfg)))
            .map_err(to_py)?;
        Ok(NativeCluster {
            rt: Arc::new(rt),
            cluster: Arc::new(Mutex::new(Some(cluster))),
        })
    }

    fn worker_pids(&self) -> Vec<u32> {
        self.with(|c| c.pids()).unwrap_or_default()
    }

    fn worker_addresses(&self) -> Vec<String> {
        self.with(|c| c.driver.addresses()).unwrap_or_default()
    }

    fn spill_root(&self) -> Option<String> {
        self.with(|c| c.spill_root.display().to_string())
    }

    /// Per-worker block store statistics, as a JSON list.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let driver = self.driver()?;
        let stats = py
            .detach(|| self.rt.block_on(driver.stats()))
            .map_err(to_py)?;
        let list: Vec<serde_json::Value> = stats
            .iter()
            .map(|s| {
                serde_json::json!({
                    "blocks": s.blocks, "memory_bytes": s.memory_bytes,
                    "memory_budget": s.memory_budget, "spilled_bytes": s.spilled_bytes,
                    "spilled_blocks": s.spilled_blocks, "spill_files": s.spill_files,
                    "restored_bytes": s.restored_bytes, "restored_blocks": s.restored_blocks,
                    "peak_rss_bytes": s.peak_rss_bytes, "shuffles": s.shuffles,
                })
            })
            .collect();
        Ok(serde_json::Value::from(list).to_string())
    }

    #[pyo3(signature = (data, by, partitions, strategy, partitioner, map_bytes))]
    #[allow(clippy::too_many_arguments)]
    fn shuffle(
        &self,
        py: Python<'_>,
        data: AnyRecordBatch,
        by: Vec<String>,
        partitions: u32,
        strategy: String,
        partitioner: String,
        map_bytes: usize,
    ) -> PyResult<job::NativeShuffle> {
        let reader = data.into_reader()?;
        let driver = self.driver()?;
        let opts = job::JobOptions {
            by,
            partitions,
            strategy,
            partitioner,
            map_bytes,
        };
        job::NativeShuffle::start(py, self.rt.clone(), driver, reader, opts)
    }

    /// Stop every worker process. Safe to call more than once.
    fn close(&self, py: Python<'_>) {
        let taken = self
            .cluster
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        py.detach(move || drop(taken));
    }
}

impl NativeCluster {
    fn with<T>(&self, f: impl FnOnce(&mut LocalCluster) -> T) -> Option<T> {
        self.cluster
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .map(f)
    }

    fn driver(&self) -> PyResult<Arc<exchange::driver::Driver>> {
        self.with(|c| c.driver.clone())
            .ok_or_else(|| ShuffleError::new_err("the cluster is closed"))
    }
}

/// Run a worker process (`python -m flightshuffle.worker ...`) until it is stopped.
#[pyfunction]
fn run_worker(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    py.detach(|| {
        exchange::worker::main_with_args(argv, exchange::task::SourceRegistry::with_builtin())
    })
    .map_err(to_py)
}

/// `shuffle-bench`: returns the JSON report.
#[pyfunction]
#[pyo3(signature = (rows, workers, partitions, memory_budget, maps, batch_rows, seed, compression, worker_command))]
#[allow(clippy::too_many_arguments)]
fn shuffle_bench(
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
) -> PyResult<String> {
    let rt = runtime()?;
    let cluster = cluster_config(
        workers,
        memory_budget,
        None,
        compression,
        worker_command,
        600.0,
    );
    let cfg = BenchConfig {
        rows,
        partitions,
        maps,
        batch_rows,
        seed,
        cluster,
    };
    let report = py.detach(|| rt.block_on(run_bench(cfg))).map_err(to_py)?;
    Ok(serde_json::to_string_pretty(&report).unwrap_or_default())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeCluster>()?;
    m.add_class::<job::NativeShuffle>()?;
    m.add_function(wrap_pyfunction!(run_worker, m)?)?;
    m.add_function(wrap_pyfunction!(shuffle_bench, m)?)?;
    m.add("ShuffleError", m.py().get_type::<ShuffleError>())?;
    m.add("WorkerLostError", m.py().get_type::<WorkerLostError>())?;
    m.add("ChecksumError", m.py().get_type::<ChecksumError>())?;
    Ok(())
}
