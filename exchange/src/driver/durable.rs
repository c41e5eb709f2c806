//! The driver's side of durable shuffles ([`crate::storage`]). With a store configured
//! ([`super::DriverConfig::storage`]) every shuffle is registered with it: each map attempt
//! writes its blocks as one object named after the attempt, and the commit records the object
//! and each block's byte range in the shuffle's manifest ([`super::manifest::Made`]).
//!
//! A worker lost after its maps committed then costs no map re-run: [`Driver::restore_stored`]
//! reads the lost blocks back from their objects by range (no LIST: the manifest names every
//! object), checks each block's CRC32C, puts them on the slots' replacements under the
//! committed attempt and commits them there. A map's object holds every block it wrote,
//! those it kept and those it pushed, so its blocks merged on a lost worker since (merged,
//! push, two-level) come back unmerged, and the lost merge group is forgotten. Outputs it
//! cannot restore (forwarded maps, whose blocks moved under another id; parity shuffles,
//! rebuilt from parity) are left as before.
//! Dropping a shuffle deletes its objects, then lists its prefix once for the objects of
//! attempts that never committed.

use super::{BlockRef, Driver, REPLACE_TIMEOUT};
use crate::block::ShuffleId;
use crate::error::{Error, Result};
use crate::proto;
use crate::storage::{add_stats, RunStore, StorageConfig};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Maps restored from the store at once.
const RESTORES_IN_FLIGHT: usize = 8;

/// A committed map with blocks on a lost worker, and the object that holds them.
struct Lost {
    map: u32,
    /// The slot it ran on.
    ran_on: usize,
    /// Its holders whose process is gone.
    slots: Vec<usize>,
    object: proto::StoredObject,
}

impl Driver {
    /// The store durable shuffles write to, if any.
    pub fn storage_config(&self) -> Option<&StorageConfig> {
        self.storage.as_ref().map(|s| &s.cfg)
    }

    /// The store `shuffle` writes to (None: not durable): the one chosen for it, or the
    /// cluster's.
    pub(crate) fn store_of(&self, shuffle: ShuffleId) -> Option<Arc<RunStore>> {
        self.with_shuffle(shuffle, |e| e.store.clone())
            .flatten()
            .unwrap_or_else(|| self.storage.clone())
    }

    /// Whether `shuffle` writes its map outputs to a store.
    pub fn is_durable(&self, shuffle: ShuffleId) -> bool {
        self.cfg.durable && self.store_of(shuffle).is_some()
    }

    /// The store message registering `shuffle` on workers carries (None: not durable); the
    /// shuffle keeps that store from now on.
    pub(super) fn storage_message(&self, shuffle: ShuffleId) -> Option<proto::Storage> {
        let store = self.store_of(shuffle);
        self.update_shuffle(shuffle, |e| e.store = Some(store.clone()));
        let s = store?;
        let mut msg = s.cfg.to_proto(&s.shuffle_prefix(shuffle.0));
        msg.tier_only = !self.cfg.durable;
        Some(msg)
    }

    /// Make `shuffle` (before it is registered) durable in the store `cfg` names, or not
    /// durable with None, whatever the cluster's store (a query's `SET flightshuffle.storage`).
    pub fn use_storage(&self, shuffle: ShuffleId, cfg: Option<&StorageConfig>) -> Result<()> {
        let store = cfg.map(|c| self.store_for(c)).transpose()?;
        self.update_shuffle(shuffle, |e| e.store = Some(store));
        Ok(())
    }

    /// The open store of `cfg`: the cluster's, one opened before, or a new one.
    fn store_for(&self, cfg: &StorageConfig) -> Result<Arc<RunStore>> {
        if let Some(s) = self.storage.as_ref().filter(|s| s.cfg == *cfg) {
            return Ok(s.clone());
        }
        let mut stores = crate::sync::lock(&self.stores);
        if let Some(s) = stores.iter().find(|s| s.cfg == *cfg) {
            return Ok(s.clone());
        }
        let s = Arc::new(RunStore::open(cfg)?);
        stores.push(s.clone());
        Ok(s)
    }

    /// Check that the cluster's store takes writes and deletes (a missing bucket, a wrong
    /// endpoint or credentials fail here, at start, naming the store).
    pub async fn check_storage(&self) -> Result<()> {
        match &self.storage {
            Some(s) => probe(s).await,
            None => Ok(()),
        }
    }

    /// [`Self::check_storage`] for the store `cfg` names (before a query uses it).
    pub async fn check_store(&self, cfg: &StorageConfig) -> Result<()> {
        let store = self.store_for(cfg)?;
        probe(&store).await
    }

    /// The objects the committed maps of `shuffle` wrote to the store (and, two-level
    /// through the store, its second level), and their bytes.
    pub fn stored(&self, shuffle: ShuffleId) -> (u64, u64) {
        self.with_shuffle(shuffle, |e| {
            e.outputs
                .values()
                .filter_map(|m| m.object.as_ref())
                .chain(e.combined.iter().flatten())
                .filter(|o| !o.path.is_empty())
                .fold((0, 0), |(n, b), o| (n + 1, b + o.size))
        })
        .unwrap_or((0, 0))
    }

    /// Map outputs a restore gave up on (the store failed or returned bad bytes), which were
    /// then recovered as without a store.
    pub fn restore_failures(&self) -> u64 {
        self.restore_failures.load(Ordering::SeqCst)
    }

    /// Blocks restored from the store after their worker was lost, over all shuffles.
    pub fn restored_blocks(&self) -> u64 {
        self.restored.load(Ordering::SeqCst)
    }

    /// Requests to the store so far: the driver's own (restores, deletes) plus every
    /// worker's (objects written); a replaced worker's counts go with it.
    pub async fn storage_stats(&self) -> Result<proto::StorageStats> {
        let mut total = proto::StorageStats::default();
        let stores = crate::sync::lock(&self.stores).clone();
        for s in self.storage.iter().chain(stores.iter()) {
            add_stats(&mut total, &s.storage.stats());
        }
        // Under the health watch, as every call to all workers.
        for s in self
            .stats()
            .await?
            .iter()
            .filter_map(|w| w.storage.as_ref())
        {
            add_stats(&mut total, s);
        }
        Ok(total)
    }

    /// Restore from the store the committed map outputs of `shuffle` lost with their worker
    /// (see the module doc), onto the slots' replacements; returns how many maps were
    /// restored. Outputs it cannot restore stay lost, for lineage (or, where maps pushed their
    /// blocks, for the caller, who runs the shuffle again).
    pub async fn restore_stored(self: &Arc<Self>, shuffle: ShuffleId) -> Result<usize> {
        let Some(ds) = self.store_of(shuffle) else {
            return Ok(0);
        };
        if self.parity_of(shuffle) > 0 {
            return Ok(0); // rebuilt from parity instead
        }
        // Whether maps kept their blocks where they ran (objects record each block's holder;
        // this is for one that does not).
        let local = self.places_locally(shuffle);
        let gen = |slot: usize| self.generation(slot);
        let lost: Vec<Lost> = self
            .with_shuffle(shuffle, |e| {
                e.outputs
                    .iter()
                    .filter(|(_, made)| !matches!(made.lineage, super::Lineage::Merge(_)))
                    .filter_map(|(map, made)| {
                        let object = made.object.as_ref()?;
                        made.lost_holder(gen)?;
                        let slots: Vec<usize> = made
                            .holders
                            .iter()
                            .filter(|(s, g)| gen(*s) != *g)
                            .map(|(s, _)| *s)
                            .collect();
                        Some(Lost {
                            map: *map,
                            ran_on: made.worker,
                            slots,
                            object: object.clone(),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        if lost.is_empty() {
            return Ok(0);
        }
        self.wait_all_live(REPLACE_TIMEOUT).await?;
        self.register_replaced(shuffle).await?;
        let mut by_map: HashMap<u32, Vec<BlockRef>> = HashMap::new();
        for b in self.blocks_of(shuffle) {
            by_map.entry(b.meta.id.map).or_default().push(b);
        }
        tracing::warn!(%shuffle, maps = lost.len(), "restoring map outputs lost with their worker from the store");
        // Maps restored RESTORES_IN_FLIGHT at a time (each reads its object's ranges, then
        // puts its blocks on their holders).
        use futures::StreamExt;
        let mut jobs: Vec<futures::future::BoxFuture<'_, (u32, Result<bool>)>> = Vec::new();
        for l in lost {
            let mine = by_map.remove(&l.map).unwrap_or_default();
            let ds = ds.clone();
            jobs.push(Box::pin(async move {
                let r = self.restore_map(&ds, shuffle, &l, local, mine).await;
                (l.map, r)
            }));
        }
        let results: Vec<(u32, Result<bool>)> = futures::stream::iter(jobs)
            .buffer_unordered(RESTORES_IN_FLIGHT)
            .collect()
            .await;
        let mut restored = 0;
        for (map, r) in results {
            match r {
                Ok(true) => restored += 1,
                Ok(false) => {}
                Err(e @ Error::WorkerLost { .. }) => return Err(e),
                // The store failed or returned bad bytes: the map is left lost, for lineage.
                Err(e) => {
                    self.restore_failures.fetch_add(1, Ordering::SeqCst);
                    tracing::warn!(%shuffle, map, "not restored from the store (recovered as without it): {e}");
                }
            }
        }
        // A lost merge group whose maps all came back as their own blocks is gone: readers
        // read those instead. One with a map not restored is left to lineage.
        self.update_shuffle(shuffle, |e| {
            let whole: Vec<u32> = e
                .outputs
                .iter()
                .filter_map(|(g, made)| {
                    let super::Lineage::Merge(maps) = &made.lineage else {
                        return None;
                    };
                    made.lost_holder(gen)?;
                    maps.iter()
                        .all(|m| {
                            e.outputs
                                .get(m)
                                .is_some_and(|o| o.lost_holder(gen).is_none())
                        })
                        .then_some(*g)
                })
                .collect();
            for g in whole {
                e.outputs.remove(&g);
                e.claims.remove(&g);
                e.blocks.retain(|b| b.meta.id.map != g);
            }
        });
        tracing::warn!(%shuffle, maps = restored, "map outputs restored from the store");
        Ok(restored)
    }

    /// [`Self::restore_stored`], for a shuffle whose lost outputs are then run again in
    /// place: where maps pushed their blocks to every worker, an output the store could not
    /// give back cannot run again alone (its blocks on live workers are committed), so that
    /// is an error, and the shuffle must run again whole.
    pub async fn restore_in_place(self: &Arc<Self>, shuffle: ShuffleId) -> Result<usize> {
        let restored = self.restore_stored(shuffle).await?;
        if self.parity_of(shuffle) == 0 && !self.places_locally(shuffle) {
            if let Some((m, slot, _)) = self.lost_outputs(shuffle).first() {
                return Err(Error::Cluster(format!(
                    "shuffle {shuffle} lost blocks of map {m} with worker {slot} that the \
                     store could not give back (its maps pushed them to all workers): it \
                     must run again"
                )));
            }
        }
        Ok(restored)
    }

    /// Restore the blocks one committed map placed on its lost slots (its object records
    /// where each was held; `local`: the map kept them all) from its object, where `mine` are
    /// the map's live
    /// block refs (blocks merged on a lost slot since have none); Ok(false) when the object
    /// does not hold them all (left to lineage). Every block is read and checked before any
    /// is put, so a bad object puts nothing.
    async fn restore_map(
        &self,
        ds: &RunStore,
        shuffle: ShuffleId,
        lost: &Lost,
        local: bool,
        mine: Vec<BlockRef>,
    ) -> Result<bool> {
        let (map, slots, object) = (lost.map, &lost.slots, &lost.object);
        let name = ds.storage.name(&object.path);
        let bad = |reason: String| Error::Storage {
            object: name.clone(),
            reason,
        };
        if !object
            .path
            .starts_with(&format!("{}/", ds.shuffle_prefix(shuffle.0)))
            || object.blocks.len() != object.offsets.len()
        {
            return Err(bad(format!(
                "not an object of map {map} of shuffle {shuffle}"
            )));
        }
        // The blocks it placed on a lost slot, with where each starts in the object.
        let mut want: Vec<(BlockRef, u64)> = Vec::new();
        for (i, (m, &offset)) in object.blocks.iter().zip(&object.offsets).enumerate() {
            let meta = crate::block::BlockMeta::try_from(m)
                .map_err(|e| bad(format!("a block entry does not parse: {e}")))?;
            if meta.id.map != map || meta.id.shuffle != shuffle {
                return Err(bad(format!("block {} is not of map {map}", meta.id)));
            }
            // Where it was held: recorded per block, or (an object without holders) where
            // the map ran when maps keep their blocks.
            let worker = match object.holders.get(i) {
                Some(&h) if object.holders.len() == object.blocks.len() => h as usize,
                _ if local => lost.ran_on,
                _ => return Ok(false),
            };
            if slots.contains(&worker) {
                want.push((BlockRef { meta, worker }, offset));
            }
        }
        if let Some(b) = mine
            .iter()
            .filter(|b| slots.contains(&b.worker))
            .find(|b| !want.iter().any(|(w, _)| w.meta.id == b.meta.id))
        {
            tracing::debug!(%shuffle, map, block = %b.meta.id, "not in the map's object; not restored");
            return Ok(false);
        }
        let mut ranges = Vec::with_capacity(want.len());
        for (b, start) in &want {
            match start.checked_add(b.meta.bytes) {
                Some(end) if end <= object.size && b.meta.bytes > 0 => ranges.push(*start..end),
                _ => return Err(bad(format!("block {} runs past its end", b.meta.id))),
            }
        }
        let onto: Vec<(usize, u64)> = slots.iter().map(|&s| (s, self.generation(s))).collect();
        let data = match ranges.is_empty() {
            true => vec![],
            false => ds.storage.get_ranges(&object.path, &ranges).await?,
        };
        for (((b, _), d), range) in want.iter().zip(&data).zip(&ranges) {
            let crc = crc32c::crc32c(d);
            if crc != b.meta.crc32c || d.len() as u64 != b.meta.bytes {
                return Err(bad(format!(
                    "block {} at {}..{} has CRC32C {crc:#010x}, the commit recorded {:#010x} \
                     (corrupted object)",
                    b.meta.id, range.start, range.end, b.meta.crc32c
                )));
            }
        }
        let mut put_on: HashMap<usize, (u32, u32)> = HashMap::new();
        for (b, _) in &want {
            put_on.entry(b.worker).or_insert((b.meta.id.attempt, 0)).1 += 1;
        }
        use futures::{StreamExt, TryStreamExt};
        let mut puts: Vec<futures::future::BoxFuture<'_, Result<()>>> = Vec::new();
        for ((b, _), d) in want.iter().zip(data) {
            let b = *b;
            puts.push(Box::pin(async move {
                self.worker(b.worker)?.put_raw(b.meta, d).await
            }));
        }
        futures::stream::iter(puts)
            .buffer_unordered(8)
            .try_collect::<Vec<()>>()
            .await?;
        for (&slot, &(attempt, blocks)) in &put_on {
            self.worker(slot)?
                .commit(&proto::CommitTask {
                    shuffle_id: shuffle.0,
                    map_id: map,
                    attempt,
                    blocks,
                    merged_maps: vec![],
                })
                .await?;
        }
        self.still_live(&onto, &format!("map {map} was restored"))?;
        // Whole again on every holder, its blocks there listed as they are now.
        self.update_shuffle(shuffle, |e| {
            if let Some(made) = e.outputs.get_mut(&map) {
                for (s, g) in made.holders.iter_mut() {
                    if let Some(&(_, now)) = onto.iter().find(|(o, _)| o == s) {
                        *g = now;
                    }
                }
            }
            e.blocks
                .retain(|b| !(b.meta.id.map == map && slots.contains(&b.worker)));
            e.blocks.extend(want.iter().map(|(b, _)| *b));
        });
        self.restored.fetch_add(want.len() as u64, Ordering::SeqCst);
        self.event("blocks_restored", || {
            serde_json::json!({"shuffle": shuffle.to_string(), "map": map, "blocks": want.len()})
        });
        Ok(true)
    }

    /// Delete the objects of a dropped shuffle: those its manifest names, then whatever its
    /// prefix still holds (attempts that never committed). Failures are logged, not raised:
    /// `flightshuffle storage sweep` removes what is left.
    pub(super) async fn delete_objects(
        &self,
        ds: &RunStore,
        shuffle: ShuffleId,
        objects: Vec<String>,
    ) {
        use futures::StreamExt;
        let all = async {
            let deleted = futures::stream::iter(objects)
                .map(|o| async move { ds.storage.delete(&o).await })
                .buffer_unordered(16)
                .collect::<Vec<_>>()
                .await;
            let mut failed = deleted.into_iter().filter_map(|r| r.err()).count();
            match ds.storage.list(&ds.shuffle_prefix(shuffle.0)).await {
                Ok(left) => {
                    let left = futures::stream::iter(left)
                        .map(|(path, _, _)| async move { ds.storage.delete(&path).await })
                        .buffer_unordered(16)
                        .collect::<Vec<_>>()
                        .await;
                    failed += left.into_iter().filter_map(|r| r.err()).count();
                }
                Err(e) => tracing::warn!(%shuffle, "objects of a dropped shuffle not listed: {e}"),
            }
            if failed > 0 {
                tracing::warn!(%shuffle, failed, "objects of a dropped shuffle not deleted (`flightshuffle storage sweep` removes them)");
            }
        };
        // One deadline for all of it: a store that stopped answering never holds a drop long.
        if tokio::time::timeout(crate::storage::REQUEST_DEADLINE, all)
            .await
            .is_err()
        {
            tracing::warn!(%shuffle, "deleting the objects of a dropped shuffle timed out (`flightshuffle storage sweep` removes them)");
        }
    }
}

/// Write and delete one small object under the run's prefix.
async fn probe(s: &RunStore) -> Result<()> {
    let probe = format!("{}/probe", s.run);
    s.storage
        .put(&probe, bytes::Bytes::from_static(b"flightshuffle"))
        .await?;
    s.storage.delete(&probe).await
}
