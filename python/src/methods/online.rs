//! Online aggregation of SQL with the native map side, and the event log of a job Python
//! runs (online aggregation: its rounds beside the driver's task events).

use crate::cluster::NativeCluster;
use crate::job::PyJobLog;
use crate::{online, stage};
use flightshuffle::events::EventLog;
use pyo3::prelude::*;
use std::sync::Arc;

fn json(text: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

#[pymethods]
impl NativeCluster {
    /// Online aggregation of SQL with the native map side: `sql` is the statistics query,
    /// `splits` cut the fact table (path, file bytes, file rows, first row, rows) in the order
    /// they are read, folded in an early first round and then `rounds` rounds as they commit;
    /// with `top` (column, divisor, null as zero, descending, k) each fold sends only the
    /// groups that can be among the first k in that order; with `distinct` (the number of
    /// group keys, the value's column, its rows' column) a COUNT(DISTINCT)'s counts per group. `tables` are (name, Parquet path,
    /// a version of its files); `terms` (factor pairs: a statistic's index, or 2^32-1 for the
    /// split's rows, 2^32-2 for 1) are summed per group over the splits read, after the
    /// statistics; map task i reads `per_task[i]` consecutive splits (one each when empty).
    /// Returns the stream and the staged plan's text.
    #[pyo3(signature = (sql, tables, splits, rounds, top=None, terms=Vec::new(), per_task=Vec::new(), distinct=None))]
    #[allow(clippy::too_many_arguments)]
    fn online_sql(
        &self,
        py: Python<'_>,
        sql: String,
        tables: Vec<online::TableTuple>,
        splits: Vec<online::SplitTuple>,
        rounds: usize,
        top: Option<online::TopTuple>,
        terms: Vec<(u32, u32)>,
        per_task: Vec<u32>,
        distinct: Option<(u32, u32, u32)>,
    ) -> PyResult<(stage::NativeStream, String)> {
        let driver = self.driver()?;
        // The SQL session's `SET flightshuffle.*` settings apply to online queries too (the
        // defaults before it ran any).
        let settings = Some(
            self.sql
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|ctx| ctx.options())
                .unwrap_or_default(),
        );
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
            distinct,
            terms,
            per_task,
            settings,
        )
    }

    /// With `Cluster(event_log=DIR)`: open `DIR/name` for a job run from Python, write its
    /// `query_start` (`start`, JSON fields) and send the driver's events there until
    /// [`Self::job_log_end`]; returns the path (None without an event log directory).
    fn job_log_begin(&self, name: String, start: String) -> PyResult<Option<String>> {
        let Some(dir) = &self.event_log else {
            return Ok(None);
        };
        if name.contains('/') || name.starts_with('.') {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "not a log file name: {name:?}"
            )));
        }
        let path = std::path::Path::new(dir).join(&name);
        let log = Arc::new(EventLog::create(&path).map_err(crate::to_py)?);
        let driver = self.driver()?;
        log.write("query_start", json(&start)?);
        let before = driver.log_events(Some(log.clone()));
        *self.py_job_log.lock().unwrap_or_else(|p| p.into_inner()) = Some(PyJobLog { log, before });
        *self.last_job_log.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.clone());
        Ok(Some(path.display().to_string()))
    }

    /// Write one event (`kind`, JSON `fields`) to the open job log, if any.
    fn job_log_event(&self, kind: String, fields: String) -> PyResult<()> {
        if let Some(j) = self
            .py_job_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            j.log.write(&kind, json(&fields)?);
        }
        Ok(())
    }

    /// Write the open job log's `query_end` (`end`, JSON fields) and close it; the driver's
    /// events go back where they went before.
    fn job_log_end(&self, end: String) -> PyResult<()> {
        let open = self
            .py_job_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(j) = open {
            j.log.write("query_end", json(&end)?);
            self.driver()?.log_events(j.before);
            j.log.flush().map_err(crate::to_py)?;
        }
        Ok(())
    }
}
