//! Merged shuffle (Riffle; Exoshuffle §3.2.2, ES-merge): maps run as in [`super::pull`]; as
//! their outputs commit, each worker merges the small outputs it holds into few large blocks
//! per partition once F of them are there (F from their block sizes, so merged blocks are a few
//! MiB), one merge at a time per worker, beside the maps still running. After the last map,
//! what is left on each worker is merged best-effort: merges still running after
//! `merge_timeout` are abandoned and readers read those maps' own blocks (stragglers never hold
//! the shuffle back). Then the shuffle is sealed, and each reducer reads a few large blocks per
//! worker instead of one small block per map.
//!
//! Merges happen before any reader starts: the block store refuses a merge once a reader has
//! listed a partition, and retires the merged maps' blocks in the same step that commits the
//! group, so a reader sees a map's rows in its own blocks or in its group's, never both. Where
//! readers stream during the map side (pipelined SQL stages), the first merge is refused before
//! it does any work and the strategy stops merging: it then reads like `pull`.

use super::options::StrategyOptions;
use super::pull;
use crate::driver::{Driver, MapDone, MapInput, ShuffleSpec};
use crate::error::{Error, Result};
use crate::store::MERGE_GROUP_BASE;
use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Merged blocks aim at this size: F = this / the average block size of the waiting maps.
pub const MERGE_TARGET_BYTES: u64 = 4 << 20;
/// At most this many maps in one merge.
pub const MAX_FAN_IN: usize = 256;
/// At most about this many bytes of map output in one merge (a merge of packed blocks holds
/// its inputs decoded while it cuts them).
pub const MAX_MERGE_BYTES: u64 = 128 << 20;

/// One committed map output waiting on its worker to be merged.
struct Waiting {
    map: u32,
    /// Pieces of partitions: a block of one partition is one, a packed block one per
    /// partition it holds rows of (at most its rows).
    blocks: u64,
    bytes: u64,
}

/// The map side of a merged shuffle: maps, merges as they become worthwhile, best-effort
/// merges of the rest, then the seal. Merge groups are reported in [`pull::Mapped::merges`].
pub async fn map_side(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<pull::Mapped> {
    if opts.pack {
        driver.pack_maps(spec.id);
    }
    let (tx, rx) = mpsc::unbounded_channel::<MapDone>();
    let maps = pull::run_maps_observed(driver, spec, inputs, 0, opts, move |done| {
        let _ = tx.send(done.clone());
    });
    let commits = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
    let (mut mapped, merges) =
        futures::future::try_join(maps, merge(driver, spec, commits, opts)).await?;
    mapped.merges = merges;
    pull::seal(driver, spec, opts).await?;
    Ok(mapped)
}

/// How many waiting maps make a merge on a worker: enough for blocks of about
/// [`MERGE_TARGET_BYTES`] (within [`MAX_FAN_IN`] and [`MAX_MERGE_BYTES`]); None when the maps'
/// blocks are that large already.
fn fan_in(waiting: &[Waiting]) -> Option<usize> {
    let blocks: u64 = waiting.iter().map(|w| w.blocks).sum();
    let bytes: u64 = waiting.iter().map(|w| w.bytes).sum();
    if blocks == 0 {
        return None;
    }
    let avg = (bytes / blocks).max(1);
    let per_map = (bytes / waiting.len() as u64).max(1);
    let by_bytes = ((MAX_MERGE_BYTES / per_map) as usize).max(2);
    (avg * 2 <= MERGE_TARGET_BYTES).then(|| {
        ((MERGE_TARGET_BYTES / avg) as usize)
            .clamp(2, MAX_FAN_IN)
            .min(by_bytes)
    })
}

/// Merge committed map outputs (and forwards, [`crate::forward`]) on the workers holding them
/// while `commits` delivers them; once it closes (all maps done), merge what is left within
/// `opts.merge_timeout`.
pub(super) async fn merge(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    commits: impl Stream<Item = MapDone> + Unpin,
    opts: StrategyOptions,
) -> Result<Vec<(MapDone, Vec<u32>)>> {
    let n = driver.num_workers();
    let mut waiting: Vec<Vec<Waiting>> = (0..n).map(|_| Vec::new()).collect();
    let mut busy = vec![false; n];
    let mut running = FuturesUnordered::new();
    let mut merges = Vec::new();
    let mut next_group = MERGE_GROUP_BASE;
    let mut maps_done = false;
    let mut commits = commits.fuse();
    let mut deadline = None;
    loop {
        // Start a merge on each idle worker that has enough waiting (after the last map: any
        // two or more).
        for w in 0..n {
            let enough = match fan_in(&waiting[w]) {
                Some(f) if !maps_done => waiting[w].len() >= f,
                Some(_) => waiting[w].len() >= 2,
                None => {
                    waiting[w].clear(); // blocks already large: nothing to gain
                    false
                }
            };
            if busy[w] || !enough {
                continue;
            }
            let take = fan_in(&waiting[w])
                .unwrap_or(MAX_FAN_IN)
                .min(waiting[w].len());
            let maps: Vec<u32> = waiting[w].drain(..take).map(|m| m.map).collect();
            busy[w] = true;
            let group = next_group;
            next_group += 1;
            running.push(async move {
                let r = driver.merge(spec.id, group, w, maps.clone()).await;
                (w, maps, r)
            });
        }
        if maps_done && running.is_empty() {
            return Ok(merges);
        }
        let timeout = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            done = commits.next(), if !maps_done => match done {
                // A map's blocks wait on each worker holding some (where it ran, where it
                // pushed them, or where it was forwarded).
                Some(d) => {
                    let mut held: std::collections::BTreeMap<usize, (u64, u64)> = Default::default();
                    for b in &d.blocks {
                        let h = held.entry(b.worker).or_default();
                        h.0 += match b.meta.id.partition {
                            crate::packed::PACKED => b.meta.rows.min(spec.partitions as u64),
                            _ => 1,
                        };
                        h.1 += b.meta.bytes;
                    }
                    for (w, (blocks, bytes)) in held {
                        if let Some(list) = waiting.get_mut(w) {
                            list.push(Waiting { map: d.map, blocks, bytes });
                        }
                    }
                }
                None => {
                    maps_done = true;
                    deadline = Some(tokio::time::Instant::now() + opts.merge_timeout);
                }
            },
            Some((w, maps, result)) = running.next(), if !running.is_empty() => {
                busy[w] = false;
                match result {
                    Ok(group) => merges.push((group, maps)),
                    // A lost worker fails the shuffle, unless the maps run again in place or
                    // come back from the store (the map runner does either); any other
                    // failure leaves the maps' own blocks in place (best effort).
                    Err(Error::WorkerLost { .. })
                        if opts.recover
                            && driver.replaces_workers()
                            && (driver.places_locally(spec.id) || driver.is_durable(spec.id)) =>
                    {
                        tracing::warn!(shuffle = %spec.id, worker = w, "merge lost with its worker");
                        if let Some(list) = waiting.get_mut(w) {
                            list.clear();
                        }
                    }
                    Err(e @ Error::WorkerLost { .. }) => return Err(e),
                    // Readers started (a pipelined consumer) or the shuffle was sealed: no
                    // later merge can commit either, so stop trying.
                    Err(Error::Remote { code: tonic::Code::FailedPrecondition, .. }) => {
                        tracing::info!(shuffle = %spec.id, "merges refused: readers started");
                        return Ok(merges);
                    }
                    Err(e) => tracing::warn!(shuffle = %spec.id, worker = w, error = %e, "merge skipped"),
                }
            }
            _ = timeout => {
                tracing::info!(shuffle = %spec.id, abandoned = running.len(), "merge timeout: reading unmerged blocks");
                return Ok(merges);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(n: usize, bytes_per_block: u64) -> Vec<Waiting> {
        (0..n as u32)
            .map(|map| Waiting {
                map,
                blocks: 16,
                bytes: 16 * bytes_per_block,
            })
            .collect()
    }

    #[test]
    fn fan_in_follows_block_sizes() {
        assert_eq!(fan_in(&waiting(3, 256 << 10)), Some(16));
        assert_eq!(fan_in(&waiting(3, 1 << 20)), Some(4));
        assert_eq!(fan_in(&waiting(3, 1)), Some(MAX_FAN_IN));
        assert_eq!(
            fan_in(&waiting(3, 3 << 20)),
            None,
            "large blocks are not merged"
        );
        assert_eq!(fan_in(&[]), None);
        // Packed maps of 100 MB in 1000 pieces: the merge would hold too much; two at a time.
        let packed = |n: u32| Waiting {
            map: n,
            blocks: 1000,
            bytes: 100 << 20,
        };
        assert_eq!(fan_in(&[packed(0), packed(1), packed(2)]), Some(2));
    }
}
