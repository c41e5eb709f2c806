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
    pub id: ShuffleId,
    pub schema: SchemaRef,
    pub partitions: u32,
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
    pub meta: BlockMeta,
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
    Source(proto::TaskSource),
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
    pub map: u32,
    pub attempt: u32,
    pub worker: usize,
    pub blocks: Vec<BlockRef>,
    pub input: Checksum,
    pub input_bytes: u64,
    pub spilled_bytes: u64,
    /// When the driver committed it.
    pub committed_at: std::time::Instant,
}
