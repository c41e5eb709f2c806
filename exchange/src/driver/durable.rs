//! The driver's side of durable shuffles ([`crate::storage`]). With a store configured
//! ([`super::DriverConfig::storage`]) every shuffle is registered with it: each map attempt
//! writes its blocks as one object named after the attempt, and the commit records the object
//! and each block's byte range in the shuffle's manifest ([`super::manifest::Made`]).
//!
//! A worker lost after its maps committed then costs no map re-run: [`Driver::restore_stored`]
//! reads the lost blocks back from their objects by range (no LIST: the manifest names every
//! object), checks each block's CRC32C, puts them on the slot's replacement under the
//! committed attempt and commits them there. Outputs it cannot restore (merge groups, whose
//! blocks no object holds; blocks pushed to a lost worker) are left to lineage as before.
//! Dropping a shuffle deletes its objects, then lists its prefix once for the objects of
//! attempts that never committed.

use super::{BlockRef, Driver, REPLACE_TIMEOUT};
use crate::block::ShuffleId;
use crate::error::{Error, Result};
use crate::proto;
use crate::storage::{add_stats, StorageConfig};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Driver {
    /// The store durable shuffles write to, if any.
    pub fn storage_config(&self) -> Option<&StorageConfig> {
        self.storage.as_ref().map(|s| &s.cfg)
    }

    /// The store message registering `shuffle` on workers carries (None: not durable).
    pub(super) fn storage_message(&self, shuffle: ShuffleId) -> Option<proto::Storage> {
        let s = self.storage.as_ref()?;
        Some(s.cfg.to_proto(&s.shuffle_prefix(shuffle.0)))
    }

    /// Check that the store takes writes and deletes (a missing bucket, a wrong endpoint or
    /// credentials fail here, at start, naming the store), with one small probe object.
    pub async fn check_storage(&self) -> Result<()> {
        let Some(s) = &self.storage else {
            return Ok(());
        };
        let probe = format!("{}/probe", s.run);
        s.storage
            .put(&probe, bytes::Bytes::from_static(b"flightshuffle"))
            .await?;
        s.storage.delete(&probe).await
    }

    /// Blocks restored from the store after their worker was lost, over all shuffles.
    pub fn restored_blocks(&self) -> u64 {
        self.restored.load(Ordering::SeqCst)
    }

    /// Requests to the store so far: the driver's own (restores, deletes) plus every live
    /// worker's (objects written).
    pub async fn storage_stats(&self) -> Result<proto::StorageStats> {
        let mut total = match &self.storage {
            Some(s) => s.storage.stats(),
            None => proto::StorageStats::default(),
        };
        for w in self.clients() {
            if !self.is_alive(w.index) {
                continue;
            }
            if let Some(s) = w.stats().await?.storage {
                add_stats(&mut total, &s);
            }
        }
        Ok(total)
    }

    /// Restore from the store the committed map outputs of `shuffle` lost with their worker
    /// (see the module doc), onto the slots' replacements; returns how many maps were
    /// restored. Outputs it cannot restore stay lost, for lineage.
    pub async fn restore_stored(self: &Arc<Self>, shuffle: ShuffleId) -> Result<usize> {
        let Some(ds) = &self.storage else {
            return Ok(0);
        };
        if self.parity_of(shuffle) > 0 {
            return Ok(0); // rebuilt from parity instead
        }
        let gen = |slot: usize| self.generation(slot);
        let lost: Vec<(u32, usize, proto::StoredObject)> = self
            .with_shuffle(shuffle, |e| {
                if e.outputs.values().any(|m| {
                    matches!(m.lineage, super::Lineage::Merge(_)) && m.lost_holder(gen).is_some()
                }) {
                    // A lost merge group reruns its maps: nothing is restored.
                    return vec![];
                }
                e.outputs
                    .iter()
                    .filter_map(|(map, made)| {
                        let object = made.object.as_ref()?;
                        made.lost_holder(gen)?;
                        // Only the blocks kept where the map ran are in its object.
                        let lost_slots: Vec<usize> = made
                            .holders
                            .iter()
                            .filter(|(s, g)| gen(*s) != *g)
                            .map(|(s, _)| *s)
                            .collect();
                        (lost_slots == [made.worker]).then(|| (*map, made.worker, object.clone()))
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
        let mut restored = 0;
        for (map, slot, object) in lost {
            let want: Vec<BlockRef> = by_map
                .remove(&map)
                .unwrap_or_default()
                .into_iter()
                .filter(|b| b.worker == slot)
                .collect();
            let mut ranges = Vec::with_capacity(want.len());
            for b in &want {
                let at = object.blocks.iter().position(|m| {
                    crate::block::BlockMeta::try_from(m).is_ok_and(|m| m.id == b.meta.id)
                });
                match at.and_then(|i| object.offsets.get(i)) {
                    Some(&off) => ranges.push(off..off + b.meta.bytes),
                    None => {
                        return Err(Error::Storage {
                            object: ds.storage.name(&object.path),
                            reason: format!("block {} of map {map} is not in it", b.meta.id),
                        })
                    }
                }
            }
            let onto = self.generation(slot);
            let data = match ranges.is_empty() {
                true => vec![],
                false => ds.storage.get_ranges(&object.path, &ranges).await?,
            };
            let client = self.worker(slot)?;
            for ((b, d), range) in want.iter().zip(data).zip(&ranges) {
                let crc = crc32c::crc32c(&d);
                if crc != b.meta.crc32c || d.len() as u64 != b.meta.bytes {
                    return Err(Error::Storage {
                        object: ds.storage.name(&object.path),
                        reason: format!(
                            "block {} at {}..{} has CRC32C {crc:#010x}, the commit recorded \
                             {:#010x} (corrupted object)",
                            b.meta.id, range.start, range.end, b.meta.crc32c
                        ),
                    });
                }
                client.put_raw(b.meta, d).await?;
            }
            if let Some(first) = want.first() {
                client
                    .commit(&proto::CommitTask {
                        shuffle_id: shuffle.0,
                        map_id: map,
                        attempt: first.meta.id.attempt,
                        blocks: want.len() as u32,
                        merged_maps: vec![],
                    })
                    .await?;
            }
            if self.generation(slot) != onto || !self.is_alive(slot) {
                return Err(Error::WorkerLost {
                    worker: slot,
                    addr: String::new(),
                    reason: format!("lost while map {map} was restored onto it"),
                    lost_blocks: 0,
                });
            }
            // Whole again where it ran.
            self.update_shuffle(shuffle, |e| {
                if let Some(made) = e.outputs.get_mut(&map) {
                    for (s, g) in made.holders.iter_mut() {
                        if *s == slot {
                            *g = onto;
                        }
                    }
                }
            });
            self.restored.fetch_add(want.len() as u64, Ordering::SeqCst);
            restored += 1;
        }
        tracing::warn!(%shuffle, maps = restored, "map outputs restored from the store");
        Ok(restored)
    }

    /// Delete the objects of a dropped shuffle: those its manifest names, then whatever its
    /// prefix still holds (attempts that never committed). Failures are logged, not raised:
    /// `flightshuffle storage sweep` removes what is left.
    pub(super) async fn delete_objects(&self, shuffle: ShuffleId, objects: Vec<String>) {
        let Some(ds) = &self.storage else {
            return;
        };
        use futures::StreamExt;
        let deletes = futures::stream::iter(objects)
            .map(|o| async move { (ds.storage.delete(&o).await, o) })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        for (r, _) in deletes {
            if let Err(e) = r {
                tracing::warn!(%shuffle, "object of a dropped shuffle not deleted: {e}");
            }
        }
        match ds.storage.list(&ds.shuffle_prefix(shuffle.0)).await {
            Ok(left) => {
                for (path, _, _) in left {
                    if let Err(e) = ds.storage.delete(&path).await {
                        tracing::warn!(%shuffle, "object of a dropped shuffle not deleted: {e}");
                    }
                }
            }
            Err(e) => tracing::warn!(%shuffle, "objects of a dropped shuffle not listed: {e}"),
        }
    }
}
