//! Tasks a worker runs: the map task (partition a `BatchSource` into blocks), the
//! `BatchSource` trait through which engines feed map tasks, and the `Reducer` trait through
//! which engines fold blocks into a running reduce state (streaming strategy).

use crate::admission::Grant;
use crate::block::{
    same_columns, schema_summary, BlockId, BlockMeta, Compression, EncodedBlock, ShuffleId, Slice,
};
use crate::checksum::Checksum;
use crate::error::{Error, Result};
use crate::partitioner::Partitioner;
use crate::store::{BlockStore, ShuffleInfo};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use futures::{Stream, StreamExt};
use std::any::Any;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

pub type BatchStream = Pin<Box<dyn Stream<Item = Result<RecordBatch>> + Send>>;

/// Reads committed shuffle output: one reduce partition from every worker in `peers` (blocks
/// in commit order, following new commits until the shuffle is sealed), or the output of one
/// map. Implemented by [`crate::transport::peers::PeerReader`] for workers and the driver.
pub trait ShuffleReader: Send + Sync {
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
    fn read_map_output(&self, peers: &[String], shuffle: ShuffleId, map: u32) -> BatchStream;
}

/// What a map task gets from the worker that runs it: which attempt it is, and the worker's
/// pooled reader (cluster token, timeouts, its own store for local blocks).
#[derive(Clone)]
pub struct TaskContext {
    pub shuffle: ShuffleId,
    pub map: u32,
    pub attempt: u32,
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
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

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
    pub fn with_builtin() -> Self {
        let mut r = SourceRegistry::default();
        r.register(
            crate::gen::LINEITEM_SOURCE,
            Arc::new(crate::gen::LineitemSource),
        );
        r.register_reducer(CHECKSUM_REDUCER, Arc::new(ChecksumReducer));
        r
    }

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

    pub fn reducer(&self, kind: &str) -> Result<Arc<dyn Reducer>> {
        self.reducers.get(kind).cloned().ok_or_else(|| {
            let mut known: Vec<&str> = self.reducers.keys().map(|s| s.as_str()).collect();
            known.sort();
            Error::invalid(format!("unknown reducer {kind:?} (known: {known:?})"))
        })
    }

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

    pub fn register(&mut self, kind: &str, source: Arc<dyn BatchSource>) {
        self.sources.insert(kind.to_string(), source);
    }

    /// Tell every source that `shuffle` was dropped.
    pub fn shuffle_dropped(&self, shuffle: ShuffleId) {
        for s in self.sources.values() {
            s.shuffle_dropped(shuffle);
        }
    }

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

/// Map task tuning. Blocks are flushed per partition at `block_bytes`; the whole task never
/// buffers more than `buffer_bytes` of partitioned rows.
#[derive(Debug, Clone, Copy)]
pub struct MapConfig {
    pub block_bytes: usize,
    pub buffer_bytes: usize,
    pub compression: Compression,
    /// Checksum the input rows (order-independent multiset checksum) for verification.
    pub checksum: bool,
    /// Small per-partition pieces are coalesced into batches of up to this many rows before
    /// a block is encoded (fewer IPC messages, full-size batches for the reader).
    pub batch_rows: usize,
    /// Write packed blocks, one per holder per flush ([`crate::packed`]), where the strategy
    /// merges them before anyone reads (not with a combiner).
    pub pack: bool,
}

impl Default for MapConfig {
    fn default() -> Self {
        MapConfig {
            block_bytes: 4 << 20,
            buffer_bytes: 32 << 20,
            compression: Compression::None,
            checksum: true,
            batch_rows: 8192,
            pack: false,
        }
    }
}

impl MapConfig {
    /// The bytes a map or merge task is granted from its worker's budget: its partition
    /// buffers and as much again for the blocks it encodes and the input batches in flight.
    pub fn task_grant(&self) -> u64 {
        2 * self.buffer_bytes as u64
    }

    /// Buffers sized to a worker's budget: a task buffers at most 1/8 of it (4-32 MiB) and
    /// flushes blocks of a quarter of that (1-4 MiB), so the few map tasks a worker runs at
    /// once hold a fraction of the budget beside it, not a fixed 32 MiB each. Shuffle bench,
    /// 4 workers, 89 MiB budget: peak RSS per worker 420-460 MiB with 32 MiB buffers (see
    /// `docs/bench/pipelined-scheduler.md` for the figure with this sizing).
    pub fn for_budget(budget: u64) -> Self {
        let budget = usize::try_from(budget).unwrap_or(usize::MAX);
        let buffer_bytes = (budget / 8).clamp(4 << 20, 32 << 20);
        MapConfig {
            buffer_bytes,
            block_bytes: (buffer_bytes / 4).clamp(1 << 20, 4 << 20),
            ..MapConfig::default()
        }
    }
}

/// What a map task reports: its blocks and a checksum of the rows it read.
#[derive(Debug, Clone, Default)]
pub struct MapOutput {
    /// Blocks stored here.
    pub blocks: Vec<BlockMeta>,
    /// Blocks pushed to other workers, per worker.
    pub pushed: Vec<crate::proto::PushedBlocks>,
    pub input: Checksum,
    pub input_bytes: u64,
    pub spilled_bytes: u64,
    pub seconds: f64,
    /// Rows written per reduce partition (map tasks), wherever the blocks went.
    pub partition_rows: Vec<u64>,
}

impl MapOutput {
    /// Count `rows` written to `partition` of a shuffle of `partitions`.
    pub(crate) fn wrote(&mut self, partition: u32, rows: u64, partitions: u32) {
        if self.partition_rows.len() < partitions as usize {
            self.partition_rows.resize(partitions as usize, 0);
        }
        if let Some(r) = self.partition_rows.get_mut(partition as usize) {
            *r += rows;
        }
    }

    /// Count one input batch: its rows (with their multiset checksum when `checksum`) and its
    /// in-memory bytes, which it returns.
    pub(crate) fn count_input(&mut self, batch: &RecordBatch, checksum: bool) -> Result<usize> {
        if checksum {
            self.input.add(Checksum::of_batch(batch)?);
        } else {
            self.input.rows += batch.num_rows() as u64;
        }
        let size = batch.get_array_memory_size();
        self.input_bytes += size as u64;
        Ok(size)
    }
}

struct PartitionBuffer {
    batches: Vec<RecordBatch>,
    bytes: usize,
    rows: u64,
    seq: u32,
}

/// In-exchange combining of one map task's buffers (see [`crate::combine`]).
struct Combining {
    combiner: Option<crate::combine::CombinerRef>,
    /// Combines in a row that removed under a tenth of the rows.
    useless: u32,
}

impl Combining {
    /// Combine `buf` in place. Returns the bytes it freed when the combined rows are at most
    /// [`crate::combine::KEEP_RATIO`] of the rows (they stay buffered, absorbing more);
    /// otherwise the buffer holds the combined rows and `None` says to write them. After
    /// [`crate::combine::GIVE_UP_AFTER`] combines in a row that remove under a tenth of the
    /// rows (keys do not repeat), the task stops combining.
    fn combine(&mut self, buf: &mut PartitionBuffer, info: &ShuffleInfo) -> Result<Option<usize>> {
        let Some(c) = self.combiner.as_ref() else {
            return Ok(None);
        };
        if buf.batches.is_empty() {
            return Ok(None);
        }
        let combined = c.0.combine(&buf.batches)?;
        let combined = combined
            .into_iter()
            .map(|b| {
                crate::job::conform(b, &info.schema).and_then(|b| crate::block::compact_views(&b))
            })
            .collect::<Result<Vec<_>>>()?;
        let rows: u64 = combined.iter().map(|b| b.num_rows() as u64).sum();
        let ratio = rows as f64 / buf.rows.max(1) as f64;
        self.useless = if ratio > 0.9 { self.useless + 1 } else { 0 };
        if self.useless >= crate::combine::GIVE_UP_AFTER {
            self.combiner = None;
        }
        let bytes: usize = combined.iter().map(|b| b.get_array_memory_size()).sum();
        buf.rows = rows;
        buf.batches = combined;
        if ratio <= crate::combine::KEEP_RATIO {
            let freed = buf.bytes.saturating_sub(bytes);
            buf.bytes -= freed;
            Ok(Some(freed))
        } else {
            // The caller's count of buffered bytes still holds `buf.bytes` for this buffer,
            // which the flush that follows frees.
            Ok(None)
        }
    }
}

/// Run one map task: read `input`, partition every batch, store the blocks.
pub async fn run_map(
    store: &BlockStore,
    info: &ShuffleInfo,
    map: u32,
    attempt: u32,
    mut input: BatchStream,
    cfg: MapConfig,
    mut push: Option<crate::push::Pusher>,
) -> Result<MapOutput> {
    if cfg.pack && info.combiner.is_none() {
        return crate::packed::run_map(store, info, map, attempt, input, cfg, push).await;
    }
    let start = Instant::now();
    let mut part =
        Partitioner::from_proto(&info.partitioner, &info.schema, info.partitions, map as u64)?;
    let mut bufs: Vec<PartitionBuffer> = (0..info.partitions)
        .map(|_| PartitionBuffer {
            batches: Vec::new(),
            bytes: 0,
            rows: 0,
            seq: 0,
        })
        .collect();
    let mut out = MapOutput::default();
    let mut buffered = 0usize;
    // Blocks encoded for other workers, sent once the CPU-bound section is left.
    let mut outgoing = Vec::new();
    let holders: Vec<Option<u32>> = (0..info.partitions)
        .map(|p| push.as_ref().and_then(|x| x.remote_holder(p)))
        .collect();
    type Outgoing = Vec<(u32, BlockMeta, bytes::Bytes)>;
    let mut combining = Combining {
        combiner: info.combiner.clone(),
        useless: 0,
    };
    let flush = |p: usize,
                 bufs: &mut Vec<PartitionBuffer>,
                 out: &mut MapOutput,
                 outgoing: &mut Outgoing|
     -> Result<usize> {
        let buf = &mut bufs[p];
        if buf.batches.is_empty() {
            return Ok(0);
        }
        out.wrote(p as u32, buf.rows, info.partitions);
        let batches = coalesce(&info.schema, &buf.batches, cfg.batch_rows)?;
        let data = EncodedBlock::encode(&info.schema, &batches, cfg.compression)?;
        let id = BlockId {
            shuffle: info.id,
            map,
            partition: p as u32,
            attempt,
            seq: buf.seq,
        };
        if let Some(holder) = holders[p] {
            let data = data.into_bytes();
            let meta = BlockMeta {
                id,
                rows: buf.rows,
                bytes: data.len() as u64,
                crc32c: crc32c::crc32c(&data),
            };
            outgoing.push((holder, meta, data));
        } else {
            let (meta, spilled) = store.put_encoded(id, buf.rows, data)?;
            if spilled {
                out.spilled_bytes += meta.bytes;
            }
            out.blocks.push(meta);
        }
        let freed = buf.bytes;
        buf.batches.clear();
        buf.bytes = 0;
        buf.rows = 0;
        buf.seq += 1;
        Ok(freed)
    };
    while let Some(batch) = input.next().await {
        // A source that is always ready never yields; yield here so an abort takes effect.
        tokio::task::yield_now().await;
        let batch = batch?;
        if batch.num_rows() == 0 {
            continue;
        }
        let batch = conform(info, batch)?;
        tokio::task::block_in_place(|| -> Result<()> {
            out.count_input(&batch, cfg.checksum)?;
            for (p, piece) in part.split(&batch)? {
                let piece = crate::block::compact_views(&piece)?;
                let size = piece.get_array_memory_size();
                let buf = &mut bufs[p as usize];
                buf.rows += piece.num_rows() as u64;
                buf.bytes += size;
                buf.batches.push(piece);
                buffered += size;
                if bufs[p as usize].bytes >= cfg.block_bytes {
                    if let Some(freed) = combining.combine(&mut bufs[p as usize], info)? {
                        buffered -= freed;
                        continue;
                    }
                    buffered -= flush(p as usize, &mut bufs, &mut out, &mut outgoing)?;
                }
            }
            while buffered > cfg.buffer_bytes {
                let largest = (0..bufs.len()).max_by_key(|&i| bufs[i].bytes).unwrap_or(0);
                if let Some(freed) = combining.combine(&mut bufs[largest], info)? {
                    buffered -= freed;
                    continue;
                }
                buffered -= flush(largest, &mut bufs, &mut out, &mut outgoing)?;
            }
            Ok(())
        })?;
        send_pushed(&mut push, &mut outgoing).await?;
    }
    tokio::task::block_in_place(|| -> Result<()> {
        for p in 0..bufs.len() {
            // Whatever is left is combined once more (if combining still pays) and written.
            let _ = combining.combine(&mut bufs[p], info)?;
            flush(p, &mut bufs, &mut out, &mut outgoing)?;
        }
        Ok(())
    })?;
    send_pushed(&mut push, &mut outgoing).await?;
    if let Some(pusher) = push {
        pusher.finish(store, &mut out).await?;
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// Send the blocks `outgoing` holds to their holders (a no-op without a pusher).
pub(crate) async fn send_pushed(
    push: &mut Option<crate::push::Pusher>,
    outgoing: &mut Vec<(u32, BlockMeta, bytes::Bytes)>,
) -> Result<()> {
    if let Some(pusher) = push.as_mut() {
        for (holder, meta, data) in outgoing.drain(..) {
            pusher.send(holder, meta, data).await?;
        }
    }
    Ok(())
}

/// Concatenate consecutive small batches into batches of at most `target` rows (a batch
/// that is large already is kept as it is, without a copy).
fn coalesce(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    target: usize,
) -> Result<Vec<RecordBatch>> {
    let mut out = Vec::new();
    let mut group: Vec<RecordBatch> = Vec::new();
    let mut rows = 0usize;
    let mut emit = |group: &mut Vec<RecordBatch>| -> Result<()> {
        match group.len() {
            0 => {}
            1 => out.append(group),
            _ => {
                out.push(arrow::compute::concat_batches(schema, group.iter())?);
                group.clear();
            }
        }
        Ok(())
    };
    for b in batches {
        if rows + b.num_rows() > target && !group.is_empty() {
            emit(&mut group)?;
            rows = 0;
        }
        rows += b.num_rows();
        group.push(b.clone());
    }
    emit(&mut group)?;
    Ok(out)
}

/// Merged blocks are cut at this size (Riffle merges map outputs into blocks of a few MiB).
pub const MERGED_BLOCK_BYTES: usize = 8 << 20;

/// Run one merge task (merged strategy): the committed blocks `ids` of a few maps held by
/// `store`, partition by partition, rewritten as few large blocks (each up to
/// [`MERGED_BLOCK_BYTES`] of rows) of map id `group`, attempt `attempt`, pending until the
/// driver commits the group. Rows are not re-partitioned: a block's rows stay in its partition.
/// Packed blocks ([`crate::packed`]) are decoded once and cut by partition (slices, no copy
/// before the merged block is built); blocks of one partition are read partition by partition.
pub fn run_merge(
    store: &BlockStore,
    info: &ShuffleInfo,
    mut ids: Vec<BlockId>,
    group: u32,
    attempt: u32,
    cfg: MapConfig,
) -> Result<MapOutput> {
    let start = std::time::Instant::now();
    ids.sort_by_key(|b| (b.partition, b.map, b.seq));
    let mut out = MapOutput::default();
    let mut seq = 0u32;
    let mut flush =
        |partition: u32, batches: &mut Vec<RecordBatch>, out: &mut MapOutput| -> Result<()> {
            if batches.is_empty() {
                return Ok(());
            }
            // A combined shuffle's merge also combines across the maps it merges.
            if let Some(c) = &info.combiner {
                let combined = c.0.combine(batches)?;
                *batches = combined
                    .into_iter()
                    .map(|b| crate::job::conform(b, &info.schema))
                    .collect::<Result<Vec<_>>>()?;
            }
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            let batches_out = coalesce(&info.schema, batches, cfg.batch_rows)?;
            let block = EncodedBlock::encode(&info.schema, &batches_out, cfg.compression)?;
            let id = BlockId {
                shuffle: info.id,
                map: group,
                partition,
                attempt,
                seq,
            };
            seq += 1;
            let (meta, spilled) = store.put_encoded(id, rows as u64, block)?;
            if spilled {
                out.spilled_bytes += meta.bytes;
            }
            out.input.rows += rows as u64;
            out.input_bytes += meta.bytes;
            out.blocks.push(meta);
            batches.clear();
            Ok(())
        };
    // Packed blocks: decoded once, then each partition's rows gathered from all of them by
    // one `interleave` per merged block (not one slice per block and partition).
    let split = ids.partition_point(|id| id.partition != crate::packed::PACKED);
    let packed = Packed::read(store, &ids[split..], info.partitions)?;
    let mut plain = ids[..split].iter().peekable();
    let mut batches = Vec::new();
    for p in 0..info.partitions {
        let mut bytes = 0usize;
        // Blocks of this partition alone (counted by encoded size: decoded arrays share the
        // block's buffer, so their memory sizes would count it once per column).
        while let Some(id) = plain.next_if(|id| id.partition == p) {
            if bytes >= MERGED_BLOCK_BYTES {
                flush(p, &mut batches, &mut out)?;
                bytes = 0;
            }
            bytes += store.meta(id)?.bytes as usize;
            batches.extend(store.read_batches(id)?);
        }
        for chunk in packed.rows_of(p, MERGED_BLOCK_BYTES.saturating_sub(bytes)) {
            if bytes >= MERGED_BLOCK_BYTES {
                flush(p, &mut batches, &mut out)?;
                bytes = 0;
            }
            bytes += chunk.1;
            batches.push(packed.gather(&chunk.0)?);
        }
        flush(p, &mut batches, &mut out)?;
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// The packed blocks of one merge, decoded, with where each partition's rows are.
struct Packed {
    batches: Vec<RecordBatch>,
    /// Per input batch: its partition ends and its estimated encoded bytes per row.
    layout: Vec<(crate::packed::Ends, f64)>,
}

impl Packed {
    fn read(store: &BlockStore, ids: &[BlockId], partitions: u32) -> Result<Packed> {
        let mut out = Packed {
            batches: Vec::new(),
            layout: Vec::new(),
        };
        for id in ids {
            let meta = store.meta(id)?;
            let (batches, ends) = store.read_packed(id)?;
            let batch = match batches.as_slice() {
                [one] => one.clone(),
                many => match many.first() {
                    Some(b) => arrow::compute::concat_batches(&b.schema(), many)?,
                    None => continue,
                },
            };
            if ends.range(partitions.saturating_sub(1)).end != batch.num_rows() {
                return Err(Error::invalid(format!(
                    "block {id}: ends do not match its rows"
                )));
            }
            out.layout
                .push((ends, meta.bytes as f64 / meta.rows.max(1) as f64));
            out.batches.push(batch);
        }
        Ok(out)
    }

    /// The (input, row) pairs of partition `p`, cut into chunks of about
    /// [`MERGED_BLOCK_BYTES`] (the first one `first` bytes), each with its estimated bytes.
    fn rows_of(&self, p: u32, first: usize) -> Vec<(Vec<(usize, usize)>, usize)> {
        let mut chunks = Vec::new();
        let (mut rows, mut bytes, mut limit) = (Vec::new(), 0f64, first.max(1) as f64);
        for (i, (ends, per_row)) in self.layout.iter().enumerate() {
            for r in ends.range(p) {
                if bytes >= limit && !rows.is_empty() {
                    chunks.push((std::mem::take(&mut rows), bytes as usize));
                    (bytes, limit) = (0.0, MERGED_BLOCK_BYTES as f64);
                }
                rows.push((i, r));
                bytes += per_row;
            }
        }
        if !rows.is_empty() {
            chunks.push((rows, bytes as usize));
        }
        chunks
    }

    fn gather(&self, rows: &[(usize, usize)]) -> Result<RecordBatch> {
        let refs: Vec<&RecordBatch> = self.batches.iter().collect();
        Ok(arrow::compute::interleave_record_batch(&refs, rows)?)
    }
}

/// Check a batch against the shuffle's schema; equal columns with other field metadata or
/// nullability are relabelled with the shuffle's schema.
pub(crate) fn conform(info: &ShuffleInfo, batch: RecordBatch) -> Result<RecordBatch> {
    if batch.schema() == info.schema {
        return Ok(batch);
    }
    if !same_columns(&batch.schema(), &info.schema) {
        return Err(Error::SchemaMismatch {
            shuffle: info.id,
            expected: schema_summary(&info.schema),
            found: schema_summary(&batch.schema()),
        });
    }
    crate::block::batch_with(
        info.schema.clone(),
        batch.columns().to_vec(),
        batch.num_rows(),
    )
    .map_err(|e| Error::SchemaMismatch {
        shuffle: info.id,
        expected: schema_summary(&info.schema),
        found: format!("{} ({e})", schema_summary(&batch.schema())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    #[test]
    fn small_pieces_are_coalesced_and_large_ones_kept() {
        let schema: SchemaRef =
            Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let piece = |n: i64| {
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from_iter_values(0..n))],
            )
            .unwrap()
        };
        let mut input: Vec<RecordBatch> = (0..30).map(|_| piece(100)).collect();
        input.push(piece(10_000));
        input.extend((0..3).map(|_| piece(7)));
        let out = coalesce(&schema, &input, 1000).unwrap();
        let sizes: Vec<usize> = out.iter().map(|b| b.num_rows()).collect();
        assert_eq!(sizes, vec![1000, 1000, 1000, 10_000, 21]);
        let total = |b: &[RecordBatch]| {
            Checksum::of_batch(&arrow::compute::concat_batches(&schema, b).unwrap()).unwrap()
        };
        assert_eq!(total(&out), total(&input));
    }

    #[test]
    fn map_buffers_follow_the_budget() {
        let small = MapConfig::for_budget(89 << 20);
        assert_eq!(small.buffer_bytes, (89 << 20) / 8);
        assert_eq!(small.block_bytes, small.buffer_bytes / 4);
        let tiny = MapConfig::for_budget(1 << 20);
        assert_eq!((tiny.buffer_bytes, tiny.block_bytes), (4 << 20, 1 << 20));
        let large = MapConfig::for_budget(u64::MAX);
        assert_eq!((large.buffer_bytes, large.block_bytes), (32 << 20, 4 << 20));
    }
}
