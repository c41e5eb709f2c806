//! What map tasks read and reducers fold, as the data plane sees them: the [`BatchSource`]
//! trait through which engines feed map tasks (a generator, a query stage, a Python
//! function), the [`Reducer`] trait through which they fold blocks into a running state
//! (streaming strategy), the [`ShuffleReader`] through which a task reads earlier shuffles,
//! the [`TaskContext`] a task runs with, and the [`SourceRegistry`] a worker looks kinds up
//! in. Shared by the worker, the transport and the map writers, so it sits below them all.

use crate::admission::Grant;
use crate::block::{ShuffleId, Slice};
use crate::checksum::Checksum;
use crate::error::{Error, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use futures::Stream;
use std::any::Any;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// A stream of record batches, as map tasks read them and readers return them.
pub type BatchStream = Pin<Box<dyn Stream<Item = Result<RecordBatch>> + Send>>;

/// Reads committed shuffle output: one reduce partition from every worker in `peers` (blocks
/// in commit order, following new commits until the shuffle is sealed), or the output of one
/// map. Implemented by [`crate::transport::peers::PeerReader`] for workers and the driver.
pub trait ShuffleReader: Send + Sync {
    /// Reduce partition `partition` of `shuffle`, whole, from every worker in `peers`.
    fn read_partition(&self, peers: &[String], shuffle: ShuffleId, partition: u32) -> BatchStream {
        self.read_partition_slice(peers, shuffle, partition, Slice::WHOLE)
    }
    /// One slice of a reduce partition's blocks (a skew split, see [`Slice`]).
    fn read_partition_slice(
        &self,
        peers: &[String],
        shuffle: ShuffleId,
        partition: u32,
        slice: Slice,
    ) -> BatchStream;
    /// The whole committed output of map `map` of `shuffle`.
    fn read_map_output(&self, peers: &[String], shuffle: ShuffleId, map: u32) -> BatchStream;
}

/// What a map task gets from the worker that runs it: which attempt it is, and the worker's
/// pooled reader (cluster token, timeouts, its own store for local blocks).
#[derive(Clone)]
pub struct TaskContext {
    /// The shuffle the task writes.
    pub shuffle: ShuffleId,
    /// The map task.
    pub map: u32,
    /// The attempt of the map task this run is.
    pub attempt: u32,
    /// The worker's pooled reader, for tasks that read earlier shuffles.
    pub reader: Arc<dyn ShuffleReader>,
    /// The worker's memory budget in bytes (a source's own pools come out of it).
    pub memory_budget: u64,
    /// Whether the task was cancelled, and its memory grant for work it runs on threads of
    /// its own.
    pub stop: TaskStop,
}

/// How a map task's source learns that the task was cancelled, and how work the source runs
/// outside the task's future (a blocking thread running a Python body) keeps the task's
/// memory grant until that work really stops: aborting the task drops its future and the
/// grant it holds, but not a thread already running.
#[derive(Clone, Default)]
pub struct TaskStop {
    cancelled: Arc<AtomicBool>,
    grant: Arc<Mutex<Weak<Grant>>>,
}

impl TaskStop {
    /// Mark the task cancelled.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    /// Whether the task was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// The flag itself, for work that checks it between steps (a Python body between its
    /// operators).
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.cancelled.clone()
    }

    /// Record the task's grant (the task keeps the only owning reference of its own).
    pub fn granted(&self, grant: &Arc<Grant>) {
        *self.grant.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(grant);
    }

    /// A share of the task's grant, held by whoever keeps it: the grant is returned only when
    /// the task and every holder have let go. None once the task has ended.
    pub fn hold(&self) -> Option<Arc<Grant>> {
        self.grant
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .upgrade()
    }
}

/// Something a worker can turn into the batches of a map task: a generator, a query stage,
/// a Python callable. `payload` is the source-specific description the driver sent.
pub trait BatchSource: Send + Sync {
    /// Open the batches of a map task described by `payload`, as rows of `schema`.
    fn open(&self, ctx: &TaskContext, payload: &[u8], schema: SchemaRef) -> Result<BatchStream>;
    /// The shuffle was dropped: forget anything cached for tasks writing it.
    fn shuffle_dropped(&self, _shuffle: ShuffleId) {}
    /// The memory a task of `payload` is expected to hold at once beyond the map's own
    /// buffers (a source that materialises its input, say), for its admission grant.
    fn memory_hint(&self, _payload: &[u8]) -> u64 {
        0
    }
    /// The most bytes the source's operators held at once, and of those the most held by
    /// operators that cannot spill (a query engine's memory pool), since the worker started.
    fn memory_peaks(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// A reducer's running state for one partition, opaque to the data plane.
pub type ReduceState = Box<dyn Any + Send>;

/// Something a worker can fold blocks into, round after round (streaming strategy): a
/// running aggregate, a Python reduce function. `payload` is the reducer-specific description
/// the driver sent with every fold. Both calls may block (they run on a blocking thread).
pub trait Reducer: Send + Sync {
    /// Fold `batches` (the new blocks of one partition) into `state` (None on the first fold).
    fn fold(
        &self,
        payload: &[u8],
        state: Option<ReduceState>,
        batches: Vec<RecordBatch>,
        schema: SchemaRef,
    ) -> Result<ReduceState>;
    /// The partial result of the state folded so far.
    fn emit(&self, payload: &[u8], state: &ReduceState) -> Result<(SchemaRef, Vec<RecordBatch>)>;
}

/// Built-in reducer `"checksum"`: counts rows and sums the multiset checksum of everything
/// folded; emits one row `(rows: UInt64, checksum: UInt64)`.
pub struct ChecksumReducer;

/// Kind name of the built-in [`ChecksumReducer`].
pub const CHECKSUM_REDUCER: &str = "checksum";

impl Reducer for ChecksumReducer {
    fn fold(
        &self,
        _payload: &[u8],
        state: Option<ReduceState>,
        batches: Vec<RecordBatch>,
        _schema: SchemaRef,
    ) -> Result<ReduceState> {
        let mut sum = match state {
            Some(s) => *s
                .downcast::<Checksum>()
                .map_err(|_| Error::invalid("checksum reducer given a foreign state"))?,
            None => Checksum::default(),
        };
        for b in &batches {
            sum.add(Checksum::of_batch(b)?);
        }
        Ok(Box::new(sum))
    }

    fn emit(&self, _payload: &[u8], state: &ReduceState) -> Result<(SchemaRef, Vec<RecordBatch>)> {
        use arrow::array::UInt64Array;
        use arrow::datatypes::{DataType, Field, Schema};
        let sum = state
            .downcast_ref::<Checksum>()
            .ok_or_else(|| Error::invalid("checksum reducer given a foreign state"))?;
        let schema = Arc::new(Schema::new(vec![
            Field::new("rows", DataType::UInt64, false),
            Field::new("checksum", DataType::UInt64, false),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(UInt64Array::from(vec![sum.rows])),
                Arc::new(UInt64Array::from(vec![sum.sum])),
            ],
        )?;
        Ok((schema, vec![batch]))
    }
}

/// Sources, reducers and combiners a worker knows, by kind name.
#[derive(Clone, Default)]
pub struct SourceRegistry {
    sources: HashMap<String, Arc<dyn BatchSource>>,
    reducers: HashMap<String, Arc<dyn Reducer>>,
    combiners: HashMap<String, Arc<dyn crate::combine::CombinerKind>>,
}

impl SourceRegistry {
    /// Register `reducer` as reducer kind `kind` (replacing any of that name).
    pub fn register_reducer(&mut self, kind: &str, reducer: Arc<dyn Reducer>) {
        self.reducers.insert(kind.to_string(), reducer);
    }

    /// [`BatchSource::memory_peaks`] summed over the sources.
    pub fn memory_peaks(&self) -> (u64, u64) {
        self.sources.values().fold((0, 0), |(a, b), s| {
            let (x, y) = s.memory_peaks();
            (a + x, b + y)
        })
    }

    /// [`BatchSource::memory_hint`] of a task of source `kind` (0 for an unknown kind).
    pub fn memory_hint(&self, kind: &str, payload: &[u8]) -> u64 {
        self.sources.get(kind).map_or(0, |s| s.memory_hint(payload))
    }

    /// The reducer of kind `kind`; an unknown kind is an error naming the known ones.
    pub fn reducer(&self, kind: &str) -> Result<Arc<dyn Reducer>> {
        self.reducers.get(kind).cloned().ok_or_else(|| {
            let mut known: Vec<&str> = self.reducers.keys().map(|s| s.as_str()).collect();
            known.sort();
            Error::invalid(format!("unknown reducer {kind:?} (known: {known:?})"))
        })
    }

    /// Register combiner kind `kind` (replacing any of that name).
    pub fn register_combiner(&mut self, kind: &str, c: Arc<dyn crate::combine::CombinerKind>) {
        self.combiners.insert(kind.to_string(), c);
    }

    /// The combiner a shuffle's spec names, built from its payload.
    pub fn combiner(
        &self,
        spec: &crate::proto::TaskSource,
        schema: &SchemaRef,
    ) -> Result<crate::combine::CombinerRef> {
        let kind = self.combiners.get(&spec.kind).ok_or_else(|| {
            let mut known: Vec<&str> = self.combiners.keys().map(|s| s.as_str()).collect();
            known.sort();
            Error::invalid(format!(
                "unknown combiner {:?} (known: {known:?})",
                spec.kind
            ))
        })?;
        Ok(crate::combine::CombinerRef(
            kind.open(&spec.payload, schema)?,
        ))
    }

    /// Register `source` as task source kind `kind` (replacing any of that name).
    pub fn register(&mut self, kind: &str, source: Arc<dyn BatchSource>) {
        self.sources.insert(kind.to_string(), source);
    }

    /// Tell every source that `shuffle` was dropped.
    pub fn shuffle_dropped(&self, shuffle: ShuffleId) {
        for s in self.sources.values() {
            s.shuffle_dropped(shuffle);
        }
    }

    /// Open a map task's batches from source `kind`; an unknown kind is an error naming the
    /// known ones.
    pub fn open(
        &self,
        kind: &str,
        ctx: &TaskContext,
        payload: &[u8],
        schema: SchemaRef,
    ) -> Result<BatchStream> {
        let src = self.sources.get(kind).ok_or_else(|| {
            let mut known: Vec<&str> = self.sources.keys().map(|s| s.as_str()).collect();
            known.sort();
            Error::invalid(format!("unknown task source {kind:?} (known: {known:?})"))
        })?;
        src.open(ctx, payload, schema)
    }
}
