//! The driver's side of committing: merge groups (merged strategy and the holders of push
//! and two-level shuffles) and forwards (`auto`), commits of one attempt on every worker
//! holding its blocks, and cancels; plus recording the committed blocks.

use super::{BlockRef, Driver, Lineage, Made, MapDone};
use crate::block::ShuffleId;
use crate::checksum::Checksum;
use crate::error::{Error, Result};
use crate::proto;
use std::time::Duration;

impl Driver {
    /// Merge the committed outputs of `maps` held by `worker` into few large blocks per
    /// partition (merged strategy), as a new attempt of merge group `group`, and commit it: the
    /// maps' blocks are retired by the same commit. On any failure (the worker refuses once
    /// readers have started or the shuffle is sealed) the group's attempt is aborted and the
    /// maps' blocks stay readable.
    pub async fn merge(
        &self,
        shuffle: ShuffleId,
        group: u32,
        worker: usize,
        maps: Vec<u32>,
    ) -> Result<MapDone> {
        let client = self.worker(worker)?;
        // The process merging: a replacement started later does not hold the group.
        let generation = self.generation(worker);
        let attempt = self.next_attempt(shuffle, group);
        let task = proto::MergeTask {
            shuffle_id: shuffle.0,
            group,
            attempt,
            maps: maps.clone(),
            ..Default::default()
        };
        let result = match client.merge(&task).await {
            Ok(r) => r,
            Err(e) => return Err(self.classify(e).await),
        };
        let mut commit = proto::CommitTask {
            shuffle_id: shuffle.0,
            map_id: group,
            attempt,
            blocks: result.blocks.len() as u32,
            merged_maps: maps.clone(),
        };
        if let Err(e) = client.commit(&commit).await {
            commit.merged_maps.clear();
            let _ = client.cancel(&commit).await;
            return Err(self.classify(e).await);
        }
        let blocks = self.record_blocks(shuffle, worker, &result, &maps)?;
        // The maps keep their objects: a lost group comes back as its maps' own blocks.
        self.update_shuffle(shuffle, |e| {
            e.outputs.insert(
                group,
                Made {
                    worker,
                    holders: vec![(worker, generation)],
                    rows: None,
                    lineage: Lineage::Merge(maps),
                    object: None,
                },
            )
        });
        Ok(group_done(group, attempt, worker, blocks, &result))
    }

    /// Forward the committed outputs of `maps` held by `worker` unchanged to the holders
    /// `placement` names for its maps ([`crate::forward`]), as a new attempt of group `group`,
    /// and commit it: first on `worker`, which retires the maps there, then on the other
    /// holders. Until the first commit took effect any failure aborts the group everywhere and
    /// the maps stay where they are (a refusal: a reader started there, the shuffle is sealed,
    /// the maps are not held there). A commit whose reply is lost is repeated (a no-op where
    /// it took effect); if it still fails, or a holder refuses after it, rows may be half
    /// moved: [`Error::PartialCommit`] (or [`Error::WorkerLost`] when the worker is gone).
    ///
    /// No lineage is recorded for the group: a shuffle whose maps are placed on holders is not
    /// repaired in place ([`Driver::places_locally`]); the holders are added to each map's
    /// manifest entry, so losing one of them is noticed as the loss of those maps.
    pub async fn forward(
        &self,
        shuffle: ShuffleId,
        group: u32,
        worker: usize,
        maps: Vec<u32>,
        placement: super::placement::Placement,
    ) -> Result<MapDone> {
        let client = self.worker(worker)?;
        let n = self.num_workers();
        let partitions = self
            .with_shuffle(shuffle, |e| e.partitions)
            .flatten()
            .ok_or(Error::UnknownShuffle(shuffle))?;
        let attempt = self.next_attempt(shuffle, group);
        // The processes in the slots now: the forward's holders (a replacement started later
        // holds nothing of it).
        let generations: Vec<u64> = (0..n).map(|i| self.generation(i)).collect();
        let task = proto::MergeTask {
            shuffle_id: shuffle.0,
            group,
            attempt,
            maps: maps.clone(),
            push_peers: self.addresses(),
            push_to: (0..partitions)
                .map(|p| placement.holder(worker, p, n) as u32)
                .collect(),
            worker_index: worker as u32,
        };
        let cancel = proto::CommitTask {
            shuffle_id: shuffle.0,
            map_id: group,
            attempt,
            blocks: 0,
            merged_maps: vec![],
        };
        let everywhere: Vec<usize> = (0..n).collect();
        let result = match client.merge(&task).await {
            Ok(r) => r,
            Err(e) => {
                self.cancel_on(&everywhere, &cancel).await;
                return Err(self.classify(e).await);
            }
        };
        // What the worker reported is checked before anything commits.
        let mut holders = Vec::new();
        let mut problem = None;
        for p in &result.pushed {
            if p.worker as usize >= n || p.worker as usize == worker {
                problem = Some(format!(
                    "it reported blocks pushed to worker {}, which is not another worker of \
                     the {n} (it ran on {worker})",
                    p.worker
                ));
            }
            holders.push((p.worker as usize, p.blocks.len() as u32));
        }
        let metas = result
            .blocks
            .iter()
            .chain(result.pushed.iter().flat_map(|p| &p.blocks));
        if let Some(Err(e)) = metas
            .map(crate::block::BlockMeta::try_from)
            .find(|m| m.is_err())
        {
            problem = Some(format!("it reported malformed blocks: {e}"));
        }
        if let Some(problem) = problem {
            self.cancel_on(&everywhere, &cancel).await;
            return Err(Error::Cluster(format!(
                "forward of group {group}: {problem}"
            )));
        }
        let here = proto::CommitTask {
            blocks: result.blocks.len() as u32,
            merged_maps: maps.clone(),
            ..cancel.clone()
        };
        let mut tries = 0;
        while let Err(e) = client.commit(&here).await {
            // Refused: it did not take effect (a repeat of one that did is a no-op).
            let refused = matches!(
                e,
                Error::Remote {
                    code: tonic::Code::FailedPrecondition
                        | tonic::Code::InvalidArgument
                        | tonic::Code::NotFound,
                    ..
                }
            );
            tries += 1;
            if refused {
                self.cancel_on(&everywhere, &cancel).await;
                return Err(self.classify(e).await);
            }
            if tries == 3 {
                return Err(match self.classify(e).await {
                    lost @ Error::WorkerLost { .. } => lost,
                    e => Error::PartialCommit {
                        map: group,
                        attempt,
                        reason: format!("forwarded; its commit where it ran is unknown: {e}"),
                    },
                });
            }
            tokio::time::sleep(Duration::from_millis(100 * tries)).await;
        }
        let half = |e: Error| Error::PartialCommit {
            map: group,
            attempt,
            reason: format!("forwarded, then not committed on a holder: {e}"),
        };
        // In the manifest before the holders commit: from the first commit on, a lost holder
        // may hold rows of these maps.
        {
            let held: Vec<(usize, u64)> = holders
                .iter()
                .map(|&(w, _)| (w, generations.get(w).copied().unwrap_or(u64::MAX)))
                .collect();
            self.update_shuffle(shuffle, |e| {
                for m in &maps {
                    if let Some(made) = e.outputs.get_mut(m) {
                        made.held_on(held.iter().copied());
                        // Its blocks move under the group's id: its object no longer says
                        // where they are, so a loss is recovered as without a store.
                        made.object = None;
                    }
                }
            });
        }
        self.commit_on_holders(&holders, &cancel, true, false)
            .await
            .map_err(half)?;
        let mut blocks = self
            .record_blocks(shuffle, worker, &result, &maps)
            .map_err(half)?;
        for p in &result.pushed {
            let pushed = proto::TaskResult {
                blocks: p.blocks.clone(),
                ..Default::default()
            };
            let at = p.worker as usize;
            blocks.extend(
                self.record_blocks(shuffle, at, &pushed, &[])
                    .map_err(half)?,
            );
        }
        Ok(group_done(group, attempt, worker, blocks, &result))
    }

    /// The blocks of `shuffle` readers see now (parity excluded): the committed maps' not
    /// merged or forwarded since, and the merge groups' and forwards'.
    pub fn live_blocks(&self, shuffle: ShuffleId) -> usize {
        self.with_shuffle(shuffle, |e| {
            e.blocks
                .iter()
                .filter(|b| b.meta.id.partition != crate::parity::PARITY)
                .count()
        })
        .unwrap_or(0)
    }

    /// The live blocks of `shuffle` (parity excluded) held by worker slot `worker`.
    pub fn live_blocks_on(&self, shuffle: ShuffleId, worker: usize) -> usize {
        self.with_shuffle(shuffle, |e| {
            e.blocks
                .iter()
                .filter(|b| b.worker == worker && b.meta.id.partition != crate::parity::PARITY)
                .count()
        })
        .unwrap_or(0)
    }

    /// Record the blocks a committed attempt on `worker` reported, replacing the refs of the
    /// maps it `retired` there (a merge group's maps); returns the new refs.
    pub(super) fn record_blocks(
        &self,
        shuffle: ShuffleId,
        worker: usize,
        result: &proto::TaskResult,
        retired: &[u32],
    ) -> Result<Vec<BlockRef>> {
        let blocks = result
            .blocks
            .iter()
            .map(|m| {
                Ok(BlockRef {
                    meta: m.try_into()?,
                    worker,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.update_shuffle(shuffle, |e| {
            if !retired.is_empty() {
                e.blocks
                    .retain(|b| !(b.worker == worker && retired.contains(&b.meta.id.map)));
            }
            e.blocks.extend(blocks.iter().copied());
        });
        Ok(blocks)
    }

    /// Commit one claimed attempt on each `(worker, blocks)` holder.
    ///
    /// A commit either gets a definitive answer from its worker (done, or refused: it did not
    /// take effect) or its outcome is unknown (the reply was lost: the commit may have taken
    /// effect). Committing the same attempt again is a no-op on a worker that has it and
    /// answers what the worker committed, so an unknown outcome is asked again, up to
    /// [`COMMIT_TRIES`] times. The claim is released (another attempt may commit) only when no
    /// holder can have committed: every holder refused, or those whose outcome stayed unknown
    /// are lost with their process replaced (whatever they committed is gone with it), and
    /// none `committed_elsewhere` (as a forward's origin has). Otherwise the claim stays, so no
    /// second attempt can ever commit rows the first may have committed, and a holder that
    /// refuses after another committed, or stays unknown, fails the shuffle
    /// ([`Error::PartialCommit`]) — unless the attempt is `stored`: its object in the store
    /// holds every block, so when the holders left uncommitted are only lost ones (their
    /// processes replaced, none refused, none unknown on a live process), the commit counts:
    /// the lost holders' blocks come back from the store like any lost holder's
    /// ([`Driver::restore_stored`]).
    pub(super) async fn commit_on_holders(
        &self,
        holders: &[(usize, u32)],
        attempt: &proto::CommitTask,
        committed_elsewhere: bool,
        stored: bool,
    ) -> Result<()> {
        let (shuffle, map) = (ShuffleId(attempt.shuffle_id), attempt.map_id);
        // The process in each holder's slot now: a later generation holds nothing of it.
        let generations: Vec<(usize, u64)> = holders
            .iter()
            .map(|&(w, _)| (w, self.generation(w)))
            .collect();
        let gone = |w: usize| {
            generations
                .iter()
                .any(|&(s, g)| s == w && self.generation(s) != g)
        };
        let mut left: Vec<(usize, u32)> = holders.to_vec();
        let mut committed_any = committed_elsewhere;
        let mut refused = None;
        let mut last = None;
        for round in 0..COMMIT_TRIES {
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(100 * round as u64)).await;
            }
            let calls = left.iter().map(|&(w, blocks)| {
                let commit = proto::CommitTask {
                    blocks,
                    ..attempt.clone()
                };
                let client = self.worker(w);
                async move {
                    let r = match client {
                        Ok(c) => c.commit(&commit).await,
                        Err(e) => Err(e),
                    };
                    (w, blocks, r)
                }
            });
            let mut unknown = Vec::new();
            for (w, blocks, r) in futures::future::join_all(calls).await {
                match r {
                    Ok(()) => committed_any = true,
                    Err(e) if is_refusal(&e) => refused = Some(e),
                    Err(e) => {
                        unknown.push((w, blocks));
                        last = Some(e);
                    }
                }
            }
            left = unknown;
            if left.is_empty() {
                break;
            }
            // Stop asking holders whose process is gone (found lost, being replaced).
            if let Some(e) = last.take() {
                last = Some(self.classify(e).await);
                if left.iter().all(|&(w, _)| gone(w)) {
                    break;
                }
            }
        }
        // Unknown outcomes on live processes: the commit may have taken effect there.
        let maybe = left.iter().any(|&(w, _)| !gone(w));
        match (refused, last) {
            (None, _) if left.is_empty() => Ok(()),
            (None, _) if stored && committed_any && !maybe => {
                tracing::warn!(
                    %shuffle, map, lost = ?left.iter().map(|(w, _)| w).collect::<Vec<_>>(),
                    "map committed on its live holders; the lost ones' blocks come back from the store"
                );
                Ok(())
            }
            (refused, last) if !committed_any && !maybe => {
                // Nothing readable was committed anywhere: another attempt may commit.
                self.update_shuffle(shuffle, |e| e.claims.remove(&map));
                let err = refused.or(last).unwrap_or_else(|| {
                    Error::Cluster(format!("map {} was not committed", attempt.map_id))
                });
                Err(self.classify(err).await)
            }
            (refused, last) => {
                let err = last.or(refused).map(|e| e.to_string()).unwrap_or_default();
                if maybe {
                    // Kept claimed for good: `uncommitted` never hands this map out again.
                    self.update_shuffle(shuffle, |e| e.uncertain.insert(map));
                }
                let reason = if maybe {
                    format!("its commit outcome is unknown on a live worker: {err}")
                } else {
                    err
                };
                Err(Error::PartialCommit {
                    map: attempt.map_id,
                    attempt: attempt.attempt,
                    reason,
                })
            }
        }
    }

    /// Abort an attempt on `workers` (best effort: its blocks there are removed; pending
    /// blocks a worker still holds are dropped at the seal anyway).
    pub(super) async fn cancel_on(&self, workers: &[usize], cancel: &proto::CommitTask) {
        let calls = workers
            .iter()
            .filter(|&&w| self.is_alive(w))
            .filter_map(|&w| self.worker(w).ok())
            .map(|c| async move { c.cancel(cancel).await });
        futures::future::join_all(calls).await;
    }
}

/// Times a commit whose outcome is unknown (its reply lost) is asked again.
pub const COMMIT_TRIES: usize = 5;

/// Whether a failed commit was refused by its worker (a definitive answer: it did not take
/// effect there) rather than lost on the way (it may have).
fn is_refusal(e: &Error) -> bool {
    matches!(
        e,
        Error::Remote {
            code: tonic::Code::FailedPrecondition
                | tonic::Code::InvalidArgument
                | tonic::Code::NotFound,
            ..
        }
    )
}

/// A committed merge group (or forward) as the map side reports it.
fn group_done(
    group: u32,
    attempt: u32,
    worker: usize,
    blocks: Vec<BlockRef>,
    result: &proto::TaskResult,
) -> MapDone {
    MapDone {
        map: group,
        attempt,
        worker,
        blocks,
        input: Checksum {
            rows: result.input_rows,
            sum: 0,
        },
        input_bytes: result.input_bytes,
        spilled_bytes: result.spilled_bytes,
        admission_wait_seconds: result.admission_wait_seconds,
        committed_at: std::time::Instant::now(),
    }
}
