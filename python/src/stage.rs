//! Stages of Python work on the cluster: a map stage runs Python map tasks (file splits or
//! partitions of an earlier stage) into a new shuffle ([`flightshuffle::job::run_stage`]); a streaming job
//! runs them in rounds with the streaming strategy and a Python reducer, handing each round's
//! partial result to Python while later rounds run.

use crate::script::PYTHON_KIND;
use crate::to_py;
use arrow::array::RecordBatch;
use arrow::compute::concat_batches;
use arrow::datatypes::SchemaRef;
use flightshuffle::block::{encode_schema, ShuffleId};
use flightshuffle::driver::{Driver, MapInput};
use flightshuffle::job;
use flightshuffle::strategy::streaming::{self, Partial, StreamingJob};
use flightshuffle::strategy::StrategyOptions;
use flightshuffle::sync::lock;
use flightshuffle::{proto, Error, Result};
use prost::Message;
use pyo3::prelude::*;
use pyo3_arrow::PyTable;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// One map task of a dataset stage: the Python task description and its input, the partition of an
/// earlier stage or a file split.
#[derive(Clone)]
pub struct DatasetTask {
    pub body: Vec<u8>,
    pub input: Option<(u64, u32)>,
    pub split: Option<proto::FileSplit>,
}

/// Output shuffles of the stages run so far: schema and partition count.
pub type Stages = Mutex<HashMap<u64, (SchemaRef, u32)>>;

fn inputs(driver: &Driver, stages: &Stages, tasks: Vec<DatasetTask>) -> Result<Vec<MapInput>> {
    let peers = driver.addresses();
    tasks
        .into_iter()
        .map(|t| {
            let partition = match t.input {
                None => None,
                Some((shuffle, partition)) => {
                    let (schema, parts) = lock(stages)
                        .get(&shuffle)
                        .cloned()
                        .ok_or(Error::UnknownShuffle(ShuffleId(shuffle)))?;
                    if partition >= parts {
                        return Err(Error::invalid(format!(
                            "stage {} has {parts} partitions, not {}",
                            ShuffleId(shuffle),
                            partition + 1
                        )));
                    }
                    Some(proto::PartitionInput {
                        shuffle_id: shuffle,
                        partition,
                        peers: peers.clone(),
                        schema_ipc: encode_schema(&schema)?.to_vec(),
                    })
                }
            };
            if partition.is_none() && t.split.is_none() {
                return Err(Error::invalid(
                    "a python map task needs an input: a stage partition or a file split",
                ));
            }
            let payload = proto::SourceInput {
                partition,
                body: t.body,
                split: t.split,
            };
            Ok(MapInput::Source(proto::TaskSource {
                kind: PYTHON_KIND.to_string(),
                payload: payload.encode_to_vec(),
            }))
        })
        .collect()
}

/// Run one map stage into a new shuffle; returns its id and the rows its maps wrote.
pub async fn run_stage(
    driver: &Arc<Driver>,
    stages: &Stages,
    schema: SchemaRef,
    partitions: u32,
    keys: Vec<String>,
    tasks: Vec<DatasetTask>,
    opts: StrategyOptions,
) -> Result<(u64, u64)> {
    let upstream: std::collections::BTreeSet<u64> = tasks
        .iter()
        .filter_map(|t| t.input.map(|(s, _)| s))
        .collect();
    let mut recoveries = 0;
    loop {
        let spec = job::stage_spec(schema.clone(), partitions, &keys);
        let replacements = driver.replacements();
        let ran = async {
            // The tasks name their peers: a lost worker's replacement must be in place first,
            // and the earlier stages they read must have every map output (a no-op when none
            // was lost). A worker lost meanwhile is recovered like one lost while mapping.
            driver
                .wait_all_live(flightshuffle::driver::REPLACE_TIMEOUT)
                .await?;
            for &s in &upstream {
                driver.repair(ShuffleId(s)).await?;
            }
            // A stage that lost a worker while mapping runs again (its inputs name the
            // replacement).
            let inputs = inputs(driver, stages, tasks.clone())?;
            job::run_stage(driver, &spec, inputs, opts).await
        };
        match ran.await {
            Ok(input) => {
                lock(stages).insert(spec.id.0, (schema, spec.partitions));
                return Ok((spec.id.0, input.rows));
            }
            Err(e)
                if recoveries < job::MAX_RECOVERIES
                    && job::worker_lost(driver, &e, replacements) =>
            {
                recoveries += 1;
                driver.note_rerun();
            }
            Err(e) => return Err(e),
        }
    }
}

/// Read every partition of a stage back to the driver, in partition order.
pub async fn read_stage(
    driver: &Arc<Driver>,
    stages: &Stages,
    shuffle: u64,
) -> Result<(SchemaRef, Vec<Vec<RecordBatch>>)> {
    let (schema, parts) = lock(stages)
        .get(&shuffle)
        .cloned()
        .ok_or(Error::UnknownShuffle(ShuffleId(shuffle)))?;
    Ok((
        schema,
        job::read_all(driver, ShuffleId(shuffle), parts).await?,
    ))
}

pub async fn drop_stage(driver: &Arc<Driver>, stages: &Stages, shuffle: u64) -> Result<()> {
    if lock(stages).remove(&shuffle).is_some() {
        driver.drop_shuffle(ShuffleId(shuffle)).await?;
    }
    Ok(())
}

/// A running streaming job; `next()` yields each round's partial result.
#[pyclass(module = "flightshuffle._native")]
pub struct NativeStream {
    rt: Arc<crate::Rt>,
    driver: Arc<Driver>,
    /// The shuffles dropped when the job is stopped early (the job drops them when it ends).
    ids: Vec<ShuffleId>,
    rx: Mutex<mpsc::Receiver<Result<Partial>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[allow(clippy::too_many_arguments)]
pub fn start_stream(
    rt: &Arc<crate::Rt>,
    driver: &Arc<Driver>,
    stages: &Stages,
    schema: SchemaRef,
    partitions: u32,
    keys: Vec<String>,
    tasks: Vec<DatasetTask>,
    weights: Vec<u64>,
    rounds: usize,
    reducer_payload: Vec<u8>,
) -> Result<NativeStream> {
    let job = StreamingJob {
        spec: job::stage_spec(schema, partitions, &keys),
        inputs: inputs(driver, stages, tasks)?,
        weights,
        unit_sizes: Vec::new(),
        rounds,
        by_completion: false,
        reducer: PYTHON_KIND.to_string(),
        payload: reducer_payload,
    };
    let (tx, rx) = mpsc::channel(2);
    let id = job.spec.id;
    let d = driver.clone();
    let task = rt.spawn(async move {
        streaming::run(&d, job, StrategyOptions::default(), tx).await;
    });
    Ok(NativeStream::new(rt, driver, vec![id], rx, task))
}

impl NativeStream {
    /// A running job `task` sending its partial results to `rx`; `ids` are its shuffles.
    pub fn new(
        rt: &Arc<crate::Rt>,
        driver: &Arc<Driver>,
        ids: Vec<ShuffleId>,
        rx: mpsc::Receiver<Result<Partial>>,
        task: tokio::task::JoinHandle<()>,
    ) -> Self {
        NativeStream {
            rt: rt.clone(),
            driver: driver.clone(),
            ids,
            rx: Mutex::new(rx),
            task: Mutex::new(Some(task)),
        }
    }
}

#[pymethods]
impl NativeStream {
    /// The next partial result as `(info dict, pyarrow.Table)`, or None after the final one.
    fn next_partial(&self, py: Python<'_>) -> PyResult<Option<(Py<PyAny>, Py<PyAny>)>> {
        let next = crate::wait(
            py,
            &self.rt,
            std::future::poll_fn(|cx| lock(&self.rx).poll_recv(cx)),
        )?;
        let partial = match next {
            None => return Ok(None),
            Some(Err(e)) => return Err(to_py(e)),
            Some(Ok(p)) => p,
        };
        let batches: Vec<RecordBatch> = partial.partitions.into_iter().flatten().collect();
        let table = concat_batches(&partial.schema, &batches).map_err(|e| to_py(e.into()))?;
        let info = pyo3::types::PyDict::new(py);
        info.set_item("round", partial.round)?;
        info.set_item("rounds", partial.rounds)?;
        info.set_item("progress", partial.progress)?;
        info.set_item("maps_done", partial.maps_done)?;
        info.set_item("maps_total", partial.maps_total)?;
        info.set_item("units_done", partial.units_done)?;
        info.set_item("weight_squares", partial.weight_squares)?;
        info.set_item("final", partial.is_final)?;
        info.set_item("rows_folded", partial.rows_folded)?;
        info.set_item("elapsed", partial.elapsed)?;
        let table = PyTable::try_new(vec![table], partial.schema)?.into_pyarrow(py)?;
        Ok(Some((info.into_any().unbind(), table.unbind())))
    }

    /// Stop the job; its shuffle and reduce states are dropped on the workers before this
    /// returns (bounded wait), so closing the cluster right after finds nothing running.
    fn close(&self, py: Python<'_>) {
        if let Some(drop) = self.stop() {
            py.detach(|| {
                self.rt.block_on(async {
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), drop).await;
                })
            });
        }
    }
}

impl NativeStream {
    /// Abort a running job; returns the task dropping its shuffle, if one was started.
    fn stop(&self) -> Option<tokio::task::JoinHandle<()>> {
        lock(&self.rx).close();
        let t = lock(&self.task).take()?;
        if t.is_finished() {
            return None;
        }
        t.abort();
        let (driver, ids) = (self.driver.clone(), self.ids.clone());
        Some(self.rt.spawn(async move {
            let drops = ids.iter().map(|id| driver.drop_shuffle(*id));
            let _ = futures::future::join_all(drops).await;
        }))
    }
}

impl Drop for NativeStream {
    fn drop(&mut self) {
        self.stop();
    }
}
