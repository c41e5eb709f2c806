//! Where a `NativeCluster`'s workers run: the local cluster (worker processes started here,
//! the embedded default) or workers hosted by another runtime (Ray actors started by the
//! Python package, `flightshuffle.ray`), which the driver dials and replaces through a Python
//! callable; and the certificates made for hosted workers.

use flightshuffle::cluster::{HostedCluster, LocalCluster, TlsSetting};
use flightshuffle::driver::{Driver, Replacer};
use flightshuffle::transport::tls::LocalTls;
use flightshuffle::Error;
use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;

pub enum Workers {
    Local(LocalCluster),
    Hosted(HostedCluster),
}

impl Workers {
    pub fn driver(&self) -> &Arc<Driver> {
        match self {
            Workers::Local(c) => &c.driver,
            Workers::Hosted(c) => &c.driver,
        }
    }

    /// The worker processes' ids (known here for local workers only).
    pub fn pids(&self) -> Vec<u32> {
        match self {
            Workers::Local(c) => c.pids(),
            Workers::Hosted(_) => Vec::new(),
        }
    }

    /// Where files every worker reads are written (the local cluster's spill root).
    pub fn scratch(&self) -> PathBuf {
        match self {
            Workers::Local(c) => c.spill_root.clone(),
            Workers::Hosted(c) => c.scratch.clone(),
        }
    }
}

/// A Python callable `replace(slot) -> "host:port"` as the driver's replacer: it starts a new
/// worker in the slot of a lost one (run on a blocking thread, with the GIL taken there).
pub fn py_replacer(replace: Py<PyAny>) -> Replacer {
    Arc::new(move |i: usize| {
        Python::attach(|py| {
            replace
                .call1(py, (i,))
                .and_then(|addr| addr.extract::<String>(py))
        })
        .map_err(|e| Error::Cluster(format!("cannot replace worker {i}: {e}")))
    })
}

/// Make a CA and a worker certificate naming `localhost`, `127.0.0.1` and `hosts` in `dir`;
/// returns the paths of the CA, the certificate and its key (PEM).
#[pyfunction]
pub fn make_tls(
    py: Python<'_>,
    dir: String,
    hosts: Vec<String>,
) -> PyResult<(String, String, String)> {
    let files = py
        .detach(|| LocalTls::generate_for(std::path::Path::new(&dir), &hosts))
        .map_err(crate::to_py)?;
    let s = |p: PathBuf| p.display().to_string();
    Ok((s(files.ca), s(files.cert), s(files.key)))
}

/// On a worker's machine: make its key (written to `key_path`, private) and return a
/// certificate request naming `hosts`, for the driver to sign ([`sign_cert_request`]).
#[pyfunction]
pub fn make_cert_request(py: Python<'_>, key_path: String, hosts: Vec<String>) -> PyResult<String> {
    py.detach(|| {
        flightshuffle::transport::tls::make_request(std::path::Path::new(&key_path), &hosts)
    })
    .map_err(crate::to_py)
}

/// On the driver: sign a worker's certificate request with the CA `make_tls` made in `dir`
/// (its key never leaves the driver), for `hosts`; returns the certificate (PEM).
#[pyfunction]
pub fn sign_cert_request(
    py: Python<'_>,
    dir: String,
    request: String,
    hosts: Vec<String>,
) -> PyResult<String> {
    let dir = PathBuf::from(dir);
    let tls = LocalTls {
        ca: dir.join("ca.pem"),
        cert: dir.join("worker.pem"),
        key: dir.join("worker.key"),
    };
    py.detach(|| flightshuffle::transport::tls::sign_request(&tls, &request, &hosts))
        .map_err(crate::to_py)
}

/// How the driver dials hosted workers that serve the certificate files in `tls`.
pub fn credentials(
    token: String,
    tls: TlsSetting,
) -> PyResult<flightshuffle::transport::Credentials> {
    let tls = match tls {
        TlsSetting::Off => None,
        TlsSetting::Files {
            ca,
            cert,
            key,
            mutual,
        } => Some(
            LocalTls { ca, cert, key }
                .client(mutual)
                .map_err(crate::to_py)?,
        ),
        TlsSetting::Local { .. } => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "hosted workers need the certificate files they serve (tls_files)",
            ))
        }
    };
    Ok(flightshuffle::transport::Credentials { token, tls })
}
