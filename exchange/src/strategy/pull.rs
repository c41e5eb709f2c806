//! Pull shuffle (Exoshuffle §3.2.1): every map task writes its R blocks into the block store
//! of the worker it ran on; once all maps are done the shuffle is sealed and each reducer
//! pulls its partition — one column of the M×R block matrix — from every worker.

use super::StrategyOptions;
use crate::checksum::Checksum;
use crate::driver::{Driver, MapDone, MapInput, ShuffleSpec};
use crate::error::Result;
use crate::proto;
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

pub use crate::driver::maps::run_maps_observed;

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
