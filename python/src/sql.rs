//! Distributed SQL from Python: tables from Parquet paths or Arrow objects (written to Parquet
//! in the cluster's scratch directory so every worker can scan them), queries run by
//! `exchange_datafusion::DistributedContext`.

use crate::{to_py, to_py_ref, ShuffleError};
use arrow::array::RecordBatchReader;
use exchange_datafusion::{DistributedContext, QueryResult};
use parquet::arrow::ArrowWriter;
use pyo3::prelude::*;
use std::path::{Path, PathBuf};

pub fn df_err(e: exchange_datafusion::Error) -> PyErr {
    match e {
        exchange_datafusion::Error::Exchange(e) => to_py(e),
        exchange_datafusion::Error::DataFusion(e) => {
            // Errors that came out of the exchange keep their Python type.
            if let datafusion::error::DataFusionError::External(inner) = e.find_root() {
                if let Some(x) = inner.downcast_ref::<exchange::Error>() {
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

/// Write an Arrow stream to `dir/<name>.parquet`; returns the file path.
pub fn write_parquet(
    reader: Box<dyn RecordBatchReader + Send>,
    dir: &Path,
    name: &str,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!(
            "table name {name:?} must be letters, digits and underscores"
        ));
    }
    let path = dir.join(format!("{name}.parquet"));
    let file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut w = ArrowWriter::try_new(file, reader.schema(), None).map_err(|e| e.to_string())?;
    for b in reader {
        w.write(&b.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    w.close().map_err(|e| e.to_string())?;
    Ok(path)
}

pub fn metrics_json(r: &QueryResult) -> String {
    serde_json::json!({
        "seconds": r.seconds,
        "stages": r.stages,
    })
    .to_string()
}

pub async fn register(ctx: &DistributedContext, name: &str, path: &str) -> Result<(), PyErr> {
    if !Path::new(path).exists() {
        return Err(pyo3::exceptions::PyFileNotFoundError::new_err(format!(
            "table {name}: no such file or directory: {path}"
        )));
    }
    ctx.register_parquet(name, path).await.map_err(df_err)
}
