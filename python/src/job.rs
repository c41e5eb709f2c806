//! One shuffle started from Python: a thin wrapper over [`flightshuffle::job::ShuffleJob`] that
//! converts the input to a batch iterator and hands each partition to Python as a
//! pyarrow Table.

use crate::to_py;
use arrow::array::RecordBatchReader;
use flightshuffle::driver::Driver;
use flightshuffle::job::{self, ShuffleJob, ShuffleOptions};
use flightshuffle::strategy::StrategyOptions;
use flightshuffle::Error;
use pyo3::prelude::*;
use pyo3_arrow::PyTable;
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
}

impl NativeShuffle {
    pub fn start(
        py: Python<'_>,
        rt: Arc<crate::Rt>,
        driver: Arc<Driver>,
        reader: Box<dyn RecordBatchReader + Send>,
        opts: JobOptions,
    ) -> PyResult<Self> {
        let opts = opts.parse().map_err(to_py)?;
        let schema = job::hydrated(&reader.schema());
        let input: job::Input = Box::new(reader.map(|b| b.map_err(Error::from)));
        // A range partitioner reads the whole input here, without the GIL.
        let (spec, input) = py
            .detach(|| job::prepare(&schema, input, &opts))
            .map_err(to_py)?;
        let job =
            crate::wait(py, &rt, ShuffleJob::start(driver, spec, input, &opts))?.map_err(to_py)?;
        Ok(NativeShuffle { rt, job })
    }
}

#[pymethods]
impl NativeShuffle {
    /// The next reduce partition as `(index, pyarrow.Table)`, or None when all were read.
    fn next_partition(&self, py: Python<'_>) -> PyResult<Option<(u32, Py<PyAny>)>> {
        match crate::wait(py, &self.rt, self.job.next_partition())? {
            None => Ok(None),
            Some(Err(e)) => Err(to_py(e)),
            Some(Ok((p, batches))) => {
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
        crate::wait(py, &self.rt, self.job.close())?.map_err(to_py)
    }
}
