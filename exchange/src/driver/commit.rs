//! The driver's side of committing: merge groups (merged strategy and the holders of push
//! and two-level shuffles) and forwards (`auto`), commits of one attempt on every worker
//! holding its blocks, and cancels; plus recording the committed blocks.

use super::{lock, BlockRef, Driver, Lineage, MapDone};
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
        lock(&self.lineage).insert((shuffle, group), (worker, generation, Lineage::Merge(maps)));
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
    /// No lineage is recorded: a shuffle whose maps are placed on holders is not repaired in
    /// place ([`Driver::places_locally`]).
    pub async fn forward(
        &self,
        shuffle: ShuffleId,
        group: u32,
        worker: usize,
        maps: Vec<u32>,
        placement: crate::strategy::Placement,
    ) -> Result<MapDone> {
        let client = self.worker(worker)?;
        let n = self.num_workers();
        let partitions = lock(&self.partitions)
            .get(&shuffle)
            .copied()
            .ok_or(Error::UnknownShuffle(shuffle))?;
        let attempt = self.next_attempt(shuffle, group);
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
        self.commit_on_holders(&holders, &cancel, true)
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
        lock(&self.blocks).get(&shuffle).map_or(0, |refs| {
            refs.iter()
                .filter(|b| b.meta.id.partition != crate::parity::PARITY)
                .count()
        })
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
        let mut all = lock(&self.blocks);
        let refs = all.entry(shuffle).or_default();
        if !retired.is_empty() {
            refs.retain(|b| !(b.worker == worker && retired.contains(&b.meta.id.map)));
        }
        refs.extend(blocks.iter().copied());
        Ok(blocks)
    }

    /// Commit one claimed attempt on each `(worker, blocks)` holder. Committing the same
    /// attempt again is a no-op on a worker, so failed commits are retried. If no holder
    /// committed (and none `committed_elsewhere`, as a forward's origin has), the claim is
    /// released (another attempt may still commit); once one has, the claim stays and a
    /// holder that still refuses fails the shuffle ([`Error::PartialCommit`]): another
    /// attempt committing elsewhere could duplicate rows.
    pub(super) async fn commit_on_holders(
        &self,
        holders: &[(usize, u32)],
        attempt: &proto::CommitTask,
        committed_elsewhere: bool,
    ) -> Result<()> {
        let key = (ShuffleId(attempt.shuffle_id), attempt.map_id);
        let mut left: Vec<(usize, u32)> = holders.to_vec();
        let mut committed_any = committed_elsewhere;
        let mut last = None;
        for round in 0..3 {
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(100 * round)).await;
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
            let mut failed = Vec::new();
            for (w, blocks, r) in futures::future::join_all(calls).await {
                match r {
                    Ok(()) => committed_any = true,
                    Err(e) => {
                        failed.push((w, blocks));
                        last = Some(e);
                    }
                }
            }
            left = failed;
            // With one holder (pull, merged) there is nothing partial to repair.
            if left.is_empty() || !committed_any {
                break;
            }
        }
        let Some(err) = last.filter(|_| !left.is_empty()) else {
            return Ok(());
        };
        let err = self.classify(err).await;
        if !committed_any {
            lock(&self.claims).remove(&key);
            return Err(err);
        }
        Err(Error::PartialCommit {
            map: attempt.map_id,
            attempt: attempt.attempt,
            reason: err.to_string(),
        })
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
        committed_at: std::time::Instant::now(),
    }
}
