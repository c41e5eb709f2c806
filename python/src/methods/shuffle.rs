//! A shuffle of Arrow data from Python (anything exporting the Arrow PyCapsule stream).

use crate::cluster::NativeCluster;
use crate::job;
use pyo3::prelude::*;
use pyo3_arrow::input::AnyRecordBatch;

#[pymethods]
impl NativeCluster {
    #[pyo3(signature = (data, by, partitions, strategy, partitioner, map_bytes, input_bytes=None, parity=None))]
    #[allow(clippy::too_many_arguments)]
    fn shuffle(
        &self,
        py: Python<'_>,
        data: AnyRecordBatch,
        by: Vec<String>,
        partitions: u32,
        strategy: Option<String>,
        partitioner: String,
        map_bytes: usize,
        input_bytes: Option<usize>,
        parity: Option<u32>,
    ) -> PyResult<job::NativeShuffle> {
        let strategy = strategy.unwrap_or_else(|| self.strategy.strategy.to_string());
        let driver = self.driver()?;
        let parity = parity.unwrap_or(self.strategy.parity);
        flightshuffle::check_parity(driver.num_workers(), parity)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        let reader = data.into_reader()?;
        let opts = job::JobOptions {
            by,
            partitions,
            strategy,
            partitioner,
            map_bytes,
            speculation: self.strategy.speculation,
            input_bytes,
            parity,
        };
        let shuffle = job::NativeShuffle::start(
            py,
            self.rt.clone(),
            driver,
            reader,
            opts,
            self.event_log.as_deref(),
        )?;
        if let Some(p) = shuffle.log_path() {
            *self.last_job_log.lock().unwrap_or_else(|p| p.into_inner()) = Some(p.to_path_buf());
        }
        Ok(shuffle)
    }
}
