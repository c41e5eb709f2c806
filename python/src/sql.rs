//! Distributed SQL from Python: tables registered from Parquet paths (Arrow objects are written
//! to Parquet by the Python layer first), queries run by
//! `flightshuffle_datafusion::DistributedContext`.

use crate::{to_py, to_py_ref, ShuffleError};
use flightshuffle_datafusion::{DistributedContext, QueryResult};
use pyo3::prelude::*;
use std::path::Path;

pub fn df_err(e: flightshuffle_datafusion::Error) -> PyErr {
    match e {
        flightshuffle_datafusion::Error::Exchange(e) => to_py(e),
        flightshuffle_datafusion::Error::DataFusion(e) => {
            // Errors that came out of the exchange keep their Python type.
            if let datafusion::error::DataFusionError::External(inner) = e.find_root() {
                if let Some(x) = inner.downcast_ref::<flightshuffle::Error>() {
                    return to_py_ref(x);
                }
            }
            match e.find_root() {
                datafusion::error::DataFusionError::Plan(_)
                | datafusion::error::DataFusionError::SQL(..)
                | datafusion::error::DataFusionError::SchemaError(..) => {
                    pyo3::exceptions::PyValueError::new_err(e.to_string())
                }
                _ => ShuffleError::new_err(e.to_string()),
            }
        }
    }
}

pub fn metrics_json(r: &QueryResult) -> String {
    serde_json::json!({
        "seconds": r.seconds,
        "stages": r.stages,
        "rpcs": r.rpcs,
    })
    .to_string()
}

/// Register (or re-register: a name given again replaces the earlier table) a Parquet table.
pub async fn register(ctx: &DistributedContext, name: &str, path: &str) -> Result<(), PyErr> {
    if !Path::new(path).exists() {
        return Err(pyo3::exceptions::PyFileNotFoundError::new_err(format!(
            "table {name}: no such file or directory: {path}"
        )));
    }
    ctx.register_parquet(name, path).await.map_err(df_err)
}
