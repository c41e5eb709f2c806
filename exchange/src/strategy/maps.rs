//! The map-task runner every strategy uses: map tasks spread over the least-loaded live
//! workers (at most `maps_per_worker` each at once), speculative copies of stragglers, health
//! checks while they run, and, where readers start after the seal, maps lost with their worker
//! run again in place. Strategies decide what happens to the committed outputs
//! ([`crate::strategy`]); this module only runs the tasks.

use super::options::StrategyOptions;
use super::speculation::Speculator;
use crate::checksum::Checksum;
use crate::compute::AbortOnDrop;
use crate::driver::{count_loss, MAX_RERUNS};
use crate::driver::{Driver, MapDone, MapInput, ShuffleSpec};
use crate::error::Result;
use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// The map side's outcome: every map's blocks and the checksum of all input rows.
#[derive(Debug, Clone)]
pub struct Mapped {
    /// Every committed map, in map order.
    pub maps: Vec<MapDone>,
    /// Rows and checksum of all the maps' input.
    pub input: Checksum,
    /// Bytes of all the maps' input.
    pub input_bytes: u64,
    /// When the first map output was committed.
    pub first_commit: Option<std::time::Instant>,
    /// Merge groups committed by the merging strategies (merged, push, two-level, `auto`
    /// picking one), each with the maps (or forwards) whose blocks it replaced on its worker;
    /// empty for pull.
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
}

/// `inputs` in order, those from the `first`-th on only once `gate` reads true (or its sender
/// is gone). `auto` holds the maps after its first wave until it has chosen; online rounds by
/// completion hold the maps after their first wave until the first round is folded.
pub(crate) fn held_after<S>(
    inputs: S,
    first: usize,
    gate: tokio::sync::watch::Receiver<bool>,
) -> impl futures::Stream<Item = S::Item>
where
    S: futures::Stream,
{
    use futures::StreamExt;
    inputs.enumerate().then(move |(i, input)| {
        let mut gate = gate.clone();
        async move {
            if i >= first {
                // A closed gate (its sender dropped) lets every input through.
                let _ = gate.wait_for(|open| *open).await;
            }
            input
        }
    })
}

/// [`super::pull::run_maps`], calling `on_commit` with each map output as the driver commits it.
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
    // Maps running at once, once `done` maps have committed (one per worker first, if asked).
    let cap = |done: usize| {
        if opts.first_wave_alone && done < n {
            n
        } else {
            limit
        }
    };
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
    let mut tick = crate::driver::ticker(std::time::Duration::from_millis(100));
    // In-place recovery: each map's input for another attempt, and its attempts lost so far.
    // A parity shuffle rebuilds the blocks a lost worker held from parity instead
    // ([`Driver::rebuild`]); its attempts that pushed to the lost worker run again.
    let coded = driver.parity_of(spec.id) > 0;
    let replacements_at_start = driver.replacements();
    // Maps that push their blocks to other workers (parity, or a durable push or two-level
    // shuffle) lose an attempt with any peer it pushed to, and a lost output comes back
    // whole (rebuilt or restored) or the shuffle runs again: it never runs again alone.
    let durable = driver.is_durable(spec.id);
    let pushes = coded || !driver.places_locally(spec.id);
    let recover = |driver: &Driver| {
        opts.recover
            && driver.replaces_workers()
            && (coded || durable || driver.places_locally(spec.id))
    };
    let mut again: HashMap<u32, MapInput> = HashMap::new();
    let mut lost_attempts: HashMap<u32, usize> = HashMap::new();
    let mut health = crate::driver::ticker(driver.config().health_interval);
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
                    if coded {
                        // Rebuilt, never run again (the survivors hold the committed attempt).
                        driver.rebuild(spec.id).await?;
                    } else {
                        // Durable: restored from the store, never run again.
                        driver.restore_in_place(spec.id).await?;
                        let done: Vec<u32> = done_maps.iter().copied().collect();
                        for (map, input) in driver.forget_outputs(spec.id, &done)? {
                            done_maps.remove(&map);
                            out.maps.retain(|d| d.map != map);
                            tracing::warn!(shuffle = %spec.id, map, "map output lost with its worker: running it again");
                            start!(map, input);
                        }
                    }
                }};
            }
            if inputs_done && running.is_empty() {
                // Outputs lost since they committed (a loss noticed elsewhere, whose
                // replacement is up already) run again before the map side ends.
                let done: Vec<u32> = done_maps.iter().copied().collect();
                let lost = driver.lost_outputs(spec.id);
                if recover(driver) && coded && !driver.coded_losses(spec.id).is_empty() {
                    rerun_lost!();
                    continue;
                }
                if recover(driver) && driver.any_lost(spec.id, &done) {
                    for (m, _, _) in &lost {
                        count_loss(&mut lost_attempts, spec.id, *m)?;
                    }
                    rerun_lost!();
                    continue;
                }
                break;
            }
            tokio::select! {
                input = inputs.next(), if !inputs_done && running.len() < cap(done_maps.len()) => {
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
                        Ok(Ok(done)) if driver.generation(worker) != generation && recover(driver) && !coded => {
                            driver.wait_all_live(crate::driver::REPLACE_TIMEOUT).await?;
                            // Durable: back from the store (now, or by an earlier restore),
                            // and done.
                            driver.restore_in_place(spec.id).await?;
                            if !driver.any_lost(spec.id, &[map]) {
                                done
                            } else {
                                count_loss(&mut lost_attempts, spec.id, map)?;
                                for (m, input) in driver.forget_outputs(spec.id, &[map])? {
                                    start!(m, input);
                                }
                                continue;
                            }
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
                        // The attempt's own worker was lost (not a peer it read from), or a peer
                        // it pushed to (its error may name only the
                        // broken push): run it again elsewhere, with the outputs lost rebuilt
                        // or run again first.
                        Ok(Err(e)) if recover(driver)
                            && again.contains_key(&map)
                            && (driver.generation(worker) != generation
                                || matches!(e, crate::Error::WorkerLost { worker: w, .. } if w == worker || pushes)
                                || (pushes
                                    && (driver.replacements() != replacements_at_start
                                        || driver.check_health().await.is_err()))) =>
                        {
                            if count_loss(&mut lost_attempts, spec.id, map).is_err() {
                                return Err(e);
                            }
                            tracing::warn!(shuffle = %spec.id, map, worker, error = %e, "map attempt lost with a worker: running it again");
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

#[cfg(test)]
mod tests {
    use super::held_after;
    use futures::{FutureExt, StreamExt};

    #[tokio::test]
    async fn the_inputs_after_the_first_wait_for_the_gate() {
        let (open, gate) = tokio::sync::watch::channel(false);
        let mut held = Box::pin(held_after(futures::stream::iter(0..5u8), 2, gate));
        for want in 0..2 {
            assert_eq!(held.next().now_or_never(), Some(Some(want)));
        }
        assert!(held.next().now_or_never().is_none(), "the third waits");
        open.send(true).unwrap();
        assert_eq!(held.collect::<Vec<_>>().await, vec![2, 3, 4]);
        // A gate whose sender is gone holds nothing back.
        let (open, gate) = tokio::sync::watch::channel(false);
        drop(open);
        let all = held_after(futures::stream::iter(0..3u8), 1, gate);
        assert_eq!(all.collect::<Vec<_>>().now_or_never(), Some(vec![0, 1, 2]));
    }
}
