//! The event log of a query or job: one JSON object per line, written by the driver as it
//! sees things happen (its clock: `t` is seconds since the log opened). Tasks start and end
//! (worker, attempt, rows, bytes, spill), exchanges are chosen and sealed, workers are lost
//! and replaced, map outputs are recomputed, restored from the store or rebuilt from parity.
//! `flightshuffle report` renders a log as a timeline. The file is private to its user.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

/// One open event log.
pub struct EventLog {
    path: PathBuf,
    start: Instant,
    out: Mutex<std::io::BufWriter<std::fs::File>>,
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLog")
            .field("path", &self.path)
            .finish()
    }
}

impl EventLog {
    /// Create the log file `path` (new, owner-only; its directory is created private).
    pub fn create(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            crate::private::create_dir(dir)?;
        }
        let file = crate::private::create_file(path)?;
        Ok(EventLog {
            path: path.to_path_buf(),
            start: Instant::now(),
            out: Mutex::new(std::io::BufWriter::new(file)),
        })
    }

    /// Where the log is written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Seconds since the log opened.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Append one event: `{"t": <now>, "event": kind, ...fields}` (fields an object). A
    /// failed write is logged once per call, never fatal to the job.
    pub fn write(&self, kind: &str, fields: serde_json::Value) {
        // The clock is read under the lock, so lines written from several threads are in
        // time order in the file.
        let mut out = crate::sync::lock(&self.out);
        let mut line = serde_json::Map::new();
        line.insert("t".into(), serde_json::json!(self.now()));
        line.insert("event".into(), serde_json::json!(kind));
        if let serde_json::Value::Object(f) = fields {
            line.extend(f);
        }
        let text = serde_json::Value::Object(line).to_string();
        if let Err(e) = writeln!(out, "{text}") {
            tracing::warn!(path = %self.path.display(), error = %e, "event not written");
        }
    }

    /// Write what is buffered to the file.
    pub fn flush(&self) -> Result<()> {
        crate::sync::lock(&self.out).flush().map_err(|e| Error::Io {
            path: self.path.clone(),
            source: e,
        })
    }
}

impl Drop for EventLog {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}
