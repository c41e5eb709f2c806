//! The worker's block store (Exoshuffle §4.3.2): blocks of every shuffle in memory up to a byte
//! budget; a block that does not fit is spilled whole to the shuffle's current fused segment
//! file (sequential appends, rolled over at `segment_bytes`). Reads check the CRC32C of every
//! block, wherever it lives; spilled blocks are read straight from disk. Partition streams
//! follow blocks in arrival order and wait for new ones until the shuffle is sealed.
//!
//! Attempts and commits (DESIGN "Attempts and commits"): a map attempt's blocks are *pending*
//! until the driver commits that (map, attempt); only then are they appended to their
//! partitions' lists, which readers follow. Lists are append-only, so aborting or discarding an
//! attempt never shifts what a waiting reader has still to read. A map commits at most one
//! attempt; a sealed shuffle takes no more puts or commits and discards what is still pending.

mod read;
pub mod segment;
mod spill;
mod through;
pub mod tier;

use crate::block::{BlockId, BlockMeta, EncodedBlock, ShuffleId};
use crate::error::{Error, Result};
use crate::proto;
use crate::sync::lock;
use arrow::datatypes::SchemaRef;
use bytes::Bytes;
use segment::{Segment, SegmentWriter};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tier::Tier;
use tokio::sync::watch;

/// Default size at which a spill segment file is closed and a new one started.
pub const DEFAULT_SEGMENT_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub memory_budget: u64,
    pub spill_dir: PathBuf,
    pub segment_bytes: u64,
    /// Bytes of spill segment files past which closed segments of shuffles with a tier move
    /// to it ([`tier`]); None: no limit.
    pub disk_budget: Option<u64>,
}

/// What a shuffle is: its schema, partition count and partitioner.
#[derive(Debug, Clone)]
pub struct ShuffleInfo {
    pub id: ShuffleId,
    pub schema: SchemaRef,
    pub partitions: u32,
    pub partitioner: proto::Partitioner,
    /// Rows with equal keys are combined before blocks are written or merged.
    pub combiner: Option<crate::combine::CombinerRef>,
    /// The driver's creation order of shuffles: tasks of lower order are admitted first.
    pub order: u64,
    /// Shuffles created together for one job share a group (0: none); see
    /// [`crate::admission`].
    pub group: u64,
}

impl ShuffleInfo {
    /// Check a batch against the shuffle's schema; equal columns with other field metadata or
    /// nullability are relabelled with the shuffle's schema.
    pub fn conform(&self, batch: arrow::array::RecordBatch) -> Result<arrow::array::RecordBatch> {
        if batch.schema() == self.schema {
            return Ok(batch);
        }
        if !crate::block::same_columns(&batch.schema(), &self.schema) {
            return Err(Error::SchemaMismatch {
                shuffle: self.id,
                expected: crate::block::schema_summary(&self.schema),
                found: crate::block::schema_summary(&batch.schema()),
            });
        }
        crate::block::batch_with(
            self.schema.clone(),
            batch.columns().to_vec(),
            batch.num_rows(),
        )
        .map_err(|e| Error::SchemaMismatch {
            shuffle: self.id,
            expected: crate::block::schema_summary(&self.schema),
            found: format!("{} ({e})", crate::block::schema_summary(&batch.schema())),
        })
    }

    /// Where this shuffle's tasks stand in the worker's admission.
    pub fn rank(&self) -> crate::admission::Rank {
        crate::admission::Rank {
            order: self.order,
            group: self.group,
        }
    }
}

#[derive(Debug, Clone)]
enum Location {
    Memory(Bytes),
    Spilled { segment: Arc<Segment>, offset: u64 },
}

#[derive(Debug, Clone)]
struct Entry {
    meta: BlockMeta,
    location: Location,
    /// Put as an [`EncodedBlock`]: decoded without re-validation once its CRC matches.
    encoded_here: bool,
    /// A packed block's partition ends ([`crate::block::packed`]).
    ends: Option<crate::block::packed::Ends>,
}

struct ShuffleState {
    info: ShuffleInfo,
    /// Every stored block, pending or committed.
    blocks: HashMap<BlockId, Entry>,
    /// Committed blocks of each partition in commit order (append-only).
    by_partition: Vec<Vec<BlockId>>,
    /// Blocks of attempts not committed yet, by (map, attempt), in put order.
    pending: HashMap<(u32, u32), Vec<BlockId>>,
    /// The committed attempt of each map, and its blocks.
    committed: HashMap<u32, (u32, Vec<BlockId>)>,
    /// Attempts aborted here: a task that keeps running after its abort cannot add blocks.
    aborted: std::collections::HashSet<(u32, u32)>,
    sealed: bool,
    /// The rows the driver's manifest lists for each partition, sent with the seal (`None`:
    /// not sealed yet, or a shuffle whose rows the manifest cannot count, such as a combined
    /// one). Readers on this worker check a partition read whole against it.
    expected_rows: Option<Arc<[u64]>>,
    /// A reader has listed a partition or a map output: merges are refused from then on, so
    /// no reader can see both a merged block and the blocks it was made of.
    reads_started: bool,
    /// Maps whose blocks a committed merge group replaced, and that group.
    merged_into: HashMap<u32, u32>,
    segments: Vec<Arc<Segment>>,
    /// Where its closed segments move past the disk budget, if anywhere.
    tier: Option<Arc<Tier>>,
    /// Exchanged through the store: the client and every committed map's object, from which
    /// readers here read its partitions ([`crate::direct`]).
    objects: Option<(Arc<crate::storage::Storage>, Arc<[proto::StoredObject]>)>,
    /// Readers here wait for the seal and its objects ([`Self::wait_read_through`]).
    reads_through: bool,
    version: watch::Sender<u64>,
}

/// Current and cumulative figures of one store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreMetrics {
    pub blocks: u64,
    pub shuffles: u64,
    pub memory_bytes: u64,
    pub memory_budget: u64,
    pub spilled_bytes: u64,
    pub spilled_blocks: u64,
    pub spill_files: u64,
    pub restored_bytes: u64,
    pub restored_blocks: u64,
    /// Bytes of blocks in local spill files now.
    pub disk_bytes: u64,
    /// Segments (and their blocks' bytes) moved to the tier below disk so far.
    pub tiered_segments: u64,
    pub tiered_bytes: u64,
}

pub struct BlockStore {
    cfg: StoreConfig,
    state: Mutex<HashMap<ShuffleId, ShuffleState>>,
    /// One writer per shuffle, locked apart from `state` so disk writes never block readers.
    writers: Mutex<HashMap<ShuffleId, Arc<Mutex<Option<SegmentWriter>>>>>,
    memory_bytes: AtomicU64,
    spilled_bytes: AtomicU64,
    spilled_blocks: AtomicU64,
    spill_files: AtomicU64,
    restored_bytes: AtomicU64,
    restored_blocks: AtomicU64,
    /// Blocks decoded without arrow's re-validation (encoded here, CRC matched).
    unvalidated_decodes: AtomicU64,
    segment_seq: AtomicU64,
    disk_bytes: AtomicU64,
    tiered_segments: AtomicU64,
    tiered_bytes: AtomicU64,
    /// Held while segments move to the tier (one mover at a time).
    tiering: Mutex<()>,
    /// The worker's task grants, kept out of the in-memory share (see [`crate::admission`]).
    admission: Option<Arc<crate::admission::Admission>>,
    /// The store made its spill directory (it did not exist): it may remove it when empty.
    made_dir: bool,
}

pub use crate::ids::{FORWARD_GROUP_BASE, MERGE_GROUP_BASE};

/// A merge group's id, not a map's or a forward's: not merged again.
fn is_merge_group(id: u32) -> bool {
    (MERGE_GROUP_BASE..FORWARD_GROUP_BASE).contains(&id)
}

impl BlockStore {
    pub fn new(cfg: StoreConfig) -> Result<Self> {
        let made_dir = crate::private::create_dir(&cfg.spill_dir)?;
        Ok(BlockStore {
            cfg,
            state: Mutex::new(HashMap::new()),
            writers: Mutex::new(HashMap::new()),
            memory_bytes: AtomicU64::new(0),
            spilled_bytes: AtomicU64::new(0),
            spilled_blocks: AtomicU64::new(0),
            spill_files: AtomicU64::new(0),
            restored_bytes: AtomicU64::new(0),
            restored_blocks: AtomicU64::new(0),
            unvalidated_decodes: AtomicU64::new(0),
            segment_seq: AtomicU64::new(0),
            disk_bytes: AtomicU64::new(0),
            tiered_segments: AtomicU64::new(0),
            tiered_bytes: AtomicU64::new(0),
            tiering: Mutex::new(()),
            admission: None,
            made_dir,
        })
    }

    /// Remove what this store wrote: its spill segments, and its spill directory if the store
    /// made it and nothing else is left in it (a directory named by the user is never
    /// removed whole).
    pub fn remove_files(&self) {
        for path in self.spill_files() {
            let _ = std::fs::remove_file(path);
        }
        if self.made_dir {
            let _ = std::fs::remove_dir(&self.cfg.spill_dir);
        }
    }

    /// Share the memory budget with the tasks `admission` grants: blocks are kept in memory
    /// only while they and the grants fit the budget (the grants take at most half of it).
    pub fn sharing(mut self, admission: Arc<crate::admission::Admission>) -> Self {
        self.admission = Some(admission);
        self
    }

    /// The bytes of blocks this store may hold in memory now.
    fn memory_share(&self) -> u64 {
        let budget = self.cfg.memory_budget;
        let held = self
            .admission
            .as_ref()
            .map_or(0, |a| a.reserved().min(a.capacity()));
        budget - held.min(budget / 2)
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// Register a shuffle. Registering the same id again with the same schema is a no-op.
    pub fn create_shuffle(&self, info: ShuffleInfo) -> Result<()> {
        let mut st = lock(&self.state);
        if let Some(existing) = st.get(&info.id) {
            if !crate::block::same_columns(&existing.info.schema, &info.schema) {
                return Err(Error::invalid(format!(
                    "shuffle {} already exists with another schema",
                    info.id
                )));
            }
            return Ok(());
        }
        let (version, _) = watch::channel(0);
        st.insert(
            info.id,
            ShuffleState {
                by_partition: vec![Vec::new(); info.partitions as usize],
                info,
                blocks: HashMap::new(),
                pending: HashMap::new(),
                committed: HashMap::new(),
                aborted: Default::default(),
                sealed: false,
                expected_rows: None,
                reads_started: false,
                merged_into: HashMap::new(),
                segments: Vec::new(),
                tier: None,
                objects: None,
                reads_through: false,
                version,
            },
        );
        Ok(())
    }

    pub fn shuffle_info(&self, id: ShuffleId) -> Result<ShuffleInfo> {
        lock(&self.state)
            .get(&id)
            .map(|s| s.info.clone())
            .ok_or(Error::UnknownShuffle(id))
    }

    /// Store one encoded block (pending until its attempt commits), in memory if the budget
    /// allows, else in a spill segment.
    pub fn put(&self, id: BlockId, rows: u64, data: Bytes) -> Result<BlockMeta> {
        self.put_where(id, rows, data).map(|(m, _)| m)
    }

    /// [`BlockStore::put`], also telling whether the block was spilled.
    pub fn put_where(&self, id: BlockId, rows: u64, data: Bytes) -> Result<(BlockMeta, bool)> {
        self.insert(id, rows, data, false, None)
    }

    /// Store a block this process encoded (see [`EncodedBlock`]); tells whether it spilled.
    pub fn put_encoded(
        &self,
        id: BlockId,
        rows: u64,
        block: EncodedBlock,
    ) -> Result<(BlockMeta, bool)> {
        self.insert(id, rows, block.into_bytes(), true, None)
    }

    /// [`BlockStore::put_encoded`] with the partition ends of a packed block (None for a
    /// block of one partition).
    pub fn put_encoded_with(
        &self,
        id: BlockId,
        rows: u64,
        block: EncodedBlock,
        ends: Option<crate::block::packed::Ends>,
    ) -> Result<(BlockMeta, bool)> {
        self.insert(id, rows, block.into_bytes(), true, ends)
    }

    /// Store a block; a packed one without its `ends` has them read from its bytes.
    fn insert(
        &self,
        id: BlockId,
        rows: u64,
        data: Bytes,
        encoded_here: bool,
        ends: Option<crate::block::packed::Ends>,
    ) -> Result<(BlockMeta, bool)> {
        let meta = BlockMeta {
            id,
            rows,
            bytes: data.len() as u64,
            crc32c: crc32c::crc32c(&data),
        };
        let partitions = {
            let st = lock(&self.state);
            let sh = st
                .get(&id.shuffle)
                .ok_or(Error::UnknownShuffle(id.shuffle))?;
            check_put(sh, &id)?;
            sh.info.partitions
        };
        let ends = match (id.partition == crate::ids::PACKED, ends) {
            (false, _) => None,
            (true, Some(e)) => Some(e),
            (true, None) => Some(crate::block::packed::Ends::of_block(
                &data, partitions, rows,
            )?),
        };
        let share = self.memory_share();
        let fits = self
            .memory_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                (used + meta.bytes <= share).then_some(used + meta.bytes)
            })
            .is_ok();
        let location = if fits {
            Location::Memory(data)
        } else {
            self.spill(meta, &data)?
        };
        let mut st = lock(&self.state);
        // Checked again: the shuffle may have been dropped, sealed or the map committed by
        // another attempt while the block was written.
        let sh = match st.get_mut(&id.shuffle) {
            Some(sh) => match check_put(sh, &id) {
                Ok(()) => sh,
                Err(e) => {
                    self.forget(fits, meta.bytes);
                    return Err(e);
                }
            },
            None => {
                self.forget(fits, meta.bytes);
                return Err(Error::UnknownShuffle(id.shuffle));
            }
        };
        sh.blocks.insert(
            id,
            Entry {
                meta,
                location,
                encoded_here,
                ends,
            },
        );
        sh.pending.entry((id.map, id.attempt)).or_default().push(id);
        Ok((meta, !fits))
    }

    /// Release the memory a block that was refused after its write had reserved.
    fn forget(&self, in_memory: bool, bytes: u64) {
        if in_memory {
            self.memory_bytes.fetch_sub(bytes, Ordering::SeqCst);
        }
    }

    /// Make the blocks of one map attempt visible to readers, appended to their partitions in
    /// the order they were put. `expected` (when known) is the number of blocks the attempt
    /// reported; a different count is an error and nothing is committed. Committing the
    /// committed attempt again is a no-op; committing another attempt of a committed map is
    /// refused (the first commit wins).
    pub fn commit(
        &self,
        shuffle: ShuffleId,
        map: u32,
        attempt: u32,
        expected: Option<usize>,
    ) -> Result<Vec<BlockMeta>> {
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        commit_locked(sh, map, attempt, expected)
    }
}

/// [`BlockStore::commit`] with the shuffle's state already locked.
fn commit_locked(
    sh: &mut ShuffleState,
    map: u32,
    attempt: u32,
    expected: Option<usize>,
) -> Result<Vec<BlockMeta>> {
    let shuffle = sh.info.id;
    {
        if let Some((won, ids)) = sh.committed.get(&map) {
            if *won == attempt {
                return Ok(ids
                    .iter()
                    .filter_map(|i| sh.blocks.get(i))
                    .map(|e| e.meta)
                    .collect());
            }
            return Err(Error::Precondition(format!(
                "map {map} of shuffle {shuffle} already committed attempt {won}; attempt \
                 {attempt} is refused"
            )));
        }
        if sh.sealed {
            return Err(Error::Precondition(format!(
                "shuffle {shuffle} is sealed: map {map} attempt {attempt} cannot commit"
            )));
        }
        if sh.aborted.contains(&(map, attempt)) {
            return Err(Error::Precondition(format!(
                "map {map} attempt {attempt} of shuffle {shuffle} was aborted"
            )));
        }
        let found = sh.pending.get(&(map, attempt)).map_or(0, |v| v.len());
        if let Some(n) = expected {
            if n != found {
                return Err(Error::Precondition(format!(
                    "map {map} attempt {attempt} of shuffle {shuffle} reported {n} blocks but \
                     {found} are stored here"
                )));
            }
        }
        let ids = sh.pending.remove(&(map, attempt)).unwrap_or_default();
        for id in &ids {
            // A packed block is listed in every partition it has rows of.
            match sh.blocks.get(id).and_then(|e| e.ends.as_ref()) {
                Some(ends) => {
                    for p in ends.non_empty() {
                        sh.by_partition[p as usize].push(*id);
                    }
                }
                None => {
                    if let Some(list) = sh.by_partition.get_mut(id.partition as usize) {
                        list.push(*id);
                    }
                }
            }
        }
        let metas = ids
            .iter()
            .filter_map(|i| sh.blocks.get(i))
            .map(|e| e.meta)
            .collect();
        sh.committed.insert(map, (attempt, ids));
        sh.version.send_modify(|v| *v += 1);
        Ok(metas)
    }
}

impl BlockStore {
    /// The committed blocks of `maps` held here, for a merge task (every map must have
    /// committed here and not been merged already; maps and forwards, no merge group).
    pub fn committed_blocks_of(&self, shuffle: ShuffleId, maps: &[u32]) -> Result<Vec<BlockId>> {
        let st = lock(&self.state);
        let sh = st.get(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        if let Some(g) = maps.iter().find(|m| is_merge_group(**m)) {
            return Err(Error::invalid(format!(
                "merge group {g} cannot be merged again (only maps and forwards)"
            )));
        }
        if sh.reads_started || sh.sealed {
            // The merge could not commit: refuse before doing its work.
            return Err(Error::Precondition(format!(
                "shuffle {shuffle}: readers have started or it is sealed; no more merges"
            )));
        }
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for m in maps {
            match sh.committed.get(m) {
                Some((_, ids)) if !sh.merged_into.contains_key(m) && seen.insert(*m) => {
                    out.extend(ids.iter().filter(|b| b.partition != crate::parity::PARITY))
                }
                _ => {
                    return Err(Error::Precondition(format!(
                        "map {m} of shuffle {shuffle} has no committed, unmerged output here \
                         (or is listed twice)"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Commit attempt `attempt` of merge group `group` (its blocks hold the rows of `maps`)
    /// and retire the blocks of `maps` in the same step: readers see either the maps' blocks
    /// or the group's, never both. Refused once the shuffle is sealed or a reader has started
    /// (then nothing changes; the caller aborts the group's attempt and the maps stay).
    /// Committing the committed attempt again is a no-op (a caller whose reply was lost).
    pub fn commit_merge(
        &self,
        shuffle: ShuffleId,
        group: u32,
        attempt: u32,
        expected: Option<usize>,
        maps: &[u32],
    ) -> Result<Vec<BlockMeta>> {
        // One lock for the checks, the group's commit and the maps' retirement: a reader
        // lists a partition either before all of it (and then no merge commits) or after.
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        if group < MERGE_GROUP_BASE {
            return Err(Error::invalid(format!(
                "merge group {group} is not a merge group id (>= {MERGE_GROUP_BASE})"
            )));
        }
        // Committing the committed attempt again, of the same maps, is a no-op, before any
        // check that would refuse it now (its maps are merged; readers may have started).
        let repeat = sh
            .committed
            .get(&group)
            .is_some_and(|(won, _)| *won == attempt)
            && maps.iter().all(|m| sh.merged_into.get(m) == Some(&group));
        if repeat {
            return commit_locked(sh, group, attempt, expected);
        }
        if sh.reads_started {
            return Err(Error::Precondition(format!(
                "shuffle {shuffle}: readers have started, merge group {group} is refused"
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for m in maps {
            if is_merge_group(*m)
                || !seen.insert(*m)
                || sh.merged_into.contains_key(m)
                || !sh.committed.contains_key(m)
            {
                return Err(Error::Precondition(format!(
                    "merge group {group}: map {m} of shuffle {shuffle} has no committed, \
                     unmerged output here (or is listed twice)"
                )));
            }
        }
        let metas = commit_locked(sh, group, attempt, expected)?;
        let mut retired = Vec::new();
        for m in maps {
            if let Some((_, ids)) = sh.committed.get_mut(m) {
                retired.append(ids);
            }
            sh.merged_into.insert(*m, group);
        }
        let gone: std::collections::HashSet<BlockId> = retired.iter().copied().collect();
        for list in &mut sh.by_partition {
            list.retain(|id| !gone.contains(id));
        }
        self.remove_entries(sh, &retired);
        sh.version.send_modify(|v| *v += 1);
        Ok(metas)
    }

    /// The committed attempt of `map`, if any.
    pub fn committed_attempt(&self, shuffle: ShuffleId, map: u32) -> Option<u32> {
        lock(&self.state)
            .get(&shuffle)
            .and_then(|sh| sh.committed.get(&map).map(|(a, _)| *a))
    }

    /// Remove the pending blocks of one map attempt (it failed, was cancelled or lost the
    /// race to commit). A committed attempt is left alone: readers may be reading it. Returns
    /// how many blocks were removed. Spilled bytes stay in their segment until the shuffle is
    /// dropped.
    pub fn abort(&self, shuffle: ShuffleId, map: u32, attempt: u32) -> usize {
        let mut st = lock(&self.state);
        let Some(sh) = st.get_mut(&shuffle) else {
            return 0;
        };
        if sh.committed.get(&map).is_some_and(|(a, _)| *a == attempt) {
            return 0;
        }
        sh.aborted.insert((map, attempt));
        let gone = sh.pending.remove(&(map, attempt)).unwrap_or_default();
        self.remove_entries(sh, &gone);
        gone.len()
    }

    fn remove_entries(&self, sh: &mut ShuffleState, ids: &[BlockId]) {
        for id in ids {
            if let Some(e) = sh.blocks.remove(id) {
                if matches!(e.location, Location::Memory(_)) {
                    self.memory_bytes.fetch_sub(e.meta.bytes, Ordering::SeqCst);
                }
            }
        }
    }

    /// Mark the map side of a shuffle complete: partition streams end after their last block.
    /// Blocks of attempts that never committed are discarded.
    pub fn seal(&self, shuffle: ShuffleId) -> Result<()> {
        self.seal_counted(shuffle, None)
    }

    /// Seal `shuffle` with the rows its manifest lists for each partition (see
    /// [`Self::expected_rows`]).
    pub fn seal_counted(&self, shuffle: ShuffleId, expected: Option<Arc<[u64]>>) -> Result<()> {
        let writer = lock(&self.writers).get(&shuffle).cloned();
        if let Some(w) = writer {
            let active = lock(&w).take();
            if let Some(active) = active {
                active.finish()?;
                self.tier_down();
            }
        }
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        sh.sealed = true;
        if expected.is_some() {
            sh.expected_rows = expected;
        }
        let pending: Vec<BlockId> = sh.pending.drain().flat_map(|(_, ids)| ids).collect();
        self.remove_entries(sh, &pending);
        sh.version.send_modify(|v| *v += 1);
        Ok(())
    }

    /// The rows the driver's manifest lists for `partition` of `shuffle`, once sealed with
    /// them ([`Self::seal_counted`]).
    pub fn expected_rows(&self, shuffle: ShuffleId, partition: u32) -> Option<u64> {
        let st = lock(&self.state);
        let rows = st.get(&shuffle)?.expected_rows.as_ref()?;
        rows.get(partition as usize).copied()
    }

    /// Forget a shuffle: free its memory and delete its spill files.
    pub fn drop_shuffle(&self, shuffle: ShuffleId) -> Result<()> {
        let sh = lock(&self.state)
            .remove(&shuffle)
            .ok_or(Error::UnknownShuffle(shuffle))?;
        lock(&self.writers).remove(&shuffle);
        let in_memory: u64 = sh
            .blocks
            .values()
            .filter(|e| matches!(e.location, Location::Memory(_)))
            .map(|e| e.meta.bytes)
            .sum();
        self.memory_bytes.fetch_sub(in_memory, Ordering::SeqCst);
        sh.version.send_modify(|v| *v += 1);
        for seg in &sh.segments {
            if !seg.tiered() {
                self.disk_bytes.fetch_sub(seg.bytes(), Ordering::SeqCst);
            }
            seg.remove()?;
        }
        Ok(())
    }

    pub fn spill_files(&self) -> Vec<PathBuf> {
        let st = lock(&self.state);
        st.values()
            .flat_map(|s| s.segments.iter().map(|g| g.path.clone()))
            .collect()
    }

    pub fn metrics(&self) -> StoreMetrics {
        let st = lock(&self.state);
        StoreMetrics {
            blocks: st.values().map(|s| s.blocks.len() as u64).sum(),
            shuffles: st.len() as u64,
            memory_bytes: self.memory_bytes.load(Ordering::SeqCst),
            memory_budget: self.cfg.memory_budget,
            spilled_bytes: self.spilled_bytes.load(Ordering::SeqCst),
            spilled_blocks: self.spilled_blocks.load(Ordering::SeqCst),
            spill_files: self.spill_files.load(Ordering::SeqCst),
            restored_bytes: self.restored_bytes.load(Ordering::SeqCst),
            restored_blocks: self.restored_blocks.load(Ordering::SeqCst),
            disk_bytes: self.disk_bytes.load(Ordering::SeqCst),
            tiered_segments: self.tiered_segments.load(Ordering::SeqCst),
            tiered_bytes: self.tiered_bytes.load(Ordering::SeqCst),
        }
    }
}

/// Whether `id` may be put into `sh` now.
fn check_put(sh: &ShuffleState, id: &BlockId) -> Result<()> {
    if id.partition >= sh.info.partitions
        && id.partition != crate::ids::PACKED
        && id.partition != crate::parity::PARITY
    {
        return Err(Error::invalid(format!(
            "block {id}: partition out of range (shuffle has {})",
            sh.info.partitions
        )));
    }
    if sh.sealed {
        return Err(Error::Precondition(format!(
            "block {id}: shuffle {} is sealed and takes no more blocks",
            sh.info.id
        )));
    }
    if let Some((won, _)) = sh.committed.get(&id.map) {
        return Err(Error::Precondition(format!(
            "block {id}: map {} already committed attempt {won}",
            id.map
        )));
    }
    if sh.aborted.contains(&(id.map, id.attempt)) {
        return Err(Error::Cancelled(format!(
            "block {id}: its attempt was aborted"
        )));
    }
    if sh.blocks.contains_key(id) {
        return Err(Error::invalid(format!("block {id} is already stored")));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
