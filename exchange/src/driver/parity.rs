//! The driver's side of parity shuffles ([`crate::parity`]): which shuffles are protected,
//! where each committed map's parity blocks are, and rebuilding the blocks a lost worker held
//! from the survivors and the parity, without running their maps again.
//!
//! A committed map of a parity shuffle has blocks on every worker (owner placement), so it
//! lost some with any worker whose process changed since the map was submitted. For each such
//! map and each stripe that lost a shard, [`Driver::rebuild`] fetches the stripe's surviving
//! shards raw, decodes the lost ones, cuts each back into its blocks (checking every block
//! against the CRC32C its map reported), puts them on the replacement under the map's
//! committed attempt and commits them there. Lost parity shards are encoded again, so the
//! shuffle is protected as before. A stripe that lost more shards than its parity covers is
//! an error: the caller runs the shuffle again from its inputs.

use super::{lock, BlockRef, Driver};
use crate::block::{BlockId, BlockMeta, ShuffleId};
use crate::error::{Error, Result};
use crate::parity::{self, PARITY};
use crate::proto;
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::sync::Arc;

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
    shuffles: HashMap<ShuffleId, u32>,
    maps: HashMap<(ShuffleId, u32), Coded>,
    rebuilt_blocks: u64,
}

impl Driver {
    /// Protect `shuffle` with `r` parity shards per stripe (0: none). Its maps then push to
    /// partition owners and encode parity ([`crate::parity`]).
    pub fn protect(&self, shuffle: ShuffleId, r: u32) -> Result<()> {
        parity::check(self.num_workers(), r)?;
        let mut st = lock(&self.parity);
        if r == 0 {
            st.shuffles.remove(&shuffle);
        } else {
            st.shuffles.insert(shuffle, r);
        }
        Ok(())
    }

    /// Parity shards per stripe of `shuffle` (0: not protected).
    pub fn parity_of(&self, shuffle: ShuffleId) -> u32 {
        lock(&self.parity)
            .shuffles
            .get(&shuffle)
            .copied()
            .unwrap_or(0)
    }

    /// Bytes of the parity blocks of `shuffle`'s committed maps.
    pub fn parity_bytes(&self, shuffle: ShuffleId) -> u64 {
        lock(&self.parity)
            .maps
            .iter()
            .filter(|((s, _), _)| *s == shuffle)
            .flat_map(|(_, c)| &c.parity)
            .map(|b| b.meta.bytes)
            .sum()
    }

    /// Blocks rebuilt from parity so far, over all shuffles.
    pub fn rebuilt_blocks(&self) -> u64 {
        lock(&self.parity).rebuilt_blocks
    }

    /// Record a committed map of a parity shuffle (`generations`: each slot's when it was
    /// submitted) and take its parity blocks out of `blocks` (they are not rows).
    pub(super) fn record_coded(
        &self,
        shuffle: ShuffleId,
        map: u32,
        attempt: u32,
        generations: Vec<u64>,
        blocks: &mut Vec<BlockRef>,
    ) {
        if self.parity_of(shuffle) == 0 {
            return;
        }
        let parity: Vec<BlockRef> = blocks
            .iter()
            .filter(|b| b.meta.id.partition == PARITY)
            .copied()
            .collect();
        blocks.retain(|b| b.meta.id.partition != PARITY);
        if let Some(refs) = lock(&self.blocks).get_mut(&shuffle) {
            refs.retain(|b| !(b.meta.id.map == map && b.meta.id.partition == PARITY));
        }
        lock(&self.parity).maps.insert(
            (shuffle, map),
            Coded {
                attempt,
                generations,
                parity,
            },
        );
    }

    /// Forget the parity records of `shuffle` (dropped or run again).
    pub(super) fn forget_coded(&self, shuffle: ShuffleId) {
        let mut st = lock(&self.parity);
        st.maps.retain(|(s, _), _| *s != shuffle);
        st.shuffles.remove(&shuffle);
    }

    /// The committed maps of a parity shuffle that lost blocks with a worker: each with its
    /// record and the slots replaced since it was submitted.
    pub fn coded_losses(&self, shuffle: ShuffleId) -> Vec<(u32, Coded, Vec<usize>)> {
        let st = lock(&self.parity);
        let mut out: Vec<(u32, Coded, Vec<usize>)> = st
            .maps
            .iter()
            .filter(|((s, _), _)| *s == shuffle)
            .filter_map(|((_, m), c)| {
                let lost = self.replaced_since(&c.generations);
                (!lost.is_empty()).then(|| (*m, c.clone(), lost))
            })
            .collect();
        out.sort_by_key(|(m, _, _)| *m);
        out
    }

    /// Rebuild every block of `shuffle` lost with its worker from the survivors and the
    /// parity (see the module doc), on the replacements; returns how many maps lost blocks.
    pub async fn rebuild(self: &Arc<Self>, shuffle: ShuffleId) -> Result<usize> {
        // Another worker found lost while rebuilding (two lost at once, noticed one at a
        // time): once its replacement is up, the rebuild starts over with both.
        let mut tries = 0;
        loop {
            match self.rebuild_once(shuffle).await {
                Err(e) => match self.classify(e).await {
                    Error::WorkerLost { .. } if tries < 2 && self.replaces_workers() => tries += 1,
                    e => return Err(e),
                },
                ok => return ok,
            }
        }
    }

    async fn rebuild_once(self: &Arc<Self>, shuffle: ShuffleId) -> Result<usize> {
        let r = self.parity_of(shuffle);
        self.wait_all_live(super::REPLACE_TIMEOUT).await?;
        self.register_replaced(shuffle).await?;
        let losses = self.coded_losses(shuffle);
        if losses.is_empty() {
            return Ok(0);
        }
        let mut by_map: HashMap<u32, Vec<BlockRef>> = HashMap::new();
        for b in self.blocks_of(shuffle) {
            by_map.entry(b.meta.id.map).or_default().push(b);
        }
        tracing::warn!(%shuffle, maps = losses.len(), "rebuilding blocks lost with their worker from parity");
        let count = losses.len();
        let jobs = losses.into_iter().map(|(map, coded, lost)| {
            let data = by_map.remove(&map).unwrap_or_default();
            async move {
                let put = self
                    .rebuild_map(shuffle, r, map, &coded, &lost, &data)
                    .await?;
                Ok::<_, Error>((map, lost, put))
            }
        });
        let done: Vec<(u32, Vec<usize>, u64)> = futures::stream::iter(jobs)
            .buffer_unordered(4)
            .try_collect()
            .await?;
        for (map, lost, put) in done {
            let mut st = lock(&self.parity);
            st.rebuilt_blocks += put;
            if let Some(c) = st.maps.get_mut(&(shuffle, map)) {
                for &slot in &lost {
                    if let Some(g) = c.generations.get_mut(slot) {
                        *g = self.generation(slot);
                    }
                }
            }
            drop(st);
            // The map's output is whole again where it ran, too.
            if let Some((w, g, _)) = lock(&self.lineage).get_mut(&(shuffle, map)) {
                if lost.contains(w) {
                    *g = self.generation(*w);
                }
            }
        }
        tracing::warn!(%shuffle, maps = count, "blocks lost with their worker rebuilt from parity");
        Ok(count)
    }

    /// Rebuild the blocks (data and parity) one map lost on the slots `lost`, put them there
    /// and commit them; returns how many blocks were put.
    async fn rebuild_map(
        &self,
        shuffle: ShuffleId,
        r: u32,
        map: u32,
        coded: &Coded,
        lost: &[usize],
        data: &[BlockRef],
    ) -> Result<u64> {
        let mut put_on: HashMap<usize, u32> = HashMap::new();
        for (s, stripe) in parity::stripes(self.num_workers(), r, map)?
            .iter()
            .enumerate()
        {
            let lost_members: Vec<usize> = (0..stripe.members.len())
                .filter(|&i| lost.contains(&stripe.members[i]))
                .collect();
            let lost_parity: Vec<usize> = (0..r as usize)
                .filter(|&j| lost.contains(&stripe.parity[j]))
                .collect();
            if lost_members.is_empty() && lost_parity.is_empty() {
                continue;
            }
            // Each member's blocks in shard order, and the shard lengths.
            let blocks: Vec<Vec<BlockMeta>> = stripe
                .members
                .iter()
                .map(|&o| {
                    let mut v: Vec<BlockMeta> = data
                        .iter()
                        .filter(|b| b.worker == o)
                        .map(|b| b.meta)
                        .collect();
                    v.sort_by_key(|m| (m.id.partition, m.id.seq));
                    v
                })
                .collect();
            let lens: Vec<usize> = blocks
                .iter()
                .map(|v| v.iter().map(|m| m.bytes as usize).sum())
                .collect();
            if lens.iter().all(|&l| l == 0) {
                continue; // nothing in this stripe, no parity either
            }
            let mut present = Vec::new();
            for (i, &o) in stripe.members.iter().enumerate() {
                if !lost_members.contains(&i) {
                    present.push((i, self.fetch_shard(o, &blocks[i]).await?));
                }
            }
            let mut parity_shards = Vec::new();
            for j in (0..r as usize).filter(|j| !lost_parity.contains(j)) {
                if parity_shards.len() == lost_members.len() {
                    break;
                }
                let seq = parity::parity_seq(s, r, j);
                let p = coded
                    .parity
                    .iter()
                    .find(|b| b.meta.id.seq == seq)
                    .ok_or_else(|| {
                        Error::Cluster(format!(
                            "map {map} of shuffle {shuffle}: parity shard {seq} was never stored"
                        ))
                    })?;
                let (_, bytes) = self.worker(p.worker)?.get_raw(p.meta.id).await?;
                parity_shards.push((j, bytes.to_vec()));
            }
            let rebuilt = parity::decode(&lens, r, &present, &parity_shards)
                .map_err(|e| Error::Cluster(format!("map {map} of shuffle {shuffle}: {e}")))?;
            for (i, shard) in &rebuilt {
                let slot = stripe.members[*i];
                let shard = bytes::Bytes::from(shard.clone());
                let mut at = 0usize;
                for meta in &blocks[*i] {
                    let piece = shard.slice(at..at + meta.bytes as usize);
                    at += meta.bytes as usize;
                    let crc = crc32c::crc32c(&piece);
                    if crc != meta.crc32c {
                        return Err(Error::Checksum {
                            block: meta.id,
                            expected: meta.crc32c,
                            actual: crc,
                        });
                    }
                    self.worker(slot)?.put_raw(*meta, piece).await?;
                    *put_on.entry(slot).or_default() += 1;
                }
            }
            if !lost_parity.is_empty() {
                // The whole stripe is at hand now: its lost parity shards are encoded again.
                let mut shards = vec![Vec::new(); lens.len()];
                for (i, s) in present.into_iter().chain(rebuilt) {
                    shards[i] = s;
                }
                let encoded = parity::encode(&shards, r)?;
                for j in lost_parity {
                    let Some(p) = encoded.get(j) else { continue };
                    let data = bytes::Bytes::from(p.clone());
                    let meta = BlockMeta {
                        id: BlockId {
                            shuffle,
                            map,
                            partition: PARITY,
                            attempt: coded.attempt,
                            seq: parity::parity_seq(s, r, j),
                        },
                        rows: 0,
                        bytes: data.len() as u64,
                        crc32c: crc32c::crc32c(&data),
                    };
                    self.worker(stripe.parity[j])?.put_raw(meta, data).await?;
                    *put_on.entry(stripe.parity[j]).or_default() += 1;
                }
            }
        }
        let mut total = 0u64;
        for (slot, blocks) in put_on {
            let commit = proto::CommitTask {
                shuffle_id: shuffle.0,
                map_id: map,
                attempt: coded.attempt,
                blocks,
                merged_maps: vec![],
            };
            self.worker(slot)?.commit(&commit).await?;
            total += blocks as u64;
        }
        Ok(total)
    }

    /// One worker's shard of a map's output: its blocks fetched raw, in shard order.
    async fn fetch_shard(&self, slot: usize, blocks: &[BlockMeta]) -> Result<Vec<u8>> {
        let client = self.worker(slot)?;
        let mut shard = Vec::with_capacity(blocks.iter().map(|m| m.bytes as usize).sum());
        for m in blocks {
            let (_, bytes) = client.get_raw(m.id).await?;
            shard.extend_from_slice(&bytes);
        }
        Ok(shard)
    }
}
