//! In-exchange combining (SmartShuffle §4): when a shuffle's consumer is an aggregate with a
//! partial form, rows with equal keys are combined inside the exchange, so fewer bytes are
//! written, moved and read.
//!
//! * Map side: a map task's per-partition buffer is combined when it fills, before a block is
//!   written; while combining shrinks it at least by half, the combined rows stay buffered
//!   and keep absorbing rows (a task that runs several plan partitions, or whose engine
//!   stopped pre-aggregating, sends one row per key per buffer, not one per key per input).
//!   A buffer that combining does not halve is written combined; after a few combines in a
//!   row that remove almost nothing (keys that do not repeat) the task stops combining.
//! * Merge side: a merge task (merged strategy, push and two-level holders) combines the rows
//!   of each merged block, across the map outputs of its worker.
//!
//! The exchange does not know how to combine: an engine registers a [`CombinerKind`] with the
//! worker (`SourceRegistry::register_combiner`) and names it, with a payload, in the shuffle's
//! spec. A combined shuffle's rows are not its input rows, so its input checksum is not a
//! checksum of what readers get; engines that combine do not compare them.

use crate::error::Result;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use std::fmt;
use std::sync::Arc;

/// Combines rows of one partition with equal keys, keeping the shuffle's schema.
pub trait Combiner: Send + Sync {
    /// `batches` in, fewer (or as many) rows out. Called on a blocking-capable thread inside
    /// the worker's runtime.
    fn combine(&self, batches: &[RecordBatch]) -> Result<Vec<RecordBatch>>;
}

/// Builds a [`Combiner`] from the payload a shuffle's spec carries.
pub trait CombinerKind: Send + Sync {
    /// The combiner `payload` describes, for rows of `schema`.
    fn open(&self, payload: &[u8], schema: &SchemaRef) -> Result<Arc<dyn Combiner>>;
}

/// A shuffle's combiner, as its [`crate::store::ShuffleInfo`] holds it.
#[derive(Clone)]
pub struct CombinerRef(pub Arc<dyn Combiner>);

impl fmt::Debug for CombinerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Combiner")
    }
}

/// A combined buffer is kept (not written) while its rows are at most this share of what
/// went in.
pub const KEEP_RATIO: f64 = 0.5;

/// A map task stops combining after this many combines in a row that removed under a tenth
/// of the rows (its keys do not repeat).
pub const GIVE_UP_AFTER: u32 = 3;
