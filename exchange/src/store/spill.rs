//! Spilling: a block that does not fit the memory share is appended to its shuffle's current
//! segment file (rolled over at `segment_bytes`); past the disk budget, the oldest closed
//! segments of shuffles with a tier move to it ([`super::tier`]).

use super::segment::{Segment, SegmentWriter};
use super::tier::Tier;
use super::{BlockStore, Location};
use crate::block::{BlockMeta, ShuffleId};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

impl BlockStore {
    pub(super) fn spill(&self, meta: BlockMeta, data: &[u8]) -> Result<Location> {
        let writer = lock(&self.writers)
            .entry(meta.id.shuffle)
            .or_insert_with(|| Arc::new(Mutex::new(None)))
            .clone();
        let mut w = lock(&writer);
        if w.is_none() {
            let n = self.segment_seq.fetch_add(1, Ordering::SeqCst);
            let path = self
                .cfg
                .spill_dir
                .join(format!("{}-{n:06}.seg", meta.id.shuffle));
            let created = SegmentWriter::create(&path)?;
            self.spill_files.fetch_add(1, Ordering::SeqCst);
            self.register_segment(meta.id.shuffle, created.segment())?;
            *w = Some(created);
        }
        let Some(active) = w.as_mut() else {
            return Err(Error::Cluster("spill writer vanished".into()));
        };
        let segment = active.segment();
        let offset = match active.append(meta, data) {
            Ok(o) => o,
            Err(e) => {
                *w = None;
                return Err(e);
            }
        };
        self.spilled_bytes.fetch_add(meta.bytes, Ordering::SeqCst);
        self.spilled_blocks.fetch_add(1, Ordering::SeqCst);
        self.disk_bytes.fetch_add(meta.bytes, Ordering::SeqCst);
        if active.len() >= self.cfg.segment_bytes {
            if let Some(full) = w.take() {
                full.finish()?;
            }
            drop(w);
            self.tier_down();
        }
        Ok(Location::Spilled { segment, offset })
    }

    /// Past the disk budget, move the oldest closed segments of shuffles with a tier to it
    /// until the spill files fit again (or none is left to move). A failed move leaves the
    /// segment on disk and is logged: the store only goes over its disk budget.
    pub(super) fn tier_down(&self) {
        let Some(budget) = self.cfg.disk_budget else {
            return;
        };
        if self.disk_bytes.load(Ordering::SeqCst) <= budget {
            return;
        }
        // Another thread moving segments does this one's share too.
        let Ok(_moving) = self.tiering.try_lock() else {
            return;
        };
        let mut movable: Vec<(u64, Arc<Segment>, Arc<Tier>)> = {
            let st = lock(&self.state);
            st.values()
                .filter_map(|sh| sh.tier.clone().map(|t| (sh, t)))
                .flat_map(|(sh, t)| {
                    sh.segments
                        .iter()
                        .filter(|g| g.movable())
                        .map(move |g| (segment_number(&g.path), g.clone(), t.clone()))
                })
                .collect()
        };
        movable.sort_by_key(|(n, _, _)| *n);
        for (_, seg, tier) in movable {
            if self.disk_bytes.load(Ordering::SeqCst) <= budget {
                break;
            }
            match seg.move_to(&tier) {
                Ok(()) => {
                    self.disk_bytes.fetch_sub(seg.bytes(), Ordering::SeqCst);
                    self.tiered_bytes.fetch_add(seg.bytes(), Ordering::SeqCst);
                    self.tiered_segments.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => {
                    tracing::warn!(segment = %seg.path.display(), "spill segment not moved to the store (it stays on disk): {e}");
                    break;
                }
            }
        }
    }

    fn register_segment(&self, shuffle: ShuffleId, seg: Arc<Segment>) -> Result<()> {
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        sh.segments.push(seg);
        Ok(())
    }
}

/// The sequence number in a segment file's name (`<shuffle>-<n>.seg`): lower is older.
fn segment_number(path: &std::path::Path) -> u64 {
    path.file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.rsplit('-').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}
