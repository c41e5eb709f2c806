//! A stage as the scheduler keeps it ([`Stage`]) and as callers give it ([`StageRun`]), and
//! what a run reports of each ([`StageReport`]): shared by the pipelined pass and recovery.

use crate::block::ShuffleId;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::Result;
use crate::strategy::{pull::Mapped, Strategy};
use crate::sync::lock;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Times a run recovers from lost workers before it gives up.
pub const MAX_RECOVERIES: usize = 2;

/// One stage to run: the shuffle it writes, one input per map task, and the strategy of its
/// exchange.
pub struct StageRun {
    /// The shuffle the stage writes.
    pub spec: ShuffleSpec,
    /// One input per map task.
    pub inputs: Vec<MapInput>,
    /// The strategy of the stage's exchange.
    pub strategy: Strategy,
    /// Inputs decided late, from what an earlier stage wrote (see [`Deferred`]); replaces
    /// `inputs`.
    pub deferred: Option<Deferred>,
    /// The shuffles (stages of the same run) its maps read: recovery finishes them first.
    pub reads: Vec<ShuffleId>,
    /// Rewrites a map input for the workers' addresses now (a lost worker's replacement has
    /// another); `None`: the inputs name no workers.
    pub refresh: Option<Refresh>,
}

/// A map input made anew for the given worker addresses.
pub type Refresh = Arc<dyn Fn(MapInput, &[String]) -> MapInput + Send + Sync>;

/// A stage whose map inputs depend on the partition sizes of a stage it reads (a skew split
/// of a hot partition): it starts once that stage is sealed, not pipelined with it.
pub struct Deferred {
    /// The shuffle whose sizes decide (a stage of the same run).
    pub after: ShuffleId,
    /// Gets the bytes of each of `after`'s partitions; returns the map inputs and a note for
    /// the stage's report (empty: nothing to say).
    pub decide: DecideInputs,
}

/// Decides a deferred stage's map inputs from the bytes of each partition it reads.
pub type DecideInputs = Box<dyn FnOnce(&[u64]) -> Result<(Vec<MapInput>, String)> + Send>;

/// How a stage went, with times in seconds since the query started.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StageReport {
    /// The exchange's shuffle (its id in the event log).
    pub shuffle: String,
    /// The strategy that ran the exchange (for `auto`: its pick and the predicted times).
    pub strategy: String,
    /// Map tasks it ran.
    pub tasks: usize,
    /// Rows its map tasks read.
    pub rows: u64,
    /// Bytes of the blocks its map tasks wrote.
    pub bytes: u64,
    /// Blocks its map tasks wrote.
    pub blocks: usize,
    /// Bytes of those blocks that went to spill files rather than memory.
    pub spilled_bytes: u64,
    /// Bytes of its largest reduce partition, and of its median partition (skew).
    pub max_partition_bytes: u64,
    /// Bytes of its median reduce partition.
    pub median_partition_bytes: u64,
    /// When its first map task was submitted.
    pub start_s: f64,
    /// When its first map output was committed (readers could start on it).
    pub first_commit_s: f64,
    /// When its last map output was committed and the shuffle sealed.
    pub end_s: f64,
    /// A durable exchange: the objects its committed maps wrote to the store, and their bytes.
    pub stored_objects: u64,
    /// Bytes of those objects.
    pub stored_bytes: u64,
    /// Read through the store: the ranged GETs its readers (and second level) make.
    pub store_gets: u64,
}

/// A stage as the run keeps it: what recovery needs to finish it after the pipelined pass.
pub(crate) struct Stage {
    pub(crate) spec: ShuffleSpec,
    pub(crate) strategy: Strategy,
    pub(crate) reads: Vec<ShuffleId>,
    pub(crate) refresh: Option<Refresh>,
    pub(crate) after: Option<ShuffleId>,
    /// Taken by whichever pass decides the deferred inputs first.
    pub(crate) decide: Mutex<Option<DecideInputs>>,
    /// Copies of its map inputs once known (`None` until decided, or if one cannot be
    /// read twice), and the note its decision left.
    pub(crate) inputs: Mutex<Option<Vec<MapInput>>>,
    pub(crate) note: Mutex<String>,
    /// Sealed by its map side (all its maps committed).
    pub(crate) sealed: AtomicBool,
    pub(crate) report: Mutex<Option<StageReport>>,
}

impl Stage {
    /// Keep copies of `inputs` for running maps again.
    pub(crate) fn keep(&self, inputs: &[MapInput]) {
        let copies: Option<Vec<MapInput>> = inputs.iter().map(MapInput::again).collect();
        *lock(&self.inputs) = copies;
    }

    /// Copies of its map inputs for the workers now.
    pub(crate) fn inputs_now(&self, addresses: &[String]) -> Option<Vec<MapInput>> {
        let kept = lock(&self.inputs);
        let copies = kept.as_ref()?.iter().filter_map(MapInput::again);
        Some(match &self.refresh {
            Some(f) => copies.map(|i| f(i, addresses)).collect(),
            None => copies.collect(),
        })
    }
}

/// A stage's report from what its map side returned.
pub(crate) fn report(
    driver: &Driver,
    spec: &ShuffleSpec,
    strategy: Strategy,
    mapped: &Mapped,
    note: &str,
    start_s: f64,
    started: Instant,
) -> StageReport {
    let secs = |t: Option<Instant>| t.map_or(0.0, |t| t.duration_since(started).as_secs_f64());
    let (max_partition_bytes, median_partition_bytes) = mapped.partition_bytes(spec.partitions);
    let mut strategy = driver
        .choice(spec.id)
        .unwrap_or_else(|| strategy.to_string());
    if !note.is_empty() {
        strategy = format!("{strategy}; {note}");
    }
    let (stored_objects, stored_bytes) = driver.stored(spec.id);
    StageReport {
        shuffle: spec.id.to_string(),
        stored_objects,
        stored_bytes,
        store_gets: driver.store_reads(spec.id),
        strategy,
        max_partition_bytes,
        median_partition_bytes,
        tasks: mapped.maps.len(),
        rows: mapped.input.rows,
        bytes: mapped
            .maps
            .iter()
            .flat_map(|m| &m.blocks)
            .map(|b| b.meta.bytes)
            .sum(),
        blocks: mapped.maps.iter().map(|m| m.blocks.len()).sum(),
        spilled_bytes: mapped.maps.iter().map(|m| m.spilled_bytes).sum(),
        start_s,
        first_commit_s: secs(mapped.first_commit),
        end_s: started.elapsed().as_secs_f64(),
    }
}
