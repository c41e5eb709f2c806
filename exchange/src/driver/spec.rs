//! The data types of the driver API: what a shuffle is ([`ShuffleSpec`]), what a map task
//! gets ([`MapInput`]) and leaves ([`MapDone`], [`BlockRef`]), and how its output can be made
//! again ([`Lineage`]).

use crate::block::BlockMeta;
use crate::block::ShuffleId;
use crate::checksum::Checksum;
use crate::proto;
use crate::source::BatchStream;
use arrow::datatypes::SchemaRef;
use std::sync::Arc;

/// What a shuffle is, as the driver registers it on every worker.
#[derive(Debug, Clone)]
pub struct ShuffleSpec {
    /// The shuffle's id.
    pub id: ShuffleId,
    /// The schema of the shuffle's rows.
    pub schema: SchemaRef,
    /// Reduce partitions of the shuffle.
    pub partitions: u32,
    /// How map tasks assign rows to reduce partitions.
    pub partitioner: proto::Partitioner,
    /// Map tasks checksum their input rows (for end-to-end multiset checks); engines that do
    /// not compare checksums turn it off to save the CPU.
    pub checksum_inputs: bool,
    /// A combiner workers apply to the shuffle's rows before they write or merge blocks
    /// (see [`crate::combine`]), by kind and payload.
    pub combine: Option<proto::TaskSource>,
}

/// Where a block is and how big it is.
#[derive(Debug, Clone, Copy)]
pub struct BlockRef {
    /// The block's id, rows, bytes and CRC32C.
    pub meta: BlockMeta,
    /// The worker slot holding the block.
    pub worker: usize,
}

/// How a map output was produced, to recompute it.
#[derive(Debug, Clone)]
pub enum Lineage {
    /// A worker-side source: re-runnable anywhere.
    Source(proto::TaskSource),
    /// A merge group: the rows of these maps (recomputed by re-running them and the merge).
    Merge(Vec<u32>),
    /// Batches pushed from the driver and kept there ([`crate::kept`]): replayable.
    Kept(Arc<crate::kept::KeptInput>),
    /// Batches pushed from the driver: consumed once, not recomputable.
    DriverStream,
}

impl Lineage {
    /// The input to run this map again, if it can be (not a merge group, not a consumed
    /// stream).
    pub fn input(&self) -> Option<MapInput> {
        match self {
            Lineage::Source(s) => Some(MapInput::Source(s.clone())),
            Lineage::Kept(k) => Some(MapInput::Kept(k.clone())),
            Lineage::Merge(_) | Lineage::DriverStream => None,
        }
    }
}

/// A map task's input.
pub enum MapInput {
    /// A worker-side task source: the worker reads the input itself; re-runnable.
    Source(proto::TaskSource),
    /// Batches pushed from the driver: read once, so the map cannot run again.
    Stream(BatchStream),
    /// Batches from the driver, kept there so the map can run again ([`crate::kept`]).
    Kept(Arc<crate::kept::KeptInput>),
}

impl MapInput {
    /// The same input for another attempt, if it can be read again.
    pub fn again(&self) -> Option<MapInput> {
        match self {
            MapInput::Source(s) => Some(MapInput::Source(s.clone())),
            MapInput::Kept(k) => Some(MapInput::Kept(k.clone())),
            MapInput::Stream(_) => None,
        }
    }
}

/// A finished and committed map attempt.
#[derive(Debug, Clone)]
pub struct MapDone {
    /// The map task, or merge group.
    pub map: u32,
    /// The attempt that committed.
    pub attempt: u32,
    /// The worker slot it ran on.
    pub worker: usize,
    /// The blocks it committed.
    pub blocks: Vec<BlockRef>,
    /// Rows and checksum of its input.
    pub input: Checksum,
    /// Bytes of its input (in-memory batches for a map task, blocks for a merge).
    pub input_bytes: u64,
    /// Bytes of its blocks that went to spill files rather than memory.
    pub spilled_bytes: u64,
    /// Seconds it waited on its worker for a share of the memory budget.
    pub admission_wait_seconds: f64,
    /// When the driver committed it.
    pub committed_at: std::time::Instant,
}

/// What `Driver::retire_worker` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    /// The address of the process that was retired (the runtime stops it).
    pub addr: String,
    /// The slot whose process moved into the retired slot (the last one), if another.
    pub moved_from: Option<usize>,
    /// Shuffles switched to reading through the store.
    pub through_store: usize,
}

/// Work done on a cluster so far, for progress bars: committed map tasks with their input
/// rows, block bytes and spill; exchanges planned (by engines, as they plan queries) and
/// sealed. Counters only grow: a caller takes them before and during its job.
#[derive(Debug, Default)]
pub struct Progress {
    /// Map tasks committed.
    pub tasks: std::sync::atomic::AtomicU64,
    /// Their input rows.
    pub rows: std::sync::atomic::AtomicU64,
    /// Bytes of the blocks they committed.
    pub bytes: std::sync::atomic::AtomicU64,
    /// Of those, bytes that went to spill files.
    pub spilled_bytes: std::sync::atomic::AtomicU64,
    /// Exchanges planned by engines.
    pub planned: std::sync::atomic::AtomicU64,
    /// Exchanges sealed (their map side complete).
    pub sealed: std::sync::atomic::AtomicU64,
}

impl Progress {
    /// The counters now: (tasks, rows, bytes, spilled bytes, exchanges planned, sealed).
    pub fn snapshot(&self) -> [u64; 6] {
        use std::sync::atomic::Ordering::Relaxed;
        [
            self.tasks.load(Relaxed),
            self.rows.load(Relaxed),
            self.bytes.load(Relaxed),
            self.spilled_bytes.load(Relaxed),
            self.planned.load(Relaxed),
            self.sealed.load(Relaxed),
        ]
    }

    /// Count a committed map task.
    pub(crate) fn committed(&self, done: &MapDone) {
        use std::sync::atomic::Ordering::Relaxed;
        self.tasks.fetch_add(1, Relaxed);
        self.rows.fetch_add(done.input.rows, Relaxed);
        let bytes: u64 = done.blocks.iter().map(|b| b.meta.bytes).sum();
        self.bytes.fetch_add(bytes, Relaxed);
        self.spilled_bytes.fetch_add(done.spilled_bytes, Relaxed);
    }
}
