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

use super::placement::Placement;
use super::{Driver, Lineage, MapInput, REPLACE_TIMEOUT};
use crate::block::ShuffleId;
use crate::error::{Error, Result};
use crate::proto;
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
    /// The maps (and merge groups) of `shuffle` with blocks of their committed output on a
    /// worker lost since (where they ran, or where they pushed, merged or forwarded blocks:
    /// every holder in the manifest), with the first lost slot and how each was made.
    /// A sealed shuffle read through the store has none: its readers read only objects.
    pub fn lost_outputs(&self, shuffle: ShuffleId) -> Vec<(u32, usize, Lineage)> {
        let mut lost: Vec<(u32, usize, Lineage)> = self
            .with_shuffle(shuffle, |e| {
                if e.sealed && e.via_store {
                    return Vec::new();
                }
                e.outputs
                    .iter()
                    .filter_map(|(m, made)| {
                        let slot = made.lost_holder(|slot| self.generation(slot))?;
                        Some((*m, slot, made.lineage.clone()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        lost.sort_by_key(|(m, _, _)| *m);
        lost
    }

    /// The rows the manifest of `shuffle` lists for `partition`: the sum over its committed
    /// maps of the rows each wrote there (merges and forwards move rows, never add any). None
    /// where the manifest cannot tell: a combined shuffle (its merges combine rows) or a map
    /// that reported no per-partition rows. Exact only once the map side is complete.
    pub fn expected_rows(&self, shuffle: ShuffleId, partition: u32) -> Option<u64> {
        self.with_shuffle(shuffle, |e| {
            let (created, _) = e.created.as_ref()?;
            if created.combine.is_some() {
                return None;
            }
            let mut rows = 0u64;
            for made in e.outputs.values() {
                if matches!(made.lineage, Lineage::Merge(_)) {
                    continue;
                }
                rows += made.rows.as_ref()?.get(partition as usize).copied()?;
            }
            Some(rows)
        })
        .flatten()
    }

    /// [`Self::expected_rows`] of every partition of `shuffle`, or None if any is unknown.
    pub fn expected_rows_all(&self, shuffle: ShuffleId) -> Option<Vec<u64>> {
        let partitions = self.with_shuffle(shuffle, |e| e.partitions).flatten()?;
        (0..partitions)
            .map(|p| self.expected_rows(shuffle, p))
            .collect()
    }

    /// Whether `shuffle` deals rows by their position in a map's input (round-robin over more
    /// than one partition): a map run again on input in another order deals them otherwise,
    /// so it cannot be recomputed in place once any reader took rows of it.
    pub fn deals_by_position(&self, shuffle: ShuffleId) -> bool {
        self.with_shuffle(shuffle, |e| {
            e.created.as_ref().is_some_and(|(m, _)| {
                m.partitions > 1
                    && matches!(
                        m.partitioner.as_ref().and_then(|p| p.kind.as_ref()),
                        Some(proto::partitioner::Kind::RoundRobin(_))
                    )
            })
        })
        .unwrap_or(false)
    }

    /// Register `shuffle` on the live slots whose process was replaced since it was registered
    /// there; returns those slots.
    pub async fn register_replaced(&self, shuffle: ShuffleId) -> Result<Vec<usize>> {
        let registered = self
            .with_shuffle(shuffle, |e| {
                let (msg, generations) = e.created.as_ref()?;
                let stale: Vec<(usize, u64)> = generations
                    .iter()
                    .enumerate()
                    .filter(|&(i, g)| self.generation(i) != *g && self.is_alive(i))
                    .map(|(i, _)| (i, self.generation(i)))
                    .collect();
                Some((msg.clone(), stale))
            })
            .flatten();
        let Some((msg, stale)) = registered else {
            return Ok(Vec::new());
        };
        for &(slot, generation) in &stale {
            if let Err(e) = self.worker(slot)?.create_shuffle(&msg).await {
                return Err(self.classify(e).await);
            }
            self.update_shuffle(shuffle, |e| {
                if let Some(g) = e.created.as_mut().and_then(|(_, gs)| gs.get_mut(slot)) {
                    *g = generation;
                }
            });
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
        // Commits of the run being replaced end first (settle), and any of its attempts still
        // finishing later is refused (`floor`): a late one never takes a claim of the new run.
        self.settle().await;
        let (rank, attempts, store) = self
            .with_shuffle(spec.id, |e| {
                let rank = e.created.as_ref().map(|(m, _)| (m.order, m.group));
                (rank, e.attempts.clone(), e.store.clone())
            })
            .unwrap_or_default();
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
        self.update_shuffle(spec.id, |e| {
            e.floor = attempts.clone();
            e.attempts = attempts;
            // Durable (or not) as it was.
            e.store = store;
        });
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
        let maps = self
            .with_shuffle(shuffle, |e| e.map_placement)
            .flatten()
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
            // A durable shuffle's lost outputs come back from the store, never run again.
            self.restore_stored(shuffle).await?;
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
                .filter(|u| {
                    *u != shuffle
                        && self
                            .with_shuffle(*u, |e| e.created.is_some())
                            .unwrap_or(false)
                })
                .collect();
            for u in upstream {
                if self.repair(u).await? > 0 && self.deals_by_position(u) {
                    // The maps of this shuffle that survived read the old deal of `u`.
                    return Err(Error::Cluster(format!(
                        "round-robin shuffle {u} had map outputs recomputed after shuffle \
                         {shuffle} read it: {shuffle} must run again whole"
                    )));
                }
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
        // Every block ref of a forgotten output goes, wherever it is: the new attempt records
        // its own.
        let gone: BTreeSet<u32> = lost.iter().map(|(m, _, _)| *m).collect();
        self.update_shuffle(shuffle, |e| {
            e.blocks.retain(|b| !gone.contains(&b.meta.id.map));
            for m in &gone {
                e.claims.remove(m);
                e.outputs.remove(m);
            }
        });
        self.recomputed
            .fetch_add(reruns.len() as u64, Ordering::SeqCst);
        self.event(
            "maps_recomputed",
            || serde_json::json!({"shuffle": shuffle.to_string(), "maps": gone.len()}),
        );
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
    /// failed is cleared so a new attempt can commit. Call after [`Driver::settle`]. A map
    /// whose commit outcome is unknown on a live worker (it may have committed there) is never
    /// handed out again: that is an error, and the shuffle must run again whole.
    pub fn uncommitted(&self, shuffle: ShuffleId, maps: u32) -> Result<Vec<u32>> {
        self.update_shuffle(shuffle, |e| {
            if let Some(m) = e.uncertain.iter().min() {
                return Err(Error::PartialCommit {
                    map: *m,
                    attempt: e.claims.get(m).copied().unwrap_or_default(),
                    reason: format!(
                        "its commit outcome is unknown; shuffle {shuffle} must run again whole"
                    ),
                });
            }
            let todo: Vec<u32> = (0..maps).filter(|m| !e.outputs.contains_key(m)).collect();
            for m in &todo {
                e.claims.remove(m);
            }
            Ok(todo)
        })
    }

    /// Whether a commit of `shuffle` had an unknown outcome on a live worker (see
    /// [`Driver::uncommitted`]).
    pub fn has_uncertain_commits(&self, shuffle: ShuffleId) -> bool {
        self.with_shuffle(shuffle, |e| !e.uncertain.is_empty())
            .unwrap_or(false)
    }

    /// What the committed blocks on record of `shuffle` hold: (blocks, bytes, rows, bytes
    /// of each of its `partitions`), parity blocks left out.
    pub fn recorded(&self, shuffle: ShuffleId, partitions: u32) -> (usize, u64, u64, Vec<u64>) {
        let mut per = vec![0u64; partitions as usize];
        let (mut blocks, mut bytes, mut rows) = (0, 0, 0);
        for b in self.blocks_of(shuffle) {
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
