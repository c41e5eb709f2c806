//! One shuffle started from Python: a thin wrapper over [`flightshuffle::job::ShuffleJob`] that
//! converts the input to a batch iterator and hands each partition to Python as a
//! pyarrow Table.

use crate::to_py;
use arrow::array::RecordBatchReader;
use flightshuffle::driver::Driver;
use flightshuffle::events::EventLog;
use flightshuffle::job::{self, ShuffleJob, ShuffleOptions};
use flightshuffle::strategy::StrategyOptions;
use flightshuffle::Error;
use pyo3::prelude::*;
use pyo3_arrow::PyTable;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub struct JobOptions {
    pub by: Vec<String>,
    pub partitions: u32,
    pub strategy: String,
    pub partitioner: String,
    pub map_bytes: usize,
    pub speculation: Option<f64>,
    /// The input's size in bytes where Python knows it (a table), for `auto`'s M.
    pub input_bytes: Option<usize>,
    /// Parity shards per stripe ([`flightshuffle::check_parity`]).
    pub parity: u32,
}

impl JobOptions {
    fn parse(self) -> flightshuffle::Result<ShuffleOptions> {
        Ok(ShuffleOptions {
            by: self.by,
            partitions: self.partitions,
            partitioner: self.partitioner.parse()?,
            map_bytes: self.map_bytes,
            strategy: StrategyOptions {
                speculation: self.speculation,
                expected_maps: self
                    .input_bytes
                    .map(|b| b.div_ceil(self.map_bytes.max(1)).max(1)),
                parity: self.parity,
                ..StrategyOptions::named(&self.strategy)?
            },
        })
    }
}

#[pyclass(module = "flightshuffle._native")]
pub struct NativeShuffle {
    rt: Arc<crate::Rt>,
    job: ShuffleJob,
    /// The job's event log (`Cluster(event_log=...)`), open until the job ends.
    log: Option<JobLog>,
}

/// An event log open for a job run from Python (online aggregation), and the driver's log
/// before it (see `NativeCluster::job_log_begin`).
pub struct PyJobLog {
    pub log: Arc<EventLog>,
    pub before: Option<Arc<EventLog>>,
}

/// A shuffle job's event log: the driver writes to it while the job runs (the log it wrote
/// to before comes back when the job ends); the job's start, its one stage and its end are
/// written here, as a query's are.
struct JobLog {
    log: Arc<EventLog>,
    before: Option<Arc<EventLog>>,
    driver: Arc<Driver>,
    rows: AtomicU64,
    ended: AtomicBool,
    /// The strategy asked for (`auto` reports its pick in the summary).
    strategy: String,
}

impl JobLog {
    fn open(
        dir: &Path,
        driver: &Arc<Driver>,
        shuffle: &str,
        what: &str,
        strategy: &str,
    ) -> flightshuffle::Result<Self> {
        let path = dir.join(format!("shuffle-{shuffle}.jsonl"));
        let log = Arc::new(EventLog::create(&path)?);
        let before = driver.log_events(Some(log.clone()));
        log.write(
            "query_start",
            serde_json::json!({
                "job": "shuffle", "shuffle": shuffle, "sql": what,
                "workers": driver.num_workers(),
            }),
        );
        Ok(JobLog {
            log,
            before,
            driver: driver.clone(),
            rows: AtomicU64::new(0),
            ended: AtomicBool::new(false),
            strategy: strategy.to_string(),
        })
    }

    /// Write the end (once): the stage's figures when the map side completed, then whether
    /// it ended well; the driver goes back to the log it had.
    fn end(&self, summary: Option<&job::MapSummary>, shuffle: &str, error: Option<String>) {
        if self.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(s) = summary {
            self.log.write(
                "stage",
                serde_json::json!({
                    "stage": 0, "shuffle": shuffle, "exchange": "shuffle", "tasks": s.maps,
                    "rows": s.rows, "bytes": s.bytes, "start_s": 0.0, "end_s": self.log.now(),
                    "strategy": s.strategy_choice.clone().unwrap_or_else(|| self.strategy.clone()),
                }),
            );
        }
        let end = match error {
            None => serde_json::json!({
                "ok": true, "rows": self.rows.load(Ordering::SeqCst), "seconds": self.log.now()
            }),
            Some(e) => serde_json::json!({"ok": false, "error": e}),
        };
        self.log.write("query_end", end);
        self.driver.log_events(self.before.clone());
        let _ = self.log.flush();
    }
}

impl NativeShuffle {
    pub fn start(
        py: Python<'_>,
        rt: Arc<crate::Rt>,
        driver: Arc<Driver>,
        reader: Box<dyn RecordBatchReader + Send>,
        opts: JobOptions,
        event_log: Option<&str>,
    ) -> PyResult<Self> {
        let strategy = opts.strategy.clone();
        let what = format!(
            "shuffle by {:?} into {} partitions ({}, {})",
            opts.by, opts.partitions, opts.partitioner, opts.strategy
        );
        let opts = opts.parse().map_err(to_py)?;
        let schema = job::hydrated(&reader.schema());
        let input: job::Input = Box::new(reader.map(|b| b.map_err(Error::from)));
        // A range partitioner reads the whole input here, without the GIL.
        let (spec, input) = py
            .detach(|| job::prepare(&schema, input, &opts))
            .map_err(to_py)?;
        let log = event_log
            .map(|dir| {
                JobLog::open(
                    Path::new(dir),
                    &driver,
                    &spec.id.to_string(),
                    &what,
                    &strategy,
                )
            })
            .transpose()
            .map_err(to_py)?;
        match crate::wait(py, &rt, ShuffleJob::start(driver, spec, input, &opts))? {
            Ok(job) => Ok(NativeShuffle { rt, job, log }),
            Err(e) => {
                if let Some(l) = &log {
                    l.end(None, "", Some(e.to_string()));
                }
                Err(to_py(e))
            }
        }
    }

    /// The job's event log file, if it writes one.
    pub fn log_path(&self) -> Option<&Path> {
        self.log.as_ref().map(|l| l.log.path())
    }

    fn end_log(&self, py: Python<'_>, error: Option<String>) {
        let Some(l) = &self.log else { return };
        if l.ended.load(Ordering::SeqCst) {
            return;
        }
        let summary = match &error {
            None => crate::wait(py, &self.rt, self.job.mapped())
                .ok()
                .and_then(|r| r.ok()),
            Some(_) => None,
        };
        l.end(summary.as_ref(), &self.job.id.to_string(), error);
    }
}

impl Drop for NativeShuffle {
    fn drop(&mut self) {
        if let Some(l) = &self.log {
            l.end(
                None,
                "",
                Some("dropped before it was read to the end".into()),
            );
        }
    }
}

#[pymethods]
impl NativeShuffle {
    /// The next reduce partition as `(index, pyarrow.Table)`, or None when all were read.
    fn next_partition(&self, py: Python<'_>) -> PyResult<Option<(u32, Py<PyAny>)>> {
        match crate::wait(py, &self.rt, self.job.next_partition())? {
            None => {
                self.end_log(py, None);
                Ok(None)
            }
            Some(Err(e)) => {
                self.end_log(py, Some(e.to_string()));
                Err(to_py(e))
            }
            Some(Ok((p, batches))) => {
                if let Some(l) = &self.log {
                    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
                    l.rows.fetch_add(rows as u64, Ordering::SeqCst);
                }
                let table = PyTable::try_new(batches, self.job.schema.clone())?;
                Ok(Some((p, table.into_pyarrow(py)?.unbind())))
            }
        }
    }

    /// Block until the map side is complete; returns its summary as JSON.
    fn wait_mapped(&self, py: Python<'_>) -> PyResult<String> {
        match crate::wait(py, &self.rt, self.job.mapped())? {
            Ok(s) => Ok(serde_json::to_string(&s).unwrap_or_default()),
            Err(e) => Err(crate::ShuffleError::new_err(e.to_string())),
        }
    }

    #[getter]
    fn shuffle_id(&self) -> String {
        self.job.id.to_string()
    }

    /// Stop the shuffle and free its blocks on every worker.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(l) = &self.log {
            l.end(
                None,
                "",
                Some("closed before it was read to the end".into()),
            );
        }
        crate::wait(py, &self.rt, self.job.close())?.map_err(to_py)
    }
}
