//! Durable shuffles with real worker processes and a real store (`file://` on this machine;
//! the S3 server tests are in `tests/test_storage.py`): every map output is also one object,
//! a worker killed after its maps committed costs no map re-run, its blocks come back by
//! range; a corrupted object is caught by its CRC32C; a store that cannot be written is a
//! clear error at start; dropping a shuffle deletes its objects.

use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle::strategy::{pull, StrategyOptions};
use flightshuffle::{Error, StorageConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;
use common::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Three workers whose shuffles are durable in `dir`.
fn durable_config(dir: &Path) -> LocalClusterConfig {
    let mut cfg = config(3, 1 << 30);
    let url = format!("file://{}", dir.display());
    cfg.driver.storage = Some(StorageConfig::new(url, []).unwrap());
    cfg
}

/// Every file under `dir`.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_maps_committed_costs_no_map_rerun() {
    flightshuffle::worker::init_logging();
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::start(durable_config(store.path()))
        .await
        .unwrap();
    let input = batches(60, 2_000);
    let want = checksum(&input);
    // After the map side (sealed: the merging strategies merged blocks on the lost worker,
    // which come back unmerged from the maps' objects), then while the producer still feeds
    // maps (push: every running map pushes to the lost worker).
    let rounds = [
        ("pull", Duration::ZERO),
        ("merged", Duration::ZERO),
        ("push", Duration::ZERO),
        ("two-level", Duration::ZERO),
        ("pull", Duration::from_millis(10)),
        ("push", Duration::from_millis(10)),
    ];
    for (round, (strategy, pace)) in rounds.into_iter().enumerate() {
        let (recomputed, restored, reruns) = (
            cluster.driver.recomputed_maps(),
            cluster.driver.restored_blocks(),
            cluster.driver.reruns(),
        );
        let opts = options(8, StrategyOptions::named(strategy).unwrap());
        let job = start_job(&cluster, &input, &opts, pace).await;
        let mut parts = Vec::new();
        let mut maps = None;
        if pace.is_zero() {
            let summary = job.mapped().await.unwrap();
            assert!(summary.maps >= 6, "{summary:?}");
            maps = Some(summary.maps);
            let (_, first) = job.next_partition().await.unwrap().unwrap();
            parts.push(first);
        } else {
            // Once worker 1 holds a committed block: not after a fixed time.
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while cluster.driver.live_blocks_on(job.id, 1) == 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no commit on worker 1"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // One object per committed map, each named after its attempt.
        let objects: Vec<PathBuf> = files(store.path())
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(".fsobj"))
            .collect();
        match maps {
            Some(m) => assert_eq!(objects.len(), m, "{objects:?}"),
            None => assert!(!objects.is_empty()),
        }
        cluster.kill_worker(1).unwrap();
        read_rest(&job, parts.len() as u32, &mut parts).await;
        assert_eq!(parts.len(), 8);
        assert_eq!(
            checksum(&parts.concat()),
            want,
            "round {round} ({strategy}): exact"
        );
        assert_keys_not_split(&parts);
        assert_eq!(
            cluster.driver.recomputed_maps(),
            recomputed,
            "round {round} ({strategy}): no committed map ran again"
        );
        assert_eq!(
            cluster.driver.reruns(),
            reruns,
            "round {round} ({strategy}): the job did not run again whole"
        );
        assert!(
            cluster.driver.restored_blocks() > restored,
            "round {round} ({strategy}): the lost blocks came back from the store"
        );
        job.close().await.unwrap();
        // Dropped with its shuffle: no object left.
        assert_eq!(files(store.path()), Vec::<PathBuf>::new(), "round {round}");
    }
    let stats = cluster.driver.storage_stats().await.unwrap();
    assert!(stats.gets > 0 && stats.deletes > 0, "{stats:?}");
    // No LIST on a read path: one per dropped shuffle (its leftovers) and none else.
    assert_eq!(stats.lists, rounds.len() as u64, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_object_is_caught_and_the_job_recovers_exactly_without_it() {
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::start(durable_config(store.path()))
        .await
        .unwrap();
    let driver = cluster.driver.clone();
    let input = batches(40, 2_000);
    let (failures, restored, recomputed) = (
        driver.restore_failures(),
        driver.restored_blocks(),
        driver.recomputed_maps(),
    );
    let opts = options(6, StrategyOptions::named("pull").unwrap());
    let job = start_job(&cluster, &input, &opts, Duration::ZERO).await;
    job.mapped().await.unwrap();
    let (_, first) = job.next_partition().await.unwrap().unwrap();
    // Every object garbled in its first block, then worker 1 lost: the restore reads every
    // block it needs and checks it before it puts any, finds a CRC32C that does not match,
    // puts nothing and leaves the maps to lineage (the job's inputs are kept).
    for f in files(store.path()) {
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[0] ^= 0xff;
        std::fs::write(&f, bytes).unwrap();
    }
    cluster.kill_worker(1).unwrap();
    let mut parts = vec![first];
    read_rest(&job, 1, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), checksum(&input), "exact");
    assert!(
        driver.restore_failures() > failures,
        "the bad object was caught"
    );
    assert_eq!(
        driver.restored_blocks(),
        restored,
        "nothing restored from it"
    );
    assert!(driver.recomputed_maps() > recomputed, "its maps ran again");
    job.close().await.unwrap();
    // A map whose input cannot be read again (a stream) is a clear error, not a short answer.
    let spec = spec_k(4);
    driver.create_shuffle(&spec).await.unwrap();
    let inputs = stream_inputs(&input, 4);
    let mapped = pull::run_maps(
        &driver,
        &spec,
        futures::stream::iter(inputs),
        0,
        StrategyOptions::default(),
    )
    .await
    .unwrap();
    assert!(mapped.maps.iter().any(|d| d.worker == 1));
    driver.seal(spec.id).await.unwrap();
    for f in files(store.path()) {
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[0] ^= 0xff;
        std::fs::write(&f, bytes).unwrap();
    }
    cluster.kill_worker(1).unwrap();
    assert!(driver.check_health().await.is_err());
    let err = driver.repair(spec.id).await.unwrap_err();
    assert!(err.to_string().contains("cannot run again"), "{err}");
    assert!(!driver.lost_outputs(spec.id).is_empty());
    driver.drop_shuffle(spec.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_cannot_be_written_fails_the_start_naming_it() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // A file where the store's directory should be.
    let blocked = dir.path().join("not-a-dir");
    std::fs::write(&blocked, b"x").unwrap();
    let err = match LocalCluster::start(durable_config(&blocked.join("sub"))).await {
        Ok(_) => panic!("a cluster started on a store it cannot write"),
        Err(e) => e,
    };
    assert!(
        matches!(err, Error::Storage { .. }) && err.to_string().contains("not-a-dir"),
        "{err}"
    );
    // A URL the store does not know is refused before anything starts.
    assert!(StorageConfig::new("gopher://x/y", []).is_err());
}

/// Requests at M = R = 1000, direct layout (one object per map): the maps write exactly one
/// object each (counted on disk, the store's side, and by the client's counters), nothing is
/// read or listed while the shuffle lives, and the drop lists its prefix once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_maps_write_a_thousand_objects_and_list_nothing() {
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(durable_config(store.path()))
        .await
        .unwrap();
    let driver = cluster.driver.clone();
    let before = driver.storage_stats().await.unwrap();
    let (maps, partitions) = (1000usize, 1000u32);
    let input = batches(maps, 20);
    let spec = spec_k(partitions);
    driver.create_shuffle(&spec).await.unwrap();
    let mapped = pull::map_side(
        &driver,
        &spec,
        futures::stream::iter(stream_inputs(&input, 1)),
        StrategyOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(mapped.maps.len(), maps);
    let objects = files(store.path())
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".fsobj"))
        .count();
    assert_eq!(objects, maps, "one object per map, on the store's side");
    let out = read_partitions(&driver, spec.id, partitions).await;
    assert_eq!(checksum(&out), checksum(&input), "exact");
    let live = driver.storage_stats().await.unwrap();
    assert_eq!(live.puts - before.puts, maps as u64, "{live:?}");
    assert_eq!(
        live.lists - before.lists,
        0,
        "no LIST while it lives: {live:?}"
    );
    assert_eq!(
        live.gets - before.gets,
        0,
        "reads went to the workers: {live:?}"
    );
    driver.drop_shuffle(spec.id).await.unwrap();
    let dropped = driver.storage_stats().await.unwrap();
    assert_eq!(dropped.lists - before.lists, 1, "{dropped:?}");
    assert_eq!(dropped.deletes - before.deletes, maps as u64, "{dropped:?}");
    assert_eq!(files(store.path()), Vec::<PathBuf>::new());
}

/// Strategy `store` (Seer's direct exchange): readers read every map's object by range, so a
/// worker killed once the maps committed costs nothing at all: no map runs again, nothing is
/// restored, and the answer is exact; the drop leaves no object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_store_readers_read_the_objects_not_the_workers() {
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::start(durable_config(store.path()))
        .await
        .unwrap();
    let input = batches(40, 2_000);
    let want = checksum(&input);
    let before = cluster.driver.storage_stats().await.unwrap();
    let (recomputed, restored) = (
        cluster.driver.recomputed_maps(),
        cluster.driver.restored_blocks(),
    );
    let opts = options(8, StrategyOptions::named("store").unwrap());
    let job = start_job(&cluster, &input, &opts, Duration::ZERO).await;
    let summary = job.mapped().await.unwrap();
    let mapped = cluster.driver.storage_stats().await.unwrap();
    cluster.kill_worker(1).unwrap();
    let mut parts = Vec::new();
    read_rest(&job, 0, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), want, "exact");
    assert_keys_not_split(&parts);
    assert_eq!(cluster.driver.recomputed_maps(), recomputed);
    assert_eq!(
        cluster.driver.restored_blocks(),
        restored,
        "nothing to restore"
    );
    let maps = summary.maps as u64;
    assert_eq!(mapped.puts - before.puts, maps, "{mapped:?}");
    // (The killed worker's counters went with it: the driver's own reads are all there.)
    let _ = cluster.driver.check_health().await;
    cluster
        .driver
        .wait_all_live(Duration::from_secs(60))
        .await
        .unwrap();
    let after = cluster.driver.storage_stats().await.unwrap();
    // One ranged read per (map, partition) holding rows at most.
    let gets = after.gets - before.gets;
    assert!(gets >= 8 && gets <= maps * 8, "{gets} GETs for {maps} maps");
    assert_eq!(after.lists, before.lists, "no LIST on a read path");
    job.close().await.unwrap();
    assert_eq!(files(store.path()), Vec::<PathBuf>::new());
    // Without a store the strategy is refused, clearly.
    let plain = LocalCluster::start(config(2, 1 << 30)).await.unwrap();
    let job = start_job(&plain, &input, &opts, Duration::ZERO).await;
    let err = job.mapped().await.unwrap_err();
    assert!(err.to_string().contains("storage="), "{err}");
}

/// A worker lost after the map runner last looked and before the seal (here: after the maps,
/// before the seal is asked for) costs a durable shuffle no rerun: the seal finds the loss,
/// restores its outputs from the store and seals; the answer is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_lost_just_before_the_seal_is_restored_by_the_seal() {
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::start(durable_config(store.path()))
        .await
        .unwrap();
    let driver = cluster.driver.clone();
    let input = batches(30, 2_000);
    let spec = spec_k(6);
    driver.create_shuffle(&spec).await.unwrap();
    let opts = StrategyOptions {
        recover: true,
        ..StrategyOptions::default()
    };
    let inputs = futures::stream::iter(stream_inputs(&input, 1));
    let mapped = pull::run_maps(&driver, &spec, inputs, 0, opts)
        .await
        .unwrap();
    assert_eq!(mapped.maps.len(), 30);
    let (recomputed, restored) = (driver.recomputed_maps(), driver.restored_blocks());
    cluster.kill_worker(1).unwrap();
    pull::seal(&driver, &spec, opts).await.unwrap();
    assert_eq!(driver.recomputed_maps(), recomputed, "no map ran again");
    assert!(
        driver.restored_blocks() > restored,
        "restored from the store"
    );
    let out = read_partitions(&driver, spec.id, 6).await;
    assert_eq!(checksum(&out), checksum(&input), "exact");
    driver.drop_shuffle(spec.id).await.unwrap();
}

/// Strategy `store-two-level` (Seer §3.2) at M = R = 1000: the maps write 1000 objects, the
/// second level ⌈√M⌉ × ⌈√R⌉ = 1024 combined objects, and the requests stay near 2·p·√p
/// (reads: one per (map, column) and one per (partition, group)) where the direct exchange
/// reads up to p² ranges; the answer is exact, nothing is listed, the drop leaves no object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_level_through_the_store_makes_p_sqrt_p_requests_not_p_squared() {
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(durable_config(store.path()))
        .await
        .unwrap();
    let driver = cluster.driver.clone();
    let (maps, partitions) = (1000usize, 1000u32);
    let input = batches(maps, 20);
    let spec = spec_k(partitions);
    driver.create_shuffle(&spec).await.unwrap();
    let before = driver.storage_stats().await.unwrap();
    let mapped = flightshuffle::strategy::map_side(
        &driver,
        &spec,
        futures::stream::iter(stream_inputs(&input, 1)),
        StrategyOptions::named("store-two-level").unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(mapped.maps.len(), maps);
    let choice = driver.choice(spec.id).unwrap_or_default();
    assert!(choice.contains("32 groups x 32 columns"), "{choice}");
    let objects = files(store.path())
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".fsobj"))
        .count();
    let combined = 32 * 32;
    assert_eq!(objects, maps + combined, "on the store's side");
    let out = read_partitions(&driver, spec.id, partitions).await;
    assert_eq!(checksum(&out), checksum(&input), "exact");
    let live = driver.storage_stats().await.unwrap();
    let p = maps as u64;
    assert_eq!(live.puts - before.puts, p + combined as u64, "{live:?}");
    // The second level reads each map object at most once per column (32 000 GETs),
    // readers each combined object at most once per partition (32 000): within 2·p·√p,
    // whatever the rows. The direct exchange reads one range per (map, partition) holding
    // rows: up to p² = 1 000 000 (here, with 20 rows per map, at most 20 000).
    let gets = live.gets - before.gets;
    assert!(gets <= 2 * p * 32, "{gets} GETs: {live:?}");
    assert_eq!(
        gets,
        driver.store_reads(spec.id),
        "the manifest's count is the client's"
    );
    assert_eq!(live.lists - before.lists, 0, "no LIST: {live:?}");
    driver.drop_shuffle(spec.id).await.unwrap();
    assert_eq!(files(store.path()), Vec::<PathBuf>::new());
}

/// `auto` on a durable shuffle weighs the store with its own measured rates: under a
/// calibration whose Flight transport is 1 MB/s, reading through the store (here `file://`
/// on local disk) is cheaper, so it picks one of the store's two layouts late, after its
/// first wave, and the answer is exact; the choice shows the store's predictions. Readers
/// that stream during the map side (no `pack`) keep it off the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_goes_through_the_store_when_the_model_says_it_is_cheaper() {
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(durable_config(store.path()))
        .await
        .unwrap();
    let driver = cluster.driver.clone();
    driver.use_calibration(slow_network()).unwrap();
    let input = batches(24, 2_000);
    for pack in [true, false] {
        let spec = spec_k(8);
        driver.create_shuffle(&spec).await.unwrap();
        let opts = StrategyOptions {
            pack,
            ..StrategyOptions::named("auto").unwrap()
        };
        flightshuffle::strategy::map_side(
            &driver,
            &spec,
            futures::stream::iter(stream_inputs(&input, 1)),
            opts,
        )
        .await
        .unwrap();
        let choice = driver.choice(spec.id).unwrap_or_default();
        let out = read_partitions(&driver, spec.id, 8).await;
        assert_eq!(checksum(&out), checksum(&input), "exact ({choice})");
        if pack {
            assert!(choice.starts_with("auto: store"), "{choice}");
            assert!(choice.contains("store-two-level "), "{choice}");
            assert!(driver.via_store(spec.id));
        } else {
            assert!(!choice.contains("store"), "{choice}");
            assert!(!driver.via_store(spec.id));
        }
        driver.drop_shuffle(spec.id).await.unwrap();
    }
}
