//! Lineage recovery (Exoshuffle §3.2): map outputs lost with their worker are recomputed from
//! the lineage the driver recorded when they committed, at new attempts, without re-running
//! the maps whose outputs survived.
//!
//! A committed output is lost when the process that held it is gone: its slot's generation
//! has moved on ([`Driver::generation`]). [`Driver::repair`] waits for the slot's replacement,
//! registers the shuffle there, recomputes each lost map on it (so the shuffle, sealed on the
//! other workers, takes no new commit there) and seals it: readers then find every partition
//! whole again, the lost worker's share now on its replacement. A map whose input was a stage
//! partition of an earlier shuffle repairs that shuffle first (a stage recomputes exactly the
//! partitions it reads), with the stage's peers updated to the replacement's address.
//!
//! Only shuffles whose blocks stay where their maps ran (pull, merged, and `auto` when it
//! picks them) are repaired in place, and parity shuffles, whose lost blocks are rebuilt from
//! parity ([`Driver::rebuild`]). Under push and two-level every map left blocks on every
//! worker, so a lost worker lost a piece of every map: the caller reruns such a shuffle whole.

use super::{lock, Driver, Lineage, MapInput, REPLACE_TIMEOUT};
use crate::block::ShuffleId;
use crate::error::{Error, Result};
use crate::proto;
use crate::strategy::Placement;
use futures::future::BoxFuture;
use futures::StreamExt;
use prost::Message;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The task kind whose payload is a [`proto::SourceInput`] (Python map tasks, which may read a
/// partition of an earlier stage).
const STAGE_KIND: &str = "python";

impl Driver {
    /// The maps (and merge groups) of `shuffle` whose committed output was on a worker lost
    /// since, with the slot that held it and how it was made.
    pub fn lost_outputs(&self, shuffle: ShuffleId) -> Vec<(u32, usize, Lineage)> {
        let mut lost: Vec<(u32, usize, Lineage)> = lock(&self.lineage)
            .iter()
            .filter(|((s, _), (w, g, _))| *s == shuffle && self.generation(*w) != *g)
            .map(|((_, m), (w, _, l))| (*m, *w, l.clone()))
            .collect();
        lost.sort_by_key(|(m, _, _)| *m);
        lost
    }

    /// Register `shuffle` on the live slots whose process was replaced since it was registered
    /// there; returns those slots.
    pub async fn register_replaced(&self, shuffle: ShuffleId) -> Result<Vec<usize>> {
        let (msg, stale) = {
            let created = lock(&self.created);
            let Some((msg, generations)) = created.get(&shuffle) else {
                return Ok(Vec::new());
            };
            let stale: Vec<(usize, u64)> = generations
                .iter()
                .enumerate()
                .filter(|&(i, g)| self.generation(i) != *g && self.is_alive(i))
                .map(|(i, _)| (i, self.generation(i)))
                .collect();
            (msg.clone(), stale)
        };
        for &(slot, generation) in &stale {
            if let Err(e) = self.worker(slot)?.create_shuffle(&msg).await {
                return Err(self.classify(e).await);
            }
            if let Some((_, generations)) = lock(&self.created).get_mut(&shuffle) {
                if let Some(g) = generations.get_mut(slot) {
                    *g = generation;
                }
            }
            tracing::info!(%shuffle, worker = slot, "shuffle registered on a replacement");
        }
        Ok(stale.into_iter().map(|(s, _)| s).collect())
    }

    /// Register `spec` again from scratch, to run it again after a lost worker: its blocks
    /// are dropped everywhere and its attempt numbers go on (a late put of an old attempt can
    /// never pass for a new one's).
    pub async fn restart_shuffle(&self, spec: &crate::driver::ShuffleSpec) -> Result<()> {
        // Registered again where it stood: with a new, higher order a restarted producer
        // could wait behind its own consumers on a worker's admission.
        let rank = lock(&self.created)
            .get(&spec.id)
            .map(|(m, _)| (m.order, m.group));
        let attempts: Vec<_> = lock(&self.attempts)
            .iter()
            .filter(|((s, _), _)| *s == spec.id)
            .map(|(k, v)| (*k, *v))
            .collect();
        let dropped = match self.drop_shuffle(spec.id).await {
            Err(e) => Err(self.classify(e).await),
            ok => ok,
        };
        match dropped {
            Ok(())
            | Err(Error::WorkerLost { .. })
            | Err(Error::Remote {
                code: tonic::Code::NotFound,
                ..
            }) => {}
            Err(e) => return Err(e),
        }
        lock(&self.attempts).extend(attempts);
        match rank {
            Some((order, group)) => self.register(spec, order, group).await,
            None => self.create_shuffle(spec).await,
        }
    }

    /// Worker slots whose generation differs from `generations` (replaced since then).
    pub fn replaced_since(&self, generations: &[u64]) -> Vec<usize> {
        (0..self.num_workers())
            .filter(|&w| generations.get(w) != Some(&self.generation(w)))
            .collect()
    }

    /// Run again, on live workers, the outputs of `maps` that were lost with their worker
    /// (once the replacements are up and know the shuffle), and put the new outputs in their
    /// place in `maps`; returns how many ran again.
    pub async fn rerun_lost(
        self: &Arc<Self>,
        shuffle: ShuffleId,
        maps: &mut [crate::driver::MapDone],
    ) -> Result<usize> {
        self.wait_all_live(REPLACE_TIMEOUT).await?;
        self.register_replaced(shuffle).await?;
        let ids: Vec<u32> = maps.iter().map(|d| d.map).collect();
        let n = self.num_workers();
        let runs = self
            .forget_outputs(shuffle, &ids)?
            .into_iter()
            .map(|(m, input)| self.submit_map(shuffle, m, m as usize % n, input));
        let mut count = 0;
        for r in futures::future::join_all(runs).await {
            let d =
                r.map_err(|e| Error::Cluster(format!("recomputed map failed to run: {e}")))??;
            for slot in maps.iter_mut().filter(|x| x.map == d.map) {
                *slot = d.clone();
            }
            count += 1;
        }
        Ok(count)
    }

    /// Whether `shuffle`'s maps leave their blocks where they ran (and readers read them
    /// there): only then can a lost map output run again on its own.
    pub fn places_locally(&self, shuffle: ShuffleId) -> bool {
        let placement = self.placement(shuffle);
        let maps = lock(&self.map_placements)
            .get(&shuffle)
            .copied()
            .unwrap_or(placement);
        placement == Placement::Local && maps == Placement::Local
    }

    /// Whether the output of any of `maps` of `shuffle` was lost with its worker.
    pub fn any_lost(&self, shuffle: ShuffleId, maps: &[u32]) -> bool {
        self.lost_outputs(shuffle)
            .iter()
            .any(|(m, _, _)| maps.contains(m))
    }

    /// Map outputs run again because their worker was lost, over all shuffles.
    pub fn recomputed_maps(&self) -> u64 {
        self.recomputed.load(Ordering::SeqCst)
    }

    /// Recompute the outputs of `shuffle` lost with their workers (see the module doc) and
    /// seal it on the replacements; returns how many maps ran again.
    pub fn repair(self: &Arc<Self>, shuffle: ShuffleId) -> BoxFuture<'_, Result<usize>> {
        Box::pin(async move {
            self.wait_all_live(REPLACE_TIMEOUT).await?;
            if self.parity_of(shuffle) > 0 {
                // Rebuilt from parity, no map runs again.
                let maps = self.rebuild(shuffle).await?;
                self.seal(shuffle).await?;
                return Ok(maps);
            }
            let lost = self.lost_outputs(shuffle);
            if !lost.is_empty() && !self.places_locally(shuffle) {
                return Err(Error::Cluster(format!(
                    "shuffle {shuffle} lost blocks of every map with its worker (its maps \
                     pushed them to all workers): it must run again"
                )));
            }
            let maps: Vec<u32> = lost.iter().map(|(m, _, _)| *m).collect();
            let reruns: Vec<(u32, usize, MapInput)> = self
                .forget_outputs(shuffle, &maps)?
                .into_iter()
                .map(|(m, input)| {
                    let slot = lost.iter().find(|(l, _, _)| *l == m).map_or(0, |l| l.1);
                    (m, slot, input)
                })
                .collect();
            // Earlier stages these maps read, repaired first.
            let upstream: BTreeSet<ShuffleId> = reruns
                .iter()
                .filter_map(|(_, _, i)| upstream_of(i))
                .filter(|u| *u != shuffle && lock(&self.created).contains_key(u))
                .collect();
            for u in upstream {
                self.repair(u).await?;
            }
            // Every replaced slot gets the shuffle (even one that held none of its blocks,
            // so readers find it there) and the lost maps' new outputs.
            let slots = self.register_replaced(shuffle).await?;
            if !reruns.is_empty() {
                tracing::warn!(%shuffle, maps = reruns.len(), ?slots, "recomputing map outputs lost with their worker");
            }
            let count = reruns.len();
            let runs = reruns
                .into_iter()
                .map(|(map, slot, input)| self.submit_map(shuffle, map, slot, input));
            let results: Vec<_> = futures::stream::iter(runs)
                .buffer_unordered(2 * slots.len().max(1))
                .collect()
                .await;
            for r in results {
                r.map_err(|e| Error::Cluster(format!("recomputed map failed to run: {e}")))??;
            }
            // Sealed everywhere again (sealing is idempotent), the replacements included.
            self.seal(shuffle).await?;
            if count > 0 {
                tracing::warn!(%shuffle, maps = count, "lost map outputs recomputed");
            }
            Ok(count)
        })
    }

    /// Forget the outputs of `maps` of `shuffle` lost with their workers, and every lost merge
    /// group (block refs, claims, lineage), so that new attempts can commit; returns each of
    /// those maps with its input for the new attempt. An output whose input cannot be read
    /// again is an error, and nothing is forgotten.
    pub fn forget_outputs(&self, shuffle: ShuffleId, maps: &[u32]) -> Result<Vec<(u32, MapInput)>> {
        let lost: Vec<(u32, usize, Lineage)> = self
            .lost_outputs(shuffle)
            .into_iter()
            .filter(|(m, _, l)| matches!(l, Lineage::Merge(_)) || maps.contains(m))
            .collect();
        let mut reruns = Vec::new();
        for (map, slot, lineage) in &lost {
            if matches!(lineage, Lineage::Merge(_)) {
                continue;
            }
            let input = lineage.input().ok_or_else(|| {
                Error::Cluster(format!(
                    "map {map} of shuffle {shuffle} was lost with worker {slot} and cannot run \
                     again: its input was a stream the driver did not keep"
                ))
            })?;
            reruns.push((*map, self.refresh(input)));
        }
        let gone: BTreeSet<(usize, u32)> = lost.iter().map(|(m, w, _)| (*w, *m)).collect();
        if let Some(refs) = lock(&self.blocks).get_mut(&shuffle) {
            refs.retain(|b| !gone.contains(&(b.worker, b.meta.id.map)));
        }
        let mut claims = lock(&self.claims);
        let mut lineage = lock(&self.lineage);
        for (_, m) in &gone {
            claims.remove(&(shuffle, *m));
            lineage.remove(&(shuffle, *m));
        }
        self.recomputed
            .fetch_add(reruns.len() as u64, Ordering::SeqCst);
        Ok(reruns)
    }

    /// Wait (a bounded time) until no map commit is in progress: every attempt the workers
    /// committed is then in the driver's records, even one whose caller was dropped.
    pub async fn settle(&self) {
        let limit = self.config().rpc_timeout * 2;
        let _ = tokio::time::timeout(limit, self.committing.write()).await;
    }

    /// The maps among `0..maps` of `shuffle` with no committed output on record (never
    /// committed, or forgotten as lost), to run again; a claim left by an attempt whose commit
    /// failed is cleared so a new attempt can commit. Call after [`Driver::settle`].
    pub fn uncommitted(&self, shuffle: ShuffleId, maps: u32) -> Vec<u32> {
        let lineage = lock(&self.lineage);
        let mut claims = lock(&self.claims);
        (0..maps)
            .filter(|m| !lineage.contains_key(&(shuffle, *m)))
            .inspect(|m| {
                claims.remove(&(shuffle, *m));
            })
            .collect()
    }

    /// What the committed blocks on record of `shuffle` hold: (blocks, bytes, rows, bytes
    /// of each of its `partitions`), parity blocks left out.
    pub fn recorded(&self, shuffle: ShuffleId, partitions: u32) -> (usize, u64, u64, Vec<u64>) {
        let mut per = vec![0u64; partitions as usize];
        let (mut blocks, mut bytes, mut rows) = (0, 0, 0);
        for b in lock(&self.blocks).get(&shuffle).into_iter().flatten() {
            if let Some(p) = per.get_mut(b.meta.id.partition as usize) {
                *p += b.meta.bytes;
                blocks += 1;
                bytes += b.meta.bytes;
                rows += b.meta.rows;
            }
        }
        (blocks, bytes, rows, per)
    }

    /// Count a job run again whole after a lost worker (its partial results dropped).
    pub fn note_rerun(&self) {
        self.reruns.fetch_add(1, Ordering::SeqCst);
    }

    /// Jobs run again whole after lost workers, over the driver's life.
    pub fn reruns(&self) -> u64 {
        self.reruns.load(Ordering::SeqCst)
    }

    /// `input` for a new attempt: a stage partition input names the current workers (a lost
    /// worker's replacement has another address).
    pub fn refresh(&self, input: MapInput) -> MapInput {
        let MapInput::Source(mut source) = input else {
            return input;
        };
        if source.kind == STAGE_KIND {
            if let Ok(mut payload) = proto::SourceInput::decode(source.payload.as_slice()) {
                if let Some(p) = payload.partition.as_mut() {
                    p.peers = self.addresses();
                    source.payload = payload.encode_to_vec();
                }
            }
        }
        MapInput::Source(source)
    }
}

/// The earlier shuffle a stage map task reads a partition of, if any.
fn upstream_of(input: &MapInput) -> Option<ShuffleId> {
    let MapInput::Source(source) = input else {
        return None;
    };
    if source.kind != STAGE_KIND {
        return None;
    }
    let payload = proto::SourceInput::decode(source.payload.as_slice()).ok()?;
    payload.partition.map(|p| ShuffleId(p.shuffle_id))
}
