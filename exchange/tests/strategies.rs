//! End-to-end tests of the exchange strategies (merged, push, two-level, auto, speculation)
//! with real worker processes on loopback.

use flightshuffle::checksum::Checksum;
use flightshuffle::cluster::LocalCluster;
use flightshuffle::driver::{MapInput, ShuffleSpec};
use flightshuffle::strategy::{pull, StrategyOptions};
use futures::TryStreamExt;
use std::collections::HashMap;

mod common;
use common::*;

/// The merged strategy keeps the multiset, in memory and spilling, and reducers read fewer,
/// larger blocks than with pull: each worker's small map outputs became a few per partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_shuffle_reads_fewer_blocks_and_keeps_the_multiset() {
    use flightshuffle::job::{self, ShuffleJob, ShuffleOptions};
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
    use flightshuffle::strategy::{map_side, Placement};
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

/// Packed map blocks: the maps of merged, push and two-level shuffles
/// write one block per holder, not one per partition, and the output multiset is exact both
/// when merges cut them by partition and when best-effort merging gives up at once (a zero
/// merge timeout), so readers get each partition's rows sliced out of the packed blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn packed_map_blocks_keep_the_multiset_merged_or_not() {
    use flightshuffle::ids::PACKED;
    use flightshuffle::strategy::map_side;
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
            flightshuffle::strategy::map_side(&driver, &spec, futures::stream::iter(inputs), opts)
                .await
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

/// Read every partition of `spec` (the driver's readers, as placed) into one checksum.
async fn read_all(
    driver: &std::sync::Arc<flightshuffle::driver::Driver>,
    spec: &ShuffleSpec,
) -> Checksum {
    use futures::StreamExt;
    let mut out = Checksum::default();
    for p in 0..spec.partitions {
        let mut s = driver.read_partition(spec.id, p, true).await.unwrap();
        while let Some(b) = s.next().await {
            out.add(Checksum::of_batch(&b.unwrap()).unwrap());
        }
    }
    out
}

/// A forward moves maps that ran in place to the holders a placement
/// names: every block is then on its holder (push: the owner; two-level: the owner's grid
/// column), readers that read the holders only get every row once, and the maps' own blocks
/// are retired. A forward after the seal is refused and leaves the maps readable in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forward_moves_maps_run_in_place_to_their_holders() {
    use flightshuffle::ids::FORWARD_GROUP_BASE;
    use flightshuffle::strategy::Placement;
    let cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    for placement in [Placement::Owner, Placement::Grid] {
        let spec = ShuffleSpec {
            partitions: 7,
            ..lineitem_spec(true)
        };
        driver.create_shuffle(&spec).await.unwrap();
        let inputs = (0..6u64).map(|m| MapInput::Source(lineitem_slice(m * 2_000, 2_000, 500, 0)));
        let opts = StrategyOptions::named("pull").unwrap();
        let mapped = pull::run_maps(&driver, &spec, futures::stream::iter(inputs), 0, opts)
            .await
            .unwrap();
        let before = driver.blocks_of(spec.id).len();
        for (i, m) in mapped.maps.iter().enumerate() {
            let g = FORWARD_GROUP_BASE + i as u32;
            let done = driver
                .forward(spec.id, g, m.worker, vec![m.map], placement)
                .await
                .unwrap();
            assert_eq!(
                done.input.rows, 2_000,
                "{placement:?}: every row of the map went"
            );
        }
        driver.place(spec.id, placement);
        driver.seal(spec.id).await.unwrap();
        let blocks = driver.blocks_of(spec.id);
        assert_eq!(blocks.len(), before, "{placement:?}: forwarded unchanged");
        for b in &blocks {
            let p = b.meta.id.partition;
            assert!(
                b.meta.id.map >= FORWARD_GROUP_BASE,
                "{placement:?}: {b:?} retired"
            );
            assert!(
                placement.readers(p, 3).contains(&b.worker),
                "{placement:?}: {b:?}"
            );
        }
        assert_eq!(
            read_all(&driver, &spec).await,
            mapped.input,
            "{placement:?}"
        );
        driver.drop_shuffle(spec.id).await.unwrap();
    }
    // Refused before anything moves (the map is not held there; the shuffle is sealed): the
    // maps stay readable where they ran, by readers of every worker.
    let spec = ShuffleSpec {
        partitions: 7,
        ..lineitem_spec(true)
    };
    driver.create_shuffle(&spec).await.unwrap();
    let inputs = (0..3u64).map(|m| MapInput::Source(lineitem_slice(m * 2_000, 2_000, 500, 0)));
    let opts = StrategyOptions::named("pull").unwrap();
    let mapped = pull::run_maps(&driver, &spec, futures::stream::iter(inputs), 0, opts)
        .await
        .unwrap();
    let m = &mapped.maps[0];
    let elsewhere = (m.worker + 1) % 3;
    let wrong = driver
        .forward(
            spec.id,
            FORWARD_GROUP_BASE,
            elsewhere,
            vec![m.map],
            Placement::Owner,
        )
        .await;
    assert!(wrong.is_err(), "{wrong:?}");
    driver.seal(spec.id).await.unwrap();
    let late = driver
        .forward(
            spec.id,
            FORWARD_GROUP_BASE + 1,
            m.worker,
            vec![m.map],
            Placement::Owner,
        )
        .await;
    assert!(
        matches!(late, Err(ref e) if !matches!(e, flightshuffle::Error::PartialCommit { .. })),
        "{late:?}"
    );
    assert_eq!(read_all(&driver, &spec).await, mapped.input);
    assert!(driver.blocks_of(spec.id).iter().all(|b| b.meta.id.map < 3));
    driver.drop_shuffle(spec.id).await.unwrap();
}

/// `auto` picking push after its first wave ran in place forwards that wave to the owners,
/// which merge it with the maps pushed there: every block ends on its partition's owner,
/// readers read the owners only, and the output is exact. Where readers stream during the map side (a pipelined consumer) it cannot (the
/// workers refuse once a reader started there): the wave stays where it ran, readers keep
/// reading every worker, and every row still arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auto_picking_push_forwards_its_first_wave_unless_readers_stream() {
    use flightshuffle::strategy::{map_side, Placement};
    use futures::StreamExt;
    let cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    driver.use_calibration(slow_network()).unwrap();
    assert!(driver.use_calibration(slow_network()).is_err(), "set once");
    for streaming in [false, true] {
        let spec = ShuffleSpec {
            partitions: 7,
            ..lineitem_spec(true)
        };
        driver.create_shuffle(&spec).await.unwrap();
        let readers: Vec<_> = (0..spec.partitions)
            .filter(|_| streaming)
            .map(|p| {
                let (driver, id) = (driver.clone(), spec.id);
                tokio::spawn(async move {
                    let mut out = Checksum::default();
                    let mut s = driver.read_partition(id, p, true).await.unwrap();
                    while let Some(b) = s.next().await {
                        out.add(Checksum::of_batch(&b.unwrap()).unwrap());
                    }
                    out
                })
            })
            .collect();
        if streaming {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        let inputs = (0..12u64).map(|m| MapInput::Source(lineitem_slice(m * 2_000, 2_000, 500, 0)));
        let opts = StrategyOptions::named("auto").unwrap();
        let mapped = map_side(&driver, &spec, futures::stream::iter(inputs), opts)
            .await
            .unwrap();
        let choice = driver.choice(spec.id).unwrap_or_default();
        let (note, placement) = match streaming {
            false => (
                "the first wave's 3 maps forwarded to their holders",
                Placement::Owner,
            ),
            // (Every one of them, unless a reader had not yet started on some worker.)
            true => (
                "of the first wave's 3 maps stayed where they ran",
                Placement::Local,
            ),
        };
        assert!(
            choice.starts_with("auto: push") && choice.contains(note),
            "{choice}"
        );
        assert_eq!(driver.placement(spec.id), placement);
        let mut out = Checksum::default();
        if streaming {
            for r in readers {
                out.add(r.await.unwrap());
            }
        } else {
            for b in driver.blocks_of(spec.id) {
                assert_eq!(b.worker, Placement::owner(b.meta.id.partition, 3), "{b:?}");
            }
            // The holders merged the forwards with the maps pushed there, and the driver's
            // refs of what they merged are gone with them.
            let forward = flightshuffle::ids::FORWARD_GROUP_BASE;
            assert!(
                mapped
                    .merges
                    .iter()
                    .any(|(_, maps)| maps.iter().any(|&m| m >= forward)),
                "{:?}",
                mapped.merges
            );
            let refs = driver.blocks_of(spec.id);
            for (g, maps) in &mapped.merges {
                assert!(
                    !refs
                        .iter()
                        .any(|b| b.worker == g.worker && maps.contains(&b.meta.id.map)),
                    "{g:?} {maps:?}"
                );
            }
            assert_eq!(driver.live_blocks(spec.id), refs.len());
            out = read_all(&driver, &spec).await;
        }
        assert_eq!(out, mapped.input, "streaming readers: {streaming}");
        assert_eq!(out.rows, 24_000);
        driver.drop_shuffle(spec.id).await.unwrap();
    }
}
