//! The driver's one entry per shuffle ([`ShuffleEntry`]), as the block store keeps one
//! `ShuffleState`: how it was registered, where its maps leave blocks, attempts and claims,
//! and its **manifest** — every committed output (map, merge group) with every process that
//! holds any of its blocks (where it ran, where it pushed or forwarded them), the rows it wrote
//! per partition, and how to make it again. Recovery asks the manifest what a lost worker
//! held; readers check what they read against it ([`crate::driver::Driver::expected_rows`]).
//! Dropping a shuffle removes its entry, in one step.

use super::placement::Placement;
use super::spec::{BlockRef, Lineage};
use crate::block::ShuffleId;
use crate::proto;
use arrow::datatypes::SchemaRef;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A committed output's entry in its shuffle's manifest: where it ran, every process (worker
/// slot and the slot's generation then) that holds any of its blocks (where it ran, where it
/// pushed or forwarded them), the rows it wrote per partition (maps; `None` for merge groups,
/// which move rows) and how it was made. The output is lost when any holder's slot has moved
/// to a later generation.
#[derive(Debug, Clone)]
pub(crate) struct Made {
    pub worker: usize,
    pub holders: Vec<(usize, u64)>,
    pub rows: Option<Arc<[u64]>>,
    pub lineage: Lineage,
    /// A durable shuffle's map: the object its blocks held where it ran were written to
    /// (its name, and each block with its offset), from which they are restored when that
    /// worker is lost ([`crate::storage`]).
    pub object: Option<proto::StoredObject>,
}

impl Made {
    /// The first holder whose process is gone (its slot's generation moved on), if any.
    /// `generation` gives a slot's generation now.
    pub fn lost_holder(&self, generation: impl Fn(usize) -> u64) -> Option<usize> {
        self.holders
            .iter()
            .find(|(slot, g)| generation(*slot) != *g)
            .map(|(slot, _)| *slot)
    }

    /// Add the holders `more` (slot, generation) of this output's blocks.
    pub fn held_on(&mut self, more: impl IntoIterator<Item = (usize, u64)>) {
        for h in more {
            if !self.holders.contains(&h) {
                self.holders.push(h);
            }
        }
    }
}

/// Everything the driver knows of one shuffle.
#[derive(Default)]
pub(crate) struct ShuffleEntry {
    /// How it was registered on the workers, and each slot's generation when it was
    /// registered there (a lost worker's replacement registers it on first use).
    pub created: Option<(proto::CreateShuffle, Vec<u64>)>,
    /// Its schema, and whether map tasks checksum their input.
    pub schema: Option<(SchemaRef, bool)>,
    pub partitions: Option<u32>,
    /// Where its map tasks leave their blocks and its readers read (default: where maps ran).
    pub placement: Option<Placement>,
    /// Where map tasks send blocks when it differs from where readers read (`auto` switching
    /// to push after its first maps ran in place).
    pub map_placement: Option<Placement>,
    /// The store its maps write to once chosen ([`crate::driver::Driver::use_storage`], or the
    /// cluster's when it is registered): `Some(None)` is not durable.
    pub store: Option<Option<Arc<crate::storage::RunStore>>>,
    /// Its maps write packed blocks from now on.
    pub packing: bool,
    /// Readers read it from its map objects in the store, once sealed ([`crate::direct`]).
    pub via_store: bool,
    /// Its map side is complete: every worker was told ([`crate::driver::Driver::seal`]).
    pub sealed: bool,
    /// Two-level through the store: the combined objects readers read in place of the map
    /// objects, once the second level wrote them ([`crate::direct::combine`]).
    pub combined: Option<Vec<proto::StoredObject>>,
    /// The ranged GETs the second level made (one per map object and column it read).
    pub combine_gets: u64,
    /// How its strategy was chosen (`auto`: its pick and predicted times).
    pub choice: Option<String>,
    /// The committed blocks readers see now (maps' not merged or forwarded since, merge
    /// groups', forwards', parity).
    pub blocks: Vec<BlockRef>,
    /// The manifest: each committed map or merge group.
    pub outputs: HashMap<u32, Made>,
    /// Next attempt number of each map.
    pub attempts: HashMap<u32, u32>,
    /// After a restart: the first attempt number of each map in the new run (attempts below
    /// it are the old run's, still finishing, and never claim).
    pub floor: HashMap<u32, u32>,
    /// The attempt of each map that is committing or committed: the first attempt to finish
    /// claims it, so of two attempts on different workers only one ever commits.
    pub claims: HashMap<u32, u32>,
    /// Maps whose claimed attempt's commit outcome stayed unknown on a live worker (its reply
    /// lost): it may have committed there, so no other attempt may ever claim them.
    pub uncertain: HashSet<u32>,
}

/// A committed map of a parity shuffle: its attempt, every slot's generation when it was
/// submitted, and its parity blocks.
#[derive(Debug, Clone, Default)]
pub struct Coded {
    pub attempt: u32,
    pub generations: Vec<u64>,
    pub parity: Vec<BlockRef>,
}

/// Parity shuffles and their committed maps.
#[derive(Debug, Default)]
pub struct ParityState {
    pub(super) shuffles: HashMap<ShuffleId, u32>,
    pub(super) maps: HashMap<(ShuffleId, u32), Coded>,
    pub(super) rebuilt_blocks: u64,
}
