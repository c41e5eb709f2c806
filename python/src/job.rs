//! One shuffle started from Python: the input stream is cut into map tasks pushed to the
//! workers, the pull strategy runs, and reduce partitions are read back in order (one read
//! ahead) and handed to Python as pyarrow Tables.

use crate::to_py;
use arrow::array::{ArrayRef, RecordBatch, RecordBatchReader};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use exchange::block::ShuffleId;
use exchange::driver::{Driver, MapInput, ShuffleSpec};
use exchange::strategy::{pull, Strategy, StrategyOptions};
use exchange::{partitioner, proto, Error, Result};
use futures::TryStreamExt;
use pyo3::prelude::*;
use pyo3_arrow::PyTable;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};
use tokio_stream_shim::ReceiverStream;

mod tokio_stream_shim {
    //! A minimal receiver stream (avoids a dependency for one adapter).
    use futures::Stream;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    pub struct ReceiverStream<T>(pub tokio::sync::mpsc::Receiver<T>);
    impl<T> Stream for ReceiverStream<T> {
        type Item = T;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
            self.0.poll_recv(cx)
        }
    }
}

pub struct JobOptions {
    pub by: Vec<String>,
    pub partitions: u32,
    pub strategy: String,
    pub partitioner: String,
    pub map_bytes: usize,
}

/// Rows sampled for range boundaries.
const RANGE_SAMPLE_ROWS: usize = 100_000;

type Partition = Result<(u32, Vec<RecordBatch>)>;

#[pyclass(module = "flightshuffle._native")]
pub struct NativeShuffle {
    rt: Arc<crate::Rt>,
    driver: Arc<Driver>,
    id: ShuffleId,
    schema: SchemaRef,
    partitions: Mutex<mpsc::Receiver<Partition>>,
    mapped: watch::Receiver<Option<std::result::Result<String, String>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Dictionary columns travel as their value type (Flight hydrates them anyway).
fn hydrated(schema: &Schema) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::Dictionary(_, v) => f.as_ref().clone().with_data_type(v.as_ref().clone()),
            _ => f.as_ref().clone(),
        })
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

fn conform(batch: RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    if batch.schema() == *schema {
        return Ok(batch);
    }
    let cols = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                cast(c, f.data_type()).map_err(Error::from)
            }
        })
        .collect::<Result<Vec<ArrayRef>>>()?;
    Ok(RecordBatch::try_new(schema.clone(), cols)?)
}

/// Every `step`-th row of the input, for range boundaries.
fn sample(batches: &[RecordBatch]) -> Result<Vec<RecordBatch>> {
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let step = rows.div_ceil(RANGE_SAMPLE_ROWS).max(1);
    batches
        .iter()
        .map(|b| {
            let idx: arrow::array::UInt32Array = (0..b.num_rows() as u32).step_by(step).collect();
            Ok(arrow::compute::take_record_batch(b, &idx)?)
        })
        .collect()
}

impl NativeShuffle {
    pub fn start(
        py: Python<'_>,
        rt: Arc<crate::Rt>,
        driver: Arc<Driver>,
        reader: Box<dyn RecordBatchReader + Send>,
        opts: JobOptions,
    ) -> PyResult<Self> {
        let strategy: Strategy = opts.strategy.parse().map_err(to_py)?;
        if opts.partitions == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "partitions must be at least 1",
            ));
        }
        let schema = hydrated(&reader.schema());
        let id = ShuffleId::random();
        let mut buffered: Option<Vec<RecordBatch>> = None;
        let mut reader = Some(reader);
        let partitioner = match opts.partitioner.as_str() {
            "hash" => partitioner::hash(&opts.by.iter().map(|s| s.as_str()).collect::<Vec<_>>()),
            "round_robin" | "round-robin" => partitioner::round_robin(),
            "range" => {
                // Range boundaries need a sample of the whole input: read it first.
                let source = reader.take();
                let all = py
                    .detach(|| {
                        source
                            .into_iter()
                            .flatten()
                            .map(|b| conform(b?, &schema))
                            .collect::<Result<Vec<_>>>()
                    })
                    .map_err(to_py)?;
                if all.iter().all(|b| b.num_rows() == 0) {
                    // No rows: every partition is empty whatever the boundaries.
                    buffered = Some(all);
                    partitioner::round_robin()
                } else {
                    let spec = partitioner::range_boundaries(
                        &sample(&all).map_err(to_py)?,
                        &schema,
                        &opts.by,
                        &[],
                        opts.partitions,
                    )
                    .map_err(to_py)?;
                    buffered = Some(all);
                    proto::Partitioner {
                        kind: Some(proto::partitioner::Kind::Range(spec)),
                    }
                }
            }
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown partitioner {other:?}: expected hash, range or round_robin"
                )))
            }
        };
        let spec = ShuffleSpec {
            id,
            schema: schema.clone(),
            partitions: opts.partitions,
            partitioner,
            checksum_inputs: true,
        };
        let input: Box<dyn Iterator<Item = Result<RecordBatch>> + Send> = match buffered {
            Some(all) => Box::new(all.into_iter().map(Ok)),
            None => {
                let schema = schema.clone();
                Box::new(
                    reader
                        .into_iter()
                        .flatten()
                        .map(move |b| conform(b?, &schema)),
                )
            }
        };
        py.detach(|| rt.block_on(driver.create_shuffle(&spec)))
            .map_err(to_py)?;
        let (part_tx, part_rx) = mpsc::channel::<Partition>(1);
        let (mapped_tx, mapped_rx) = watch::channel(None);
        let task = rt.spawn(run(
            driver.clone(),
            spec,
            strategy,
            input,
            opts.map_bytes.max(1),
            part_tx,
            mapped_tx,
        ));
        Ok(NativeShuffle {
            rt,
            driver,
            id,
            schema,
            partitions: Mutex::new(part_rx),
            mapped: mapped_rx,
            task: Mutex::new(Some(task)),
        })
    }
}

/// Cut the input into map tasks of about `map_bytes` each, in one blocking reader thread.
fn split_input(
    input: Box<dyn Iterator<Item = Result<RecordBatch>> + Send>,
    map_bytes: usize,
) -> ReceiverStream<MapInput> {
    let (maps_tx, maps_rx) = mpsc::channel::<MapInput>(1);
    tokio::task::spawn_blocking(move || {
        let mut current: Option<mpsc::Sender<Result<RecordBatch>>> = None;
        let mut bytes = 0usize;
        for batch in input {
            let size = batch
                .as_ref()
                .map(|b| b.get_array_memory_size())
                .unwrap_or(0);
            if current.is_none() || bytes >= map_bytes {
                let (tx, rx) = mpsc::channel(4);
                if maps_tx
                    .blocking_send(MapInput::Stream(Box::pin(ReceiverStream(rx))))
                    .is_err()
                {
                    return; // the shuffle failed or was dropped
                }
                current = Some(tx);
                bytes = 0;
            }
            bytes += size;
            let failed = batch.is_err();
            if let Some(tx) = &current {
                if tx.blocking_send(batch).is_err() {
                    return;
                }
            }
            if failed {
                return;
            }
        }
    });
    ReceiverStream(maps_rx)
}

async fn run(
    driver: Arc<Driver>,
    spec: ShuffleSpec,
    strategy: Strategy,
    input: Box<dyn Iterator<Item = Result<RecordBatch>> + Send>,
    map_bytes: usize,
    out: mpsc::Sender<Partition>,
    mapped_tx: watch::Sender<Option<std::result::Result<String, String>>>,
) {
    let Strategy::Pull = strategy;
    let maps = split_input(input, map_bytes);
    let mapped = match pull::map_side(&driver, &spec, maps, StrategyOptions::default()).await {
        Ok(m) => m,
        Err(e) => {
            let _ = mapped_tx.send(Some(Err(e.to_string())));
            let _ = out.send(Err(e)).await;
            return;
        }
    };
    let summary = serde_json::json!({
        "maps": mapped.maps.len(),
        "blocks": mapped.maps.iter().map(|m| m.blocks.len()).sum::<usize>(),
        "rows": mapped.input.rows,
        "checksum": format!("{:#018x}", mapped.input.sum),
        "bytes": mapped.input_bytes,
    });
    let _ = mapped_tx.send(Some(Ok(summary.to_string())));
    for p in 0..spec.partitions {
        let read = async {
            let stream = driver.read_partition(spec.id, p, true).await?;
            stream.try_collect::<Vec<_>>().await
        };
        let item = driver.watch(read).await.map(|b| (p, b));
        let failed = item.is_err();
        if out.send(item).await.is_err() || failed {
            return;
        }
    }
}

#[pymethods]
impl NativeShuffle {
    /// The next reduce partition as `(index, pyarrow.Table)`, or None when all were read.
    fn next_partition(&self, py: Python<'_>) -> PyResult<Option<(u32, Py<PyAny>)>> {
        let next = py.detach(|| {
            let mut rx = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
            rx.blocking_recv()
        });
        match next {
            None => Ok(None),
            Some(Err(e)) => Err(to_py(e)),
            Some(Ok((p, batches))) => {
                let table = PyTable::try_new(batches, self.schema.clone())?;
                Ok(Some((p, table.into_pyarrow(py)?.unbind())))
            }
        }
    }

    /// Block until the map side is complete; returns its summary as JSON.
    fn wait_mapped(&self, py: Python<'_>) -> PyResult<String> {
        let mut rx = self.mapped.clone();
        let got = py.detach(|| {
            self.rt.block_on(async {
                rx.wait_for(|v| v.is_some())
                    .await
                    .map(|v| v.clone())
                    .ok()
                    .flatten()
            })
        });
        match got {
            Some(Ok(s)) => Ok(s),
            Some(Err(e)) => Err(crate::ShuffleError::new_err(e)),
            None => Err(crate::ShuffleError::new_err(
                "the shuffle stopped before its map side finished",
            )),
        }
    }

    #[getter]
    fn shuffle_id(&self) -> String {
        self.id.to_string()
    }

    /// Stop the shuffle and free its blocks on every worker.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(t) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
            let driver = self.driver.clone();
            let id = self.id;
            py.detach(|| self.rt.block_on(driver.drop_shuffle(id)))
                .or_else(|e| match e {
                    Error::Remote {
                        code: exchange::transport_code::Code::NotFound,
                        ..
                    } => Ok(()),
                    Error::WorkerLost { .. } => Ok(()),
                    other => Err(other),
                })
                .map_err(to_py)?;
        }
        Ok(())
    }
}

impl Drop for NativeShuffle {
    fn drop(&mut self) {
        if let Some(t) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
            let driver = self.driver.clone();
            let id = self.id;
            self.rt.spawn(async move {
                let _ = driver.drop_shuffle(id).await;
            });
        }
    }
}
