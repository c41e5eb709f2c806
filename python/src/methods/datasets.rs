//! Datasets: Python map stages into shuffles, reading and freeing their partitions, and
//! streaming jobs that fold each round's blocks with a Python reducer.

use crate::cluster::NativeCluster;
use crate::{stage, to_py, wait};
use pyo3::prelude::*;

#[pymethods]
impl NativeCluster {
    /// Run a map stage of Python tasks into a new shuffle of `partitions` partitions (hash on
    /// `keys`, round-robin when empty). A task is `(body, input_stage | None, input_partition,
    /// split | None)` with a split `(path, row_group, start, rows, columns)`.
    /// Returns `(stage id, rows written)`.
    fn run_stage(
        &self,
        py: Python<'_>,
        schema: pyo3_arrow::PySchema,
        partitions: u32,
        keys: Vec<String>,
        tasks: Vec<PyTask>,
    ) -> PyResult<(u64, u64)> {
        let driver = self.driver()?;
        let tasks = stage_tasks(tasks);
        let run = stage::run_stage(
            &driver,
            &self.stages,
            schema.into_inner(),
            partitions,
            keys,
            tasks,
            self.strategy,
        );
        wait(py, &self.rt, run)?.map_err(to_py)
    }

    /// Every partition of a stage as a list of pyarrow Tables, in partition order.
    fn read_stage(&self, py: Python<'_>, stage_id: u64) -> PyResult<Vec<Py<PyAny>>> {
        let driver = self.driver()?;
        let read = stage::read_stage(&driver, &self.stages, stage_id);
        let (schema, parts) = wait(py, &self.rt, read)?.map_err(to_py)?;
        parts
            .into_iter()
            .map(|b| {
                Ok(pyo3_arrow::PyTable::try_new(b, schema.clone())?
                    .into_pyarrow(py)?
                    .unbind())
            })
            .collect()
    }

    /// Free a stage's blocks on every worker.
    fn drop_stage(&self, py: Python<'_>, stage_id: u64) -> PyResult<()> {
        let driver = self.driver()?;
        wait(
            py,
            &self.rt,
            stage::drop_stage(&driver, &self.stages, stage_id),
        )?
        .map_err(to_py)
    }

    /// Start a streaming job: the tasks run in `rounds` rounds (in the given order), each
    /// round's blocks are folded by the Python reducer described by `reducer`.
    #[pyo3(signature = (schema, partitions, keys, tasks, weights, rounds, reducer))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        schema: pyo3_arrow::PySchema,
        partitions: u32,
        keys: Vec<String>,
        tasks: Vec<PyTask>,
        weights: Vec<u64>,
        rounds: usize,
        reducer: Vec<u8>,
    ) -> PyResult<stage::NativeStream> {
        let driver = self.driver()?;
        stage::start_stream(
            &self.rt,
            &driver,
            &self.stages,
            schema.into_inner(),
            partitions,
            keys,
            stage_tasks(tasks),
            weights,
            rounds,
            reducer,
        )
        .map_err(to_py)
    }
}

/// A task from Python: `(body, input stage | None, input partition, split | None)`, a split
/// being `(path, row group, first row, rows, columns)`.
type PyTask = (Vec<u8>, Option<u64>, u32, Option<PySplit>);
type PySplit = (String, u32, u64, u64, Vec<String>);

fn stage_tasks(tasks: Vec<PyTask>) -> Vec<stage::DatasetTask> {
    tasks
        .into_iter()
        .map(|(body, shuffle, partition, split)| stage::DatasetTask {
            body,
            input: shuffle.map(|s| (s, partition)),
            split: split.map(|(path, row_group, start, rows, columns)| {
                flightshuffle::proto::FileSplit {
                    path,
                    row_group,
                    start,
                    rows,
                    columns,
                }
            }),
        })
        .collect()
}
