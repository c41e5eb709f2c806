//! Python work on workers: the `"python"` task source (a map task whose batches come from a
//! Python function, fed with a Parquet split or with one partition of an earlier shuffle, both
//! read here in Rust) and the
//! `"python"` reducer (a Python fold over a partition's new blocks, for the streaming
//! strategy). Both call `flightshuffle._exec` in the worker process; Arrow data crosses the
//! boundary through the PyCapsule interface, without copies.

use arrow::array::{RecordBatch, RecordBatchReader};
use arrow::datatypes::SchemaRef;
use flightshuffle::block::decode_schema;
use flightshuffle::source::{
    BatchSource, BatchStream, ReduceState, Reducer, ShuffleReader, TaskContext,
};
use flightshuffle::transport::client::decode;
use flightshuffle::{proto, Error, Result, ShuffleId};
use futures::{StreamExt, TryStreamExt};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3_arrow::input::AnyRecordBatch;
use pyo3_arrow::{PySchema, PyTable};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Task source and reducer kind of Python work.
pub const PYTHON_KIND: &str = "python";
const EXEC_MODULE: &str = "flightshuffle._exec";

/// A Python exception as an exchange error, with its traceback.
fn py_failed(what: &str, py: Python<'_>, e: PyErr) -> Error {
    let tb = e
        .traceback(py)
        .and_then(|t| t.format().ok())
        .unwrap_or_default();
    Error::Cluster(format!("{what} failed: {e}\n{tb}"))
}

/// Read an Arrow object returned by Python (anything with `__arrow_c_stream__`).
fn arrow_from_py(obj: &Bound<'_, PyAny>) -> PyResult<(SchemaRef, Vec<RecordBatch>)> {
    let reader = obj.extract::<AnyRecordBatch>()?.into_reader()?;
    let schema = reader.schema();
    let batches = reader
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    // Arrays imported through the C interface are not validated by arrow; these rows go into
    // blocks that readers on this worker decode without validation, so check them here.
    for b in &batches {
        for c in b.columns() {
            c.to_data().validate_full().map_err(|e| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "a Python task returned invalid Arrow data: {e}"
                ))
            })?;
        }
    }
    Ok((schema, batches))
}

/// Read every block of one partition of an earlier shuffle from all its workers at once
/// (blocks this worker holds from its own store), through the worker's pooled reader.
async fn read_input(
    reader: Arc<dyn ShuffleReader>,
    input: proto::PartitionInput,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let schema = decode_schema(&input.schema_ipc)?;
    let batches = reader
        .read_partition(&input.peers, ShuffleId(input.shuffle_id), input.partition)
        .try_collect::<Vec<_>>()
        .await?;
    Ok((schema, batches))
}

/// Read a Parquet split: only the wanted columns, and with the page index only the pages that
/// hold rows `[start, start + rows)` of the row group are decoded.
fn read_split(split: &proto::FileSplit) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    use parquet::arrow::arrow_reader::{
        ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection, RowSelector,
    };
    use parquet::arrow::ProjectionMask;
    use parquet::file::metadata::PageIndexPolicy;
    let failed = |e: parquet::errors::ParquetError| {
        Error::Cluster(format!("cannot read Parquet file {}: {e}", split.path))
    };
    let file = std::fs::File::open(&split.path).map_err(|e| Error::io(&split.path, e))?;
    // The offset index (where each page starts) lets the selection skip whole pages; files
    // without one are still read, decoding the skipped rows.
    let options = ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
    let builder =
        ParquetRecordBatchReaderBuilder::try_new_with_options(file, options).map_err(failed)?;
    let meta = builder.metadata().clone();
    let rg = split.row_group as usize;
    if rg >= meta.num_row_groups() {
        return Err(Error::invalid(format!(
            "{} has {} row groups, not {}",
            split.path,
            meta.num_row_groups(),
            rg + 1
        )));
    }
    let group_rows = meta.row_group(rg).num_rows().max(0) as u64;
    let end = split.start.saturating_add(split.rows);
    if end > group_rows {
        return Err(Error::invalid(format!(
            "rows {}..{end} are outside row group {rg} of {} ({group_rows} rows)",
            split.start, split.path
        )));
    }
    let mask = if split.columns.is_empty() {
        ProjectionMask::all()
    } else {
        let fields = builder.schema().fields();
        let roots = split
            .columns
            .iter()
            .map(|c| {
                fields
                    .iter()
                    .position(|f| f.name() == c)
                    .ok_or_else(|| Error::invalid(format!("{} has no column {c:?}", split.path)))
            })
            .collect::<Result<Vec<_>>>()?;
        ProjectionMask::roots(builder.parquet_schema(), roots)
    };
    let mut builder = builder
        .with_row_groups(vec![rg])
        .with_projection(mask)
        .with_batch_size(64 * 1024);
    if split.rows < group_rows {
        builder = builder.with_row_selection(RowSelection::from(vec![
            RowSelector::skip(split.start as usize),
            RowSelector::select(split.rows as usize),
        ]));
    }
    let reader = builder.build().map_err(failed)?;
    let schema = reader.schema();
    let batches = reader.collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((schema, batches))
}

/// Logs (debug) where a python map task spent its time when it ends.
struct Timing {
    start: std::time::Instant,
    read: std::time::Duration,
}

impl Drop for Timing {
    fn drop(&mut self) {
        tracing::debug!(
            read_ms = self.read.as_millis() as u64,
            total_ms = self.start.elapsed().as_millis() as u64,
            "python map task"
        );
    }
}

/// Given to a Python map body: calling it says whether the task was cancelled (checked
/// between the body's operators).
#[pyclass(module = "flightshuffle._native", frozen)]
struct Cancelled(Arc<AtomicBool>);

#[pymethods]
impl Cancelled {
    fn __call__(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Map tasks computed by `flightshuffle._exec.run_map(body, input, schema)`.
pub struct PythonSource;

/// Bytes per value a Python task over a file split is granted: the split decoded, and as
/// much again for the frame Polars or DuckDB makes of it and the batches it returns.
const SPLIT_BYTES_PER_VALUE: u64 = 24;

impl BatchSource for PythonSource {
    /// A file split is read whole before the call: rows × columns × a few bytes. A partition
    /// input's size is not known here (0: the map's own grant only).
    fn memory_hint(&self, payload: &[u8]) -> u64 {
        let Ok(task) = decode::<proto::SourceInput>(payload) else {
            return 0;
        };
        task.split.map_or(0, |s| {
            let columns = if s.columns.is_empty() {
                16
            } else {
                s.columns.len() as u64
            };
            s.rows
                .saturating_mul(columns)
                .saturating_mul(SPLIT_BYTES_PER_VALUE)
        })
    }

    fn open(&self, ctx: &TaskContext, payload: &[u8], schema: SchemaRef) -> Result<BatchStream> {
        let task: proto::SourceInput = decode(payload)?;
        let reader = ctx.reader.clone();
        let stop = ctx.stop.clone();
        let fut = async move {
            let input = match task.partition {
                Some(p) => Some(read_input(reader, p).await?),
                None => None,
            };
            let (body, split) = (task.body, task.split);
            // The body keeps the task's grant until it returns, even if the task is aborted
            // meanwhile (its memory is in use until then); it stops at its next operator.
            let held = stop.hold();
            let cancelled = Cancelled(stop.flag());
            let out = tokio::task::spawn_blocking(move || {
                let _held = held;
                let start = std::time::Instant::now();
                let (in_schema, in_batches) = match (input, split) {
                    (Some(input), _) => input,
                    (None, Some(split)) => read_split(&split)?,
                    (None, None) => return Err(Error::invalid("a python map task needs an input")),
                };
                let read = start.elapsed();
                let _timing = Timing { start, read };
                Python::attach(|py| {
                    let call = || -> PyResult<Vec<RecordBatch>> {
                        let input = PyTable::try_new(in_batches, in_schema)?.into_pyarrow(py)?;
                        let expected = PySchema::new(schema.clone()).into_pyarrow(py)?;
                        let module = py.import(EXEC_MODULE)?;
                        let result = module.call_method1(
                            "run_map",
                            (PyBytes::new(py, &body), input, expected, cancelled),
                        )?;
                        Ok(arrow_from_py(&result)?.1)
                    };
                    call().map_err(|e| py_failed("python map task", py, e))
                })
            })
            .await
            .map_err(|e| Error::Cluster(format!("python map task panicked: {e}")))??;
            Ok::<_, Error>(futures::stream::iter(out.into_iter().map(Ok)))
        };
        Ok(futures::stream::once(fut).try_flatten().boxed())
    }
}

/// Folds computed by `flightshuffle._exec.fold(body, state, table)` and
/// `flightshuffle._exec.emit(body, state)`; the state is a Python object kept on the worker.
pub struct PythonReducer;

struct PyState(Py<PyAny>);

impl Reducer for PythonReducer {
    fn fold(
        &self,
        payload: &[u8],
        state: Option<ReduceState>,
        batches: Vec<RecordBatch>,
        schema: SchemaRef,
    ) -> Result<ReduceState> {
        let state = match state {
            Some(s) => Some(
                s.downcast::<PyState>()
                    .map_err(|_| Error::invalid("python reducer given a foreign state"))?,
            ),
            None => None,
        };
        Python::attach(|py| {
            let call = || -> PyResult<Py<PyAny>> {
                let table = PyTable::try_new(batches, schema)?.into_pyarrow(py)?;
                let state = match state {
                    Some(s) => s.0.into_bound(py),
                    None => py.None().into_bound(py),
                };
                let module = py.import(EXEC_MODULE)?;
                let new = module.call_method1("fold", (PyBytes::new(py, payload), state, table))?;
                Ok(new.unbind())
            };
            call()
                .map(|s| Box::new(PyState(s)) as ReduceState)
                .map_err(|e| py_failed("python fold", py, e))
        })
    }

    fn emit(&self, payload: &[u8], state: &ReduceState) -> Result<(SchemaRef, Vec<RecordBatch>)> {
        let state = state
            .downcast_ref::<PyState>()
            .ok_or_else(|| Error::invalid("python reducer given a foreign state"))?;
        Python::attach(|py| {
            let call = || -> PyResult<(SchemaRef, Vec<RecordBatch>)> {
                let module = py.import(EXEC_MODULE)?;
                let out = module.call_method1(
                    "emit",
                    (PyBytes::new(py, payload), state.0.bind(py).clone()),
                )?;
                arrow_from_py(&out)
            };
            call().map_err(|e| py_failed("python emit", py, e))
        })
    }
}
