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

use super::{BlockRef, Driver};
use crate::block::{BlockId, BlockMeta, ShuffleId};
use crate::error::{Error, Result};
use crate::parity::{self, PARITY};
use crate::proto;
use crate::sync::lock;
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::sync::Arc;

pub use super::manifest::Coded;

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
        self.with_shuffle_mut(shuffle, |e| {
            e.blocks
                .retain(|b| !(b.meta.id.map == map && b.meta.id.partition == PARITY))
        });
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
        if self
            .with_shuffle(shuffle, |e| e.sealed && e.via_store)
            .unwrap_or(false)
        {
            return Vec::new(); // read from its objects only
        }
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
                // The processes rebuilt onto (a slot replaced again meanwhile is not whole).
                let onto: Vec<(usize, u64)> =
                    lost.iter().map(|&s| (s, self.generation(s))).collect();
                let put = self
                    .rebuild_map(shuffle, r, map, &coded, &lost, &data)
                    .await?;
                // Recorded only if those processes are still the slots' live ones (a slot
                // found lost meanwhile may have taken the puts on its old process).
                self.still_live(&onto, &format!("map {map} was rebuilt"))?;
                self.rebuilt_map(shuffle, map, &onto, put);
                Ok::<_, Error>(())
            }
        });
        futures::stream::iter(jobs)
            .buffer_unordered(4)
            .try_collect::<Vec<()>>()
            .await?;
        tracing::warn!(%shuffle, maps = count, "blocks lost with their worker rebuilt from parity");
        self.event(
            "blocks_rebuilt",
            || serde_json::json!({"shuffle": shuffle.to_string(), "maps": count}),
        );
        Ok(count)
    }

    /// Record that `map` of `shuffle` is whole again on the processes `onto` ((slot,
    /// generation); `put` blocks were rebuilt), so a rebuild that starts over does not redo it.
    fn rebuilt_map(&self, shuffle: ShuffleId, map: u32, onto: &[(usize, u64)], put: u64) {
        let mut st = lock(&self.parity);
        st.rebuilt_blocks += put;
        if let Some(c) = st.maps.get_mut(&(shuffle, map)) {
            for &(slot, generation) in onto {
                if let Some(g) = c.generations.get_mut(slot) {
                    *g = generation;
                }
            }
        }
        drop(st);
        // The map's output is whole again where it ran, too.
        self.update_shuffle(shuffle, |e| {
            if let Some(made) = e.outputs.get_mut(&map) {
                for (slot, g) in made.holders.iter_mut() {
                    if let Some(&(_, generation)) = onto.iter().find(|(s, _)| s == slot) {
                        *g = generation;
                    }
                }
            }
        });
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
        let n = self.num_workers();
        let k = parity::pieces(n, r);
        // Each worker's blocks of this map in shard order, and its shard's length.
        let blocks: Vec<Vec<BlockMeta>> = (0..n)
            .map(|w| {
                let mut v: Vec<BlockMeta> = data
                    .iter()
                    .filter(|b| b.worker == w)
                    .map(|b| b.meta)
                    .collect();
                v.sort_by_key(|m| (m.id.partition, m.id.seq));
                v
            })
            .collect();
        let shard_lens: Vec<usize> = blocks
            .iter()
            .map(|v| v.iter().map(|m| m.bytes as usize).sum())
            .collect();
        // Surviving shards, fetched once; the lost shards' pieces as they are decoded.
        let mut shards: HashMap<usize, Vec<u8>> = HashMap::new();
        let mut rebuilt: HashMap<(usize, usize), Vec<u8>> = HashMap::new();
        let mut put_on: HashMap<usize, u32> = HashMap::new();
        for (s, stripe) in parity::stripes(n, r)?.iter().enumerate() {
            let lost_members: Vec<usize> = (0..stripe.members.len())
                .filter(|&i| lost.contains(&stripe.members[i].0))
                .collect();
            let lost_parity: Vec<usize> = (0..r as usize)
                .filter(|&j| lost.contains(&stripe.parity[j]))
                .collect();
            let lens: Vec<usize> = stripe
                .members
                .iter()
                .map(|&(w, j)| parity::piece(shard_lens[w], k, j).len())
                .collect();
            if (lost_members.is_empty() && lost_parity.is_empty()) || lens.iter().all(|&l| l == 0) {
                continue; // nothing lost here, or nothing in it (and no parity either)
            }
            let mut present = Vec::new();
            for (i, &(w, j)) in stripe.members.iter().enumerate() {
                if lost_members.contains(&i) {
                    continue;
                }
                if let std::collections::hash_map::Entry::Vacant(e) = shards.entry(w) {
                    e.insert(self.fetch_shard(w, &blocks[w]).await?);
                }
                let shard = &shards[&w];
                present.push((i, shard[parity::piece(shard.len(), k, j)].to_vec()));
            }
            let mut parity_pieces = Vec::new();
            for j in (0..r as usize).filter(|j| !lost_parity.contains(j)) {
                if parity_pieces.len() == lost_members.len() {
                    break;
                }
                let seq = parity::parity_seq(s, r, j);
                let p = coded
                    .parity
                    .iter()
                    .find(|b| b.meta.id.seq == seq)
                    .ok_or_else(|| {
                        Error::Cluster(format!(
                            "map {map} of shuffle {shuffle}: parity piece {seq} was never stored"
                        ))
                    })?;
                let (_, bytes) = self.worker(p.worker)?.get_raw(p.meta.id).await?;
                parity_pieces.push((j, bytes.to_vec()));
            }
            let decoded = parity::decode(&lens, r, &present, &parity_pieces)
                .map_err(|e| Error::Cluster(format!("map {map} of shuffle {shuffle}: {e}")))?;
            if !lost_parity.is_empty() {
                // The whole stripe is at hand now: its lost parity pieces are encoded again.
                let mut all = vec![Vec::new(); lens.len()];
                for (i, p) in present.into_iter().chain(decoded.iter().cloned()) {
                    all[i] = p;
                }
                let encoded = parity::encode(&all, r)?;
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
            for (i, p) in decoded {
                rebuilt.insert(stripe.members[i], p);
            }
        }
        // Each lost shard joined from its pieces and cut back into its blocks.
        for &w in lost {
            if shard_lens[w] == 0 {
                continue;
            }
            let mut shard = Vec::with_capacity(shard_lens[w]);
            for j in 0..k {
                match rebuilt.remove(&(w, j)) {
                    Some(p) => shard.extend_from_slice(&p),
                    None if parity::piece(shard_lens[w], k, j).is_empty() => {}
                    None => {
                        return Err(Error::Cluster(format!(
                            "map {map} of shuffle {shuffle}: piece {j} of worker {w}'s blocks \
                             was not rebuilt"
                        )))
                    }
                }
            }
            let shard = bytes::Bytes::from(shard);
            let mut at = 0usize;
            for meta in &blocks[w] {
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
                self.worker(w)?.put_raw(*meta, piece).await?;
                *put_on.entry(w).or_default() += 1;
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
