//! Pull shuffle (Exoshuffle §3.2.1): every map task writes its R blocks into the block store
//! of the worker it ran on; once all maps are done the shuffle is sealed and each reducer
//! pulls its partition — one column of the M×R block matrix — from every worker.

use super::speculation::Speculator;
use super::{AbortOnDrop, StrategyOptions};
use crate::checksum::Checksum;
use crate::driver::{Driver, MapDone, MapInput, ShuffleSpec};
use crate::error::Result;
use crate::proto;
use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// The map side's outcome: every map's blocks and the checksum of all input rows.
#[derive(Debug, Clone)]
pub struct Mapped {
    pub maps: Vec<MapDone>,
    pub input: Checksum,
    pub input_bytes: u64,
    /// When the first map output was committed.
    pub first_commit: Option<std::time::Instant>,
    /// Merge groups committed by the merged strategy, each with the maps whose blocks it
    /// replaced (empty for other strategies).
    pub merges: Vec<(MapDone, Vec<u32>)>,
}

impl Mapped {
    /// Bytes of the largest reduce partition and the median partition's (skew shows as a
    /// largest partition far above the median).
    pub fn partition_bytes(&self, partitions: u32) -> (u64, u64) {
        let mut bytes = self.bytes_per_partition(partitions);
        bytes.sort_unstable();
        let max = bytes.last().copied().unwrap_or(0);
        let median = bytes.get(bytes.len() / 2).copied().unwrap_or(0);
        (max, median)
    }

    /// Bytes of each reduce partition, summed over the committed maps' blocks (packed blocks,
    /// whose split by partition only their holder knows, are not counted).
    pub fn bytes_per_partition(&self, partitions: u32) -> Vec<u64> {
        let mut bytes = vec![0u64; partitions as usize];
        for b in self.maps.iter().flat_map(|m| &m.blocks) {
            if let Some(p) = bytes.get_mut(b.meta.id.partition as usize) {
                *p += b.meta.bytes;
            }
        }
        bytes
    }

    /// The blocks readers see now: those of maps not merged on the worker holding them, plus
    /// the merge groups'.
    pub fn live_blocks(&self) -> usize {
        let merged: std::collections::HashSet<(usize, u32)> = self
            .merges
            .iter()
            .flat_map(|(g, maps)| maps.iter().map(move |&m| (g.worker, m)))
            .collect();
        let maps: usize = self
            .maps
            .iter()
            .flat_map(|m| &m.blocks)
            .filter(|b| !merged.contains(&(b.worker, b.meta.id.map)))
            .count();
        maps + self
            .merges
            .iter()
            .map(|(g, _)| g.blocks.len())
            .sum::<usize>()
    }
}

/// Run map tasks for every input (spread over the least-loaded workers, at most
/// `maps_per_worker` each at once), then seal the shuffle. Fails on the first failed map.
pub async fn map_side(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<Mapped> {
    let out = run_maps(driver, spec, inputs, 0, opts).await?;
    driver.seal(spec.id).await?;
    Ok(out)
}

/// Run map tasks for every input, numbering them from `first_map`, without sealing.
pub async fn run_maps(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    first_map: u32,
    opts: StrategyOptions,
) -> Result<Mapped> {
    run_maps_observed(driver, spec, inputs, first_map, opts, |_| {}).await
}

/// Times one map side runs maps again after lost workers before it gives up.
const MAX_RERUNS: usize = 3;

/// [`run_maps`], calling `on_commit` with each map output as the driver commits it.
///
/// With `opts.recover` (readers start after the seal) and a driver that replaces lost
/// workers, a lost worker does not fail the map side: an attempt that failed with its worker
/// runs again on a live one, and the committed outputs the worker held ([`Driver::lost_outputs`])
/// run again from their lineage, up to [`MAX_RERUNS`] losses.
pub async fn run_maps_observed(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    first_map: u32,
    opts: StrategyOptions,
    mut on_commit: impl FnMut(&MapDone),
) -> Result<Mapped> {
    let n = driver.num_workers();
    let limit = n * opts.maps_per_worker.max(1);
    let mut load = vec![0usize; n];
    let mut running = FuturesUnordered::new();
    let mut inputs = inputs.fuse();
    let mut next_map = first_map;
    let mut out = Mapped {
        maps: Vec::new(),
        input: Checksum::default(),
        input_bytes: 0,
        first_commit: None,
        merges: Vec::new(),
    };
    let mut inputs_done = false;
    let mut speculator = opts.speculation.map(Speculator::new);
    // Attempts still running per map, to abort the others when one commits.
    let mut attempts: HashMap<u32, Vec<tokio::task::AbortHandle>> = HashMap::new();
    let mut done_maps = HashSet::new();
    let mut live_attempts: HashMap<u32, usize> = HashMap::new();
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
    // In-place recovery: each map's input for another attempt, and its attempts lost so far.
    let recover = |driver: &Driver| {
        opts.recover && driver.replaces_workers() && driver.places_locally(spec.id)
    };
    let mut again: HashMap<u32, MapInput> = HashMap::new();
    let mut lost_attempts: HashMap<u32, usize> = HashMap::new();
    let mut health = tokio::time::interval(driver.config().health_interval);
    health.tick().await;
    // Map tasks still running when this returns (a map failed) are aborted.
    let mut guard = AbortOnDrop(Vec::new());
    let least_loaded = |load: &[usize], map: u32, not: Option<usize>| {
        (0..n)
            .filter(|&w| driver.is_alive(w) && Some(w) != not)
            .min_by_key(|&w| (load[w], (w + n - map as usize % n) % n))
    };
    let work = async {
        loop {
            let submit = |map: u32, worker: usize, input: MapInput| {
                let generation = driver.generation(worker);
                let handle = driver.submit_map(spec.id, map, worker, input);
                let abort = handle.abort_handle();
                (
                    async move { (map, worker, generation, handle.await) },
                    abort,
                )
            };
            // Run `map` (again) on the least-loaded live worker.
            macro_rules! start {
                ($map:expr, $input:expr) => {{
                    let map = $map;
                    let worker = least_loaded(&load, map, None).unwrap_or(0);
                    load[worker] += 1;
                    let (fut, abort) = submit(map, worker, $input);
                    guard.0.push(abort.clone());
                    attempts.entry(map).or_default().push(abort);
                    *live_attempts.entry(map).or_default() += 1;
                    running.push(fut);
                    worker
                }};
            }
            // Committed outputs lost with their worker run again from their lineage (once a
            // live worker can take them).
            macro_rules! rerun_lost {
                () => {{
                    driver.wait_all_live(crate::driver::REPLACE_TIMEOUT).await?;
                    let done: Vec<u32> = done_maps.iter().copied().collect();
                    for (map, input) in driver.forget_outputs(spec.id, &done)? {
                        done_maps.remove(&map);
                        out.maps.retain(|d| d.map != map);
                        tracing::warn!(shuffle = %spec.id, map, "map output lost with its worker: running it again");
                        start!(map, input);
                    }
                }};
            }
            if inputs_done && running.is_empty() {
                // Outputs lost since they committed (a loss noticed elsewhere, whose
                // replacement is up already) run again before the map side ends.
                let lost = driver.lost_outputs(spec.id);
                if recover(driver) && lost.iter().any(|(m, _, _)| done_maps.contains(m)) {
                    for (m, _, _) in &lost {
                        let retries = lost_attempts.entry(*m).or_default();
                        *retries += 1;
                        if *retries > MAX_RERUNS {
                            return Err(crate::Error::Cluster(format!(
                                "map {m} of shuffle {} lost its worker {retries} times",
                                spec.id
                            )));
                        }
                    }
                    rerun_lost!();
                    continue;
                }
                break;
            }
            tokio::select! {
                input = inputs.next(), if !inputs_done && running.len() < limit => {
                    let Some(input) = input else {
                        inputs_done = true;
                        continue;
                    };
                    if opts.recover {
                        if let Some(copy) = input.again() {
                            again.insert(next_map, copy);
                        }
                    }
                    let source = match &input {
                        MapInput::Source(src) => Some(src.clone()),
                        MapInput::Stream(_) | MapInput::Kept(_) => None,
                    };
                    let worker = start!(next_map, input);
                    if let Some(s) = speculator.as_mut() {
                        s.started(next_map, worker, source);
                    }
                    next_map += 1;
                }
                Some((map, worker, generation, joined)) = running.next(), if !running.is_empty() => {
                    load[worker] -= 1;
                    let live = live_attempts.entry(map).or_insert(1);
                    *live -= 1;
                    let others_running = *live > 0;
                    let done = match joined {
                        // Committed, but on a process lost since (its result came late): the
                        // output is gone with it.
                        Ok(Ok(_)) if driver.generation(worker) != generation && recover(driver) => {
                            let retries = lost_attempts.entry(map).or_default();
                            *retries += 1;
                            if *retries > MAX_RERUNS {
                                return Err(crate::Error::Cluster(format!("map {map} lost its worker {retries} times")));
                            }
                            driver.wait_all_live(crate::driver::REPLACE_TIMEOUT).await?;
                            for (m, input) in driver.forget_outputs(spec.id, &[map])? {
                                start!(m, input);
                            }
                            continue;
                        }
                        Ok(Ok(done)) => done,
                        // The other attempt of a map that already committed.
                        _ if done_maps.contains(&map) => continue,
                        Ok(Err(crate::Error::Superseded { .. })) if others_running => continue,
                        // One attempt of a speculated map failed while another still runs:
                        // that one may still finish (a lost worker fails the stage anyway).
                        Ok(Err(e)) if others_running && !matches!(e, crate::Error::WorkerLost { .. } | crate::Error::PartialCommit { .. }) => {
                            tracing::warn!(shuffle = %spec.id, map, worker, error = %e, "one attempt of a speculated map failed; another is running");
                            continue;
                        }
                        // The attempt's own worker was lost (not a peer it read from): run it
                        // again elsewhere, with the outputs that worker held.
                        Ok(Err(e)) if recover(driver)
                            && again.contains_key(&map)
                            && (driver.generation(worker) != generation
                                || matches!(e, crate::Error::WorkerLost { worker: w, .. } if w == worker)) =>
                        {
                            let retries = lost_attempts.entry(map).or_default();
                            *retries += 1;
                            if *retries > MAX_RERUNS {
                                return Err(e);
                            }
                            tracing::warn!(shuffle = %spec.id, map, worker, error = %e, "map attempt lost with its worker: running it again");
                            rerun_lost!();
                            if let Some(input) = again.get(&map).and_then(|i| i.again()) {
                                start!(map, driver.refresh(input));
                            }
                            continue;
                        }
                        Ok(Err(e)) => return Err(e),
                        Err(e) => return Err(crate::Error::Cluster(format!("map task failed to run: {e}"))),
                    };
                    done_maps.insert(map);
                    for other in attempts.remove(&map).unwrap_or_default() {
                        other.abort();
                    }
                    if let Some(s) = speculator.as_mut() {
                        s.finished(map);
                    }
                    tracing::debug!(shuffle = %spec.id, map = done.map, worker = done.worker, rows = done.input.rows, "map done");
                    out.first_commit.get_or_insert(done.committed_at);
                    on_commit(&done);
                    out.maps.push(done);
                }
                _ = tick.tick(), if speculator.is_some() && !running.is_empty() => {
                    let copies = speculator.as_mut().map(|s| s.stragglers(Instant::now())).unwrap_or_default();
                    for (map, source, first) in copies {
                        let Some(worker) = least_loaded(&load, map, Some(first)) else { continue };
                        tracing::info!(shuffle = %spec.id, map, worker, "speculative attempt of a slow map");
                        load[worker] += 1;
                        let (fut, abort) = submit(map, worker, MapInput::Source(source));
                        guard.0.push(abort.clone());
                        attempts.entry(map).or_default().push(abort);
                        *live_attempts.entry(map).or_default() += 1;
                        running.push(fut);
                    }
                }
                // Health while the maps run: a lost worker fails the map side, or (recovering)
                // its committed outputs run again.
                _ = health.tick(), if opts.watch => {
                    if let Err(e) = driver.check_health().await {
                        if !(recover(driver) && matches!(e, crate::Error::WorkerLost { .. }) && lost_attempts.values().all(|&r| r <= MAX_RERUNS)) {
                            return Err(e);
                        }
                        rerun_lost!();
                    }
                }
                else => break,
            }
        }
        Ok(())
    };
    work.await?;
    out.maps.sort_by_key(|m| m.map);
    for d in &out.maps {
        out.input.add(d.input);
        out.input_bytes += d.input_bytes;
    }
    Ok(out)
}

/// Reduce every partition on the workers (partition p on worker p mod N), each reducer pulling
/// its blocks from all workers into `sink`. Returns the results in partition order.
pub async fn reduce_on_workers(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    sink: &str,
    opts: StrategyOptions,
) -> Result<Vec<proto::TaskResult>> {
    let n = driver.num_workers();
    let tasks = (0..spec.partitions).map(|p| {
        let worker = p as usize % n;
        async move { driver.run_reduce(spec.id, p, worker, sink).await }
    });
    let results: Vec<Result<proto::TaskResult>> = driver
        .watch(async {
            Ok(futures::stream::iter(tasks)
                .buffered(n * opts.reduces_per_worker.max(1))
                .collect()
                .await)
        })
        .await?;
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockId, BlockMeta, ShuffleId};
    use crate::driver::BlockRef;

    fn done(map: u32, sizes: &[(u32, u64)]) -> MapDone {
        let blocks = sizes
            .iter()
            .map(|&(partition, bytes)| BlockRef {
                worker: 0,
                meta: BlockMeta {
                    id: BlockId {
                        shuffle: ShuffleId(1),
                        map,
                        partition,
                        attempt: 0,
                        seq: 0,
                    },
                    rows: 1,
                    bytes,
                    crc32c: 0,
                },
            })
            .collect();
        MapDone {
            map,
            attempt: 0,
            worker: 0,
            blocks,
            input: Checksum::default(),
            input_bytes: 0,
            spilled_bytes: 0,
            committed_at: Instant::now(),
        }
    }

    #[test]
    fn partition_bytes_are_summed_over_maps() {
        let mapped = Mapped {
            maps: vec![
                done(0, &[(0, 10), (1, 5), (3, 100)]),
                done(1, &[(3, 50), (2, 7)]),
            ],
            input: Checksum::default(),
            input_bytes: 0,
            first_commit: None,
            merges: vec![],
        };
        // Partitions 0..4 hold 10, 5, 7, 150 bytes, and partition 4 none.
        assert_eq!(mapped.partition_bytes(5), (150, 7));
        assert_eq!(
            Mapped {
                maps: vec![],
                ..mapped
            }
            .partition_bytes(3),
            (0, 0)
        );
    }
}
