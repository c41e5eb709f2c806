//! End-to-end tests of the exchange strategies (merged, push, two-level, auto, speculation)
//! with real worker processes on loopback.

use exchange::checksum::Checksum;
use exchange::cluster::LocalCluster;
use exchange::driver::{MapInput, ShuffleSpec};
use exchange::strategy::{pull, StrategyOptions};
use futures::TryStreamExt;
use std::collections::HashMap;

mod common;
use common::*;

/// The merged strategy keeps the multiset, in memory and spilling, and reducers read fewer,
/// larger blocks than with pull: each worker's small map outputs became a few per partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_shuffle_reads_fewer_blocks_and_keeps_the_multiset() {
    use exchange::job::{self, ShuffleJob, ShuffleOptions};
    let input = batches(48, 400);
    let want = checksum(&input);
    for budget in [1 << 30, 64 << 10] {
        let cluster = LocalCluster::start(config(2, budget)).await.unwrap();
        let mut blocks = HashMap::new();
        for name in ["pull", "merged"] {
            let opts = ShuffleOptions {
                by: vec!["k".into()],
                partitions: 4,
                partitioner: job::PartitionerKind::Hash,
                map_bytes: 1, // one map task per batch: many small blocks
                strategy: StrategyOptions::named(name).unwrap(),
            };
            let it: job::Input = Box::new(input.clone().into_iter().map(Ok));
            let (spec, it) = job::prepare(&schema(), it, &opts).unwrap();
            let job = ShuffleJob::start(cluster.driver.clone(), spec, it, &opts)
                .await
                .unwrap();
            let mut parts = Vec::new();
            while let Some(p) = job.next_partition().await {
                parts.push(p.unwrap().1);
            }
            let summary = job.mapped().await.unwrap();
            assert_eq!(summary.maps, 48);
            assert_eq!(checksum(&parts.concat()), want, "{name}, budget {budget}");
            assert_keys_not_split(&parts);
            if name == "merged" {
                assert!(summary.merges > 0, "{summary:?}");
            }
            blocks.insert(name, summary.blocks);
            job.close().await.unwrap();
        }
        assert!(
            blocks["merged"] * 4 <= blocks["pull"],
            "budget {budget}: {blocks:?}"
        );
    }
}

/// Speculative execution: a map whose first attempt straggles (it waits 60 s before its first
/// batch; fault injection) gets a second attempt on the other worker once the others are
/// done; the copy commits, the straggler is aborted, and the output multiset is exact (no rows
/// from the aborted attempt). Without speculation the shuffle would wait the full minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_straggling_map_is_copied_and_the_first_commit_wins() {
    let cluster = LocalCluster::start(config(2, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let spec = lineitem_spec(true);
    driver.create_shuffle(&spec).await.unwrap();
    let inputs = (0..6u64).map(|m| {
        let delay = if m == 2 { 60_000 } else { 0 };
        MapInput::Source(lineitem_slice(m * 5000, 5000, 1024, delay))
    });
    let opts = StrategyOptions {
        speculation: Some(2.0),
        ..StrategyOptions::default()
    };
    let mapped = pull::map_side(&driver, &spec, futures::stream::iter(inputs), opts)
        .await
        .unwrap();
    let straggler = mapped.maps.iter().find(|m| m.map == 2).unwrap();
    assert_eq!(straggler.attempt, 1, "the copy committed");
    assert_eq!(mapped.input.rows, 30_000);
    let mut out = Vec::new();
    for p in 0..spec.partitions {
        let s = driver.read_partition(spec.id, p, true).await.unwrap();
        out.extend(s.try_collect::<Vec<_>>().await.unwrap());
    }
    let mut got = Checksum::default();
    for b in &out {
        got.add(Checksum::of_batch(b).unwrap());
    }
    assert_eq!(got, mapped.input);
    driver.drop_shuffle(spec.id).await.unwrap();
}

/// Every strategy: the exact multiset, and blocks where the strategy says (push: on the
/// partition's owner; two-level: in the owner's grid column), merged into fewer blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_strategy_keeps_the_multiset_and_places_its_blocks() {
    use exchange::strategy::{map_side, Placement};
    use futures::StreamExt;
    let cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let mut blocks = HashMap::new();
    for name in ["pull", "merged", "push", "two-level", "auto"] {
        let spec = ShuffleSpec {
            partitions: 7,
            ..lineitem_spec(true)
        };
        driver.create_shuffle(&spec).await.unwrap();
        let inputs = (0..12u64).map(|m| MapInput::Source(lineitem_slice(m * 2_000, 2_000, 500, 0)));
        let opts = StrategyOptions::named(name).unwrap();
        let mapped = map_side(&driver, &spec, futures::stream::iter(inputs), opts)
            .await
            .unwrap();
        for b in driver.blocks_of(spec.id) {
            let p = b.meta.id.partition;
            match name {
                "push" => assert_eq!(b.worker, Placement::owner(p, 3), "{name}: {b:?}"),
                "two-level" => assert!(
                    Placement::Grid.readers(p, 3).contains(&b.worker),
                    "{name}: {b:?}"
                ),
                _ => {}
            }
        }
        let mut out = Checksum::default();
        for p in 0..spec.partitions {
            let mut s = driver.read_partition(spec.id, p, true).await.unwrap();
            while let Some(b) = s.next().await {
                out.add(Checksum::of_batch(&b.unwrap()).unwrap());
            }
        }
        assert_eq!(out, mapped.input, "{name}");
        assert_eq!(out.rows, 24_000, "{name}");
        blocks.insert(name, driver.blocks_of(spec.id).len());
        driver.drop_shuffle(spec.id).await.unwrap();
    }
    for name in ["merged", "push", "two-level"] {
        assert!(blocks[name] * 2 <= blocks["pull"], "{blocks:?}");
    }
}

/// Packed map blocks ([`exchange::packed`]): the maps of merged, push and two-level shuffles
/// write one block per holder, not one per partition, and the output multiset is exact both
/// when merges cut them by partition and when best-effort merging gives up at once (a zero
/// merge timeout), so readers get each partition's rows sliced out of the packed blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn packed_map_blocks_keep_the_multiset_merged_or_not() {
    use exchange::packed::PACKED;
    use exchange::strategy::map_side;
    use futures::StreamExt;
    let cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    for name in ["merged", "push", "two-level", "auto"] {
        for merge_timeout in [
            std::time::Duration::from_secs(10),
            std::time::Duration::ZERO,
        ] {
            let spec = ShuffleSpec {
                partitions: 40,
                ..lineitem_spec(true)
            };
            driver.create_shuffle(&spec).await.unwrap();
            let inputs =
                (0..12u64).map(|m| MapInput::Source(lineitem_slice(m * 2_000, 2_000, 500, 0)));
            let opts = StrategyOptions {
                pack: true,
                merge_timeout,
                ..StrategyOptions::named(name).unwrap()
            };
            let mapped = map_side(&driver, &spec, futures::stream::iter(inputs), opts)
                .await
                .unwrap();
            let what = format!("{name}, merge timeout {merge_timeout:?}");
            // Every map packed (auto: those submitted after its pick, if it picked a
            // merging strategy): at most one block per holder.
            let packed: Vec<_> = mapped
                .maps
                .iter()
                .filter(|m| m.blocks.iter().all(|b| b.meta.id.partition == PACKED))
                .collect();
            if name != "auto" {
                assert_eq!(packed.len(), 12, "{what}: {packed:?}");
            }
            assert!(packed.iter().all(|m| m.blocks.len() <= 3), "{what}");
            let mut out = Checksum::default();
            for p in 0..spec.partitions {
                let mut s = driver.read_partition(spec.id, p, true).await.unwrap();
                while let Some(b) = s.next().await {
                    let b = b.unwrap();
                    assert_eq!(b.schema(), spec.schema, "{what}");
                    out.add(Checksum::of_batch(&b).unwrap());
                }
            }
            assert_eq!(out, mapped.input, "{what}");
            assert_eq!(out.rows, 24_000, "{what}");
            let unmerged = driver
                .blocks_of(spec.id)
                .iter()
                .filter(|b| b.meta.id.partition == PACKED)
                .count();
            if merge_timeout.is_zero() && name != "auto" {
                assert!(unmerged > 0, "{what}: readers read packed blocks");
            }
            driver.drop_shuffle(spec.id).await.unwrap();
        }
    }
}

/// `auto` runs its first wave alone (one map per worker) and starts the next maps only once
/// it has chosen, so they run packed or placed as the pick wants: with one of the two first
/// maps committed, no third map has started; once both have, the rest run and the output
/// is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_starts_the_maps_after_its_first_wave_once_it_has_chosen() {
    use std::sync::atomic::Ordering;
    let cluster = LocalCluster::start(config(2, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let g = gated(&driver, 8).await;
    let (spec, inputs, want) = (g.spec, g.inputs, g.want);
    let (started, permits) = (g.started, g.permits);
    // Calibrated before the maps start, so the choice is made as the wave commits.
    driver.calibration().await.unwrap();
    let run = {
        let (driver, spec) = (driver.clone(), spec.clone());
        let opts = StrategyOptions::named("auto").unwrap();
        tokio::spawn(async move {
            exchange::strategy::map_side(&driver, &spec, futures::stream::iter(inputs), opts).await
        })
    };
    until("the first wave started", || {
        started.load(Ordering::SeqCst) >= 2
    })
    .await;
    permits.add_permits(1);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        started.load(Ordering::SeqCst),
        2,
        "no map starts before the choice"
    );
    permits.add_permits(1);
    until("maps after the choice", || {
        started.load(Ordering::SeqCst) > 2
    })
    .await;
    permits.add_permits(6);
    let mapped = run.await.unwrap().unwrap();
    assert_eq!(mapped.maps.len(), 8);
    assert_eq!(mapped.input, want, "every map's rows committed once");
    assert!(
        driver
            .choice(spec.id)
            .is_some_and(|c| c.starts_with("auto: ") && c.contains("2 run before the choice")),
        "{:?}",
        driver.choice(spec.id)
    );
    driver.drop_shuffle(spec.id).await.unwrap();
}
