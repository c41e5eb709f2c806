//! Pull shuffle (Exoshuffle §3.2.1): every map task writes its R blocks into the block store
//! of the worker it ran on; once all maps are done the shuffle is sealed and each reducer
//! pulls its partition — one column of the M×R block matrix — from every worker.

use super::{AbortOnDrop, StrategyOptions};
use crate::checksum::Checksum;
use crate::driver::{Driver, MapDone, MapInput, ShuffleSpec};
use crate::error::Result;
use crate::proto;
use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use std::sync::Arc;

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
    /// The blocks readers see now: those of maps not merged, plus the merge groups'.
    pub fn live_blocks(&self) -> usize {
        let merged: std::collections::HashSet<u32> = self
            .merges
            .iter()
            .flat_map(|(_, maps)| maps.iter().copied())
            .collect();
        let maps: usize = self
            .maps
            .iter()
            .filter(|m| !merged.contains(&m.map))
            .map(|m| m.blocks.len())
            .sum();
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

/// [`run_maps`], calling `on_commit` with each map output as the driver commits it.
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
    // Map tasks still running when this returns (a map failed) are aborted.
    let mut guard = AbortOnDrop(Vec::new());
    let work = async {
        loop {
            tokio::select! {
                input = inputs.next(), if !inputs_done && running.len() < limit => {
                    let Some(input) = input else {
                        inputs_done = true;
                        continue;
                    };
                    let worker = (0..n)
                        .filter(|&w| driver.is_alive(w))
                        .min_by_key(|&w| (load[w], (w + n - next_map as usize % n) % n))
                        .unwrap_or(0);
                    load[worker] += 1;
                    let handle = driver.submit_map(spec.id, next_map, worker, input);
                    guard.0.push(handle.abort_handle());
                    running.push(handle);
                    next_map += 1;
                }
                done = running.next(), if !running.is_empty() => {
                    let done = done.expect("running is not empty").map_err(|e| {
                        crate::Error::Cluster(format!("map task failed to run: {e}"))
                    })??;
                    load[done.worker] -= 1;
                    tracing::debug!(shuffle = %spec.id, map = done.map, worker = done.worker, rows = done.input.rows, "map done");
                    out.input.add(done.input);
                    out.input_bytes += done.input_bytes;
                    out.first_commit.get_or_insert(done.committed_at);
                    on_commit(&done);
                    out.maps.push(done);
                }
                else => break,
            }
        }
        Ok(())
    };
    if opts.watch {
        driver.watch(work).await?;
    } else {
        work.await?;
    }
    out.maps.sort_by_key(|m| m.map);
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
