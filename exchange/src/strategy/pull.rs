//! Pull shuffle (Exoshuffle §3.2.1): every map task writes its R blocks into the block store
//! of the worker it ran on; once all maps are done the shuffle is sealed and each reducer
//! pulls its partition — one column of the M×R block matrix — from every worker.

use super::options::StrategyOptions;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::Result;
use crate::proto;
use futures::{Stream, StreamExt};
use std::sync::Arc;

/// Run map tasks for every input (spread over the least-loaded workers, at most
/// `maps_per_worker` each at once), then seal the shuffle. Fails on the first failed map.
pub async fn map_side(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<Mapped> {
    let out = run_maps(driver, spec, inputs, 0, opts).await?;
    seal(driver, spec, opts).await?;
    Ok(out)
}

/// Seal `spec` once its maps are done. A worker found lost by the seal itself (after the map
/// runner last looked, e.g. by a merge or the seal's own calls) costs a durable shuffle no
/// rerun: its outputs come back from the store ([`Driver::repair`], which seals); otherwise
/// the loss is the caller's to handle.
pub async fn seal(driver: &Arc<Driver>, spec: &ShuffleSpec, opts: StrategyOptions) -> Result<()> {
    match driver.seal(spec.id).await {
        Err(crate::Error::WorkerLost { .. })
            if opts.recover && driver.replaces_workers() && driver.is_durable(spec.id) =>
        {
            tracing::warn!(shuffle = %spec.id, "worker lost before the seal: restoring from the store");
            driver.repair(spec.id).await.map(|_| ())
        }
        r => r,
    }
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

pub use super::maps::{run_maps_observed, Mapped};

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
    use crate::checksum::Checksum;
    use crate::driver::BlockRef;
    use crate::driver::MapDone;

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
            admission_wait_seconds: 0.0,
            committed_at: std::time::Instant::now(),
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
