//! `flightshuffle._native`: the Python bindings. A `NativeCluster` owns a tokio runtime and a
//! local cluster; `shuffle()` takes anything exporting the Arrow PyCapsule stream interface
//! (zero-copy import) and returns a `NativeShuffle` yielding partitions as Arrow tables.

mod cluster;
mod functions;
mod hosted;
mod job;
mod methods;
mod online;
mod script;
mod sql;
mod stage;

use cluster::NativeCluster;
use flightshuffle::Error;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

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

pub(crate) fn runtime() -> PyResult<Rt> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("flightshuffle-driver")
        .build()
        .map(|rt| Rt(Some(rt)))
        .map_err(|e| ShuffleError::new_err(format!("cannot start runtime: {e}")))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    flightshuffle::worker::init_logging();
    m.add_class::<NativeCluster>()?;
    m.add_class::<job::NativeShuffle>()?;
    m.add_class::<stage::NativeStream>()?;
    m.add_function(wrap_pyfunction!(functions::datafusion_query, m)?)?;
    m.add_function(wrap_pyfunction!(functions::run_worker, m)?)?;
    m.add_function(wrap_pyfunction!(functions::storage_sweep, m)?)?;
    m.add_function(wrap_pyfunction!(hosted::make_tls, m)?)?;
    m.add_function(wrap_pyfunction!(hosted::make_cert_request, m)?)?;
    m.add_function(wrap_pyfunction!(hosted::sign_cert_request, m)?)?;
    m.add("ShuffleError", m.py().get_type::<ShuffleError>())?;
    m.add("WorkerLostError", m.py().get_type::<WorkerLostError>())?;
    m.add("ChecksumError", m.py().get_type::<ChecksumError>())?;
    Ok(())
}
