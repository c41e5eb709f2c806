//! Lineage recovery with real worker processes: a worker killed during a shuffle job is
//! replaced, the map outputs it held are recomputed from what the driver kept (or the shuffle
//! runs again, where every map pushed blocks to it), and the job's output stays exact.

use arrow::array::RecordBatch;
use flightshuffle::cluster::LocalCluster;
use flightshuffle::job::{self, ShuffleJob, ShuffleOptions};
use flightshuffle::strategy::StrategyOptions;
use std::time::Duration;

mod common;
use common::*;

/// One test at a time: each starts three workers, and the last one counts kept bytes, which
/// are per process.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Start a hash shuffle job of `input` into `partitions` under `strategy`.
async fn start(
    cluster: &LocalCluster,
    input: &[RecordBatch],
    partitions: u32,
    strategy: &str,
) -> ShuffleJob {
    start_paced(cluster, input, partitions, strategy, Duration::ZERO).await
}

/// [`start`] with the input handed over one batch every `pace` (a slow producer).
async fn start_paced(
    cluster: &LocalCluster,
    input: &[RecordBatch],
    partitions: u32,
    strategy: &str,
    pace: Duration,
) -> ShuffleJob {
    let strategy = StrategyOptions::named(strategy).unwrap();
    start_job(cluster, input, &options(partitions, strategy), pace).await
}

/// Pull with `parity` shards per stripe.
fn with_parity(parity: u32) -> StrategyOptions {
    StrategyOptions {
        parity,
        ..StrategyOptions::named("pull").unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_the_map_side_has_its_outputs_recomputed() {
    let _serial = SERIAL.lock().await;
    let mut cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let input = batches(60, 2_000);
    let want = checksum(&input);
    for (round, strategy) in ["pull", "merged"].into_iter().enumerate() {
        let before = cluster.driver.recomputed_maps();
        let job = start(&cluster, &input, 8, strategy).await;
        let summary = job.mapped().await.unwrap();
        assert!(summary.maps >= 6, "{strategy}: {summary:?}");
        let (i, first) = job.next_partition().await.unwrap().unwrap();
        assert_eq!(i, 0);
        let mut parts = vec![first];
        // The map side is committed and sealed: killing a worker loses its map outputs.
        cluster.kill_worker(1).unwrap();
        read_rest(&job, 1, &mut parts).await;
        assert_eq!(parts.len(), 8, "{strategy}");
        assert_eq!(
            checksum(&parts.concat()),
            want,
            "{strategy}: exact after recovery"
        );
        assert_keys_not_split(&parts);
        let recomputed = cluster.driver.recomputed_maps() - before;
        assert!(
            recomputed > 0 && recomputed < summary.maps as u64,
            "{strategy}: only the lost worker's maps run again ({recomputed} of {})",
            summary.maps
        );
        assert_eq!(cluster.driver.generation(1), round as u64 + 1);
        job.close().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_mapping_or_under_push_reruns_the_shuffle_exactly() {
    let _serial = SERIAL.lock().await;
    let mut cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let input = batches(200, 2_000);
    let want = checksum(&input);
    // Killed while the maps run (a slow producer: 200 batches over about 2 s): the maps it
    // held, committed or running, run again in place on the live workers from the inputs
    // the driver kept (the half-read one included); the others are not run again.
    let before = cluster.driver.recomputed_maps();
    let job = start_paced(&cluster, &input, 6, "pull", Duration::from_millis(10)).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    cluster.kill_worker(2).unwrap();
    let mut parts = Vec::new();
    read_rest(&job, 0, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), want, "killed while mapping");
    assert_keys_not_split(&parts);
    let summary = job.mapped().await.unwrap();
    let recomputed = cluster.driver.recomputed_maps() - before;
    assert!(
        recomputed > 0 && recomputed < summary.maps as u64,
        "committed outputs of the lost worker only, in place ({recomputed} of {})",
        summary.maps
    );
    job.close().await.unwrap();
    // Push: every map pushed blocks to the lost worker, so the shuffle runs again; the
    // partitions already handed out are not handed out twice.
    let small = batches(40, 2_000);
    let job = start(&cluster, &small, 6, "push").await;
    job.mapped().await.unwrap();
    let (_, first) = job.next_partition().await.unwrap().unwrap();
    let mut parts = vec![first];
    cluster.kill_worker(0).unwrap();
    read_rest(&job, 1, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), checksum(&small), "push");
    job.close().await.unwrap();
    // The cluster keeps working, and nothing is left on the driver's disk or in memory.
    let job = start(&cluster, &small, 4, "pull").await;
    let mut parts = Vec::new();
    read_rest(&job, 0, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), checksum(&small));
    job.close().await.unwrap();
    drop(job);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        flightshuffle::kept_in_memory(),
        0,
        "kept inputs freed with their jobs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seal_after_an_unnoticed_loss_fails_and_repair_makes_it_whole() {
    use flightshuffle::driver::{MapInput, ShuffleSpec};
    use flightshuffle::strategy::pull;
    use flightshuffle::{partitioner, Error, ShuffleId};
    use futures::TryStreamExt;
    let _serial = SERIAL.lock().await;
    let mut cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let spec = ShuffleSpec {
        id: ShuffleId::random(),
        schema: flightshuffle::synthetic::lineitem_schema(),
        partitions: 6,
        partitioner: partitioner::hash(&["l_orderkey"]),
        checksum_inputs: true,
        combine: None,
    };
    driver.create_shuffle(&spec).await.unwrap();
    let inputs = (0..9u64).map(|m| MapInput::Source(lineitem_slice(m * 5_000, 5_000, 2048, 0)));
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
    // Worker 1 dies after its maps committed; the loss is noticed elsewhere and its
    // replacement is up before this shuffle seals. Sealing must not pass for whole (the
    // replacement holds none of the rows): it fails, naming the worker.
    cluster.kill_worker(1).unwrap();
    assert!(driver.check_health().await.is_err());
    driver
        .wait_all_live(flightshuffle::driver::REPLACE_TIMEOUT)
        .await
        .unwrap();
    match driver.seal(spec.id).await {
        Err(Error::WorkerLost { worker: 1, .. }) => {}
        other => panic!("expected WorkerLost for worker 1, got {other:?}"),
    }
    // Repair recomputes the lost maps on the replacement and seals: every row, once.
    let n = driver.repair(spec.id).await.unwrap();
    assert_eq!(n, mapped.maps.iter().filter(|d| d.worker == 1).count());
    let mut got = flightshuffle::checksum::Checksum::default();
    for p in 0..spec.partitions {
        let s = driver.read_partition(spec.id, p, true).await.unwrap();
        for b in s.try_collect::<Vec<_>>().await.unwrap() {
            got.add(flightshuffle::checksum::Checksum::of_batch(&b).unwrap());
        }
    }
    assert_eq!(got, mapped.input);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parity_rebuilds_a_lost_workers_blocks_without_running_maps_again() {
    let _serial = SERIAL.lock().await;
    let mut cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let input = batches(60, 2_000);
    let want = checksum(&input);
    // r = 1: one worker killed after the seal; r = 2: two at once (3 workers: each stripe is
    // one shard and two parity shards, so any one survivor rebuilds the others).
    for (parity, kill) in [(1u32, vec![1usize]), (2, vec![0, 2])] {
        let (recomputed, rebuilt) = (
            cluster.driver.recomputed_maps(),
            cluster.driver.rebuilt_blocks(),
        );
        let opts = options(8, with_parity(parity));
        let job = start_job(&cluster, &input, &opts, Duration::ZERO).await;
        let summary = job.mapped().await.unwrap();
        assert!(summary.maps >= 6, "{summary:?}");
        let (_, first) = job.next_partition().await.unwrap().unwrap();
        let mut parts = vec![first];
        for &w in &kill {
            cluster.kill_worker(w).unwrap();
        }
        read_rest(&job, 1, &mut parts).await;
        assert_eq!(parts.len(), 8);
        assert_eq!(
            checksum(&parts.concat()),
            want,
            "parity {parity}: exact after the rebuild"
        );
        assert_keys_not_split(&parts);
        assert_eq!(
            cluster.driver.recomputed_maps(),
            recomputed,
            "parity {parity}: no map ran again"
        );
        let blocks = cluster.driver.rebuilt_blocks() - rebuilt;
        assert!(blocks > 0, "parity {parity}: blocks were rebuilt");
        job.close().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parity_rebuilds_committed_outputs_when_a_worker_dies_while_mapping() {
    let _serial = SERIAL.lock().await;
    let mut cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let input = batches(200, 2_000);
    let rebuilt = cluster.driver.rebuilt_blocks();
    // A slow producer (about 2 s): maps committed before the kill have their blocks on the
    // lost worker rebuilt from parity; those running then run again from the kept inputs.
    let opts = options(6, with_parity(1));
    let job = start_job(&cluster, &input, &opts, Duration::from_millis(10)).await;
    // Killed once worker 1 holds a committed block (pull keeps a map's blocks where it ran,
    // so a commit elsewhere would leave nothing to rebuild) and while the producer still
    // feeds others: not after a fixed time, which on a loaded machine could come before any
    // commit.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while cluster.driver.live_blocks_on(job.id, 1) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no map committed within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.kill_worker(1).unwrap();
    let mut parts = Vec::new();
    read_rest(&job, 0, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), checksum(&input), "exact");
    assert_keys_not_split(&parts);
    assert!(
        cluster.driver.rebuilt_blocks() > rebuilt,
        "committed outputs rebuilt from parity, not the map side run again"
    );
    job.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replacements_a_paused_worker_is_suspected_then_cleared() {
    let _serial = SERIAL.lock().await;
    let mut cfg = config(3, 1 << 30);
    cfg.driver.health_timeout = Duration::from_secs(1);
    cfg.driver.health_interval = Duration::from_millis(200);
    cfg.driver.rpc_timeout = Duration::from_secs(5);
    let cluster = LocalCluster::start(cfg).await.unwrap();
    // A cluster whose workers are started elsewhere: nobody replaces a lost one.
    cluster.driver.stop_replacing();
    let pid = cluster.pids()[1].to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, pid.as_str()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    let input = batches(20, 2_000);
    signal("-STOP");
    // The job that meets the paused worker fails with the loss, within the timeouts.
    let opts = options(6, StrategyOptions::named("pull").unwrap());
    let run = |input: Vec<RecordBatch>| {
        let opts = opts.clone();
        let driver = cluster.driver.clone();
        async move {
            let it: job::Input = Box::new(input.into_iter().map(Ok));
            let (spec, it) = job::prepare(&schema(), it, &opts)?;
            let job = ShuffleJob::start(driver, spec, it, &opts).await?;
            let mut parts = Vec::new();
            while let Some(p) = job.next_partition().await {
                parts.push(p?.1);
            }
            job.close().await?;
            Ok::<_, flightshuffle::Error>(parts)
        }
    };
    let failed = tokio::time::timeout(Duration::from_secs(60), run(input.clone()))
        .await
        .expect("the job ends within 60 s");
    assert!(
        matches!(
            failed,
            Err(flightshuffle::Error::WorkerLost { worker: 1, .. })
        ),
        "{failed:?}"
    );
    assert!(!cluster.driver.is_alive(1), "suspected");
    // It answers again: the next job clears it and runs on all three, exactly.
    signal("-CONT");
    let parts = tokio::time::timeout(Duration::from_secs(60), run(input.clone()))
        .await
        .expect("the job ends within 60 s")
        .unwrap();
    assert_eq!(checksum(&parts.concat()), checksum(&input));
    assert!(cluster.driver.is_alive(1), "cleared");
    assert_eq!(
        cluster.driver.generation(1),
        0,
        "the same process, not a replacement"
    );
}

/// A commit whose reply is lost after it took effect (a worker fault injected with
/// `--fault-lose-commit-replies`: each worker loses its first commit reply) is asked again
/// and found committed; another attempt of the same map, on another worker, is then refused.
/// The partitions hold every row once. Before commits were asked again, the first attempt
/// failed with its claim released and the second committed too: every row twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_reply_never_lets_a_second_attempt_commit() {
    use flightshuffle::driver::MapInput;
    use futures::TryStreamExt;
    let _serial = SERIAL.lock().await;
    let mut cfg = config(2, 1 << 30);
    cfg.worker_command
        .extend(["--fault-lose-commit-replies".to_string(), "1".to_string()]);
    let cluster = LocalCluster::start(cfg).await.unwrap();
    let driver = cluster.driver.clone();
    let input = batches(8, 1_000);
    let spec = spec_k(4);
    driver.create_shuffle(&spec).await.unwrap();
    let stream = |b: Vec<RecordBatch>| {
        MapInput::Stream(Box::pin(futures::stream::iter(b.into_iter().map(Ok))))
    };
    let first = driver
        .submit_map(spec.id, 0, 0, stream(input.clone()))
        .await
        .unwrap();
    let second = driver
        .submit_map(spec.id, 0, 1, stream(input.clone()))
        .await
        .unwrap();
    assert!(first.is_ok(), "the commit took effect: {first:?}");
    assert!(
        matches!(second, Err(flightshuffle::Error::Superseded { .. })),
        "a second attempt of a committed map is refused: {second:?}"
    );
    driver.seal(spec.id).await.unwrap();
    let mut all = Vec::new();
    for p in 0..4 {
        let s = driver.read_partition(spec.id, p, true).await.unwrap();
        let got: Vec<RecordBatch> = s.try_collect().await.unwrap();
        let rows: u64 = got.iter().map(|b| b.num_rows() as u64).sum();
        assert_eq!(
            driver.expected_rows(spec.id, p),
            Some(rows),
            "the manifest agrees"
        );
        all.extend(got);
    }
    assert_eq!(checksum(&all), checksum(&input), "every row once");
}

/// Under push, a worker that ran no map but holds pushed blocks is lost after the map side:
/// the manifest names it as a holder of the map, so the loss is noticed (the job runs the
/// shuffle again) and every row comes back once. Before, only where a map ran was recorded:
/// the partitions it held came back empty, without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_push_holder_that_ran_no_map_keeps_every_row() {
    let _serial = SERIAL.lock().await;
    for strategy in ["push", "two-level"] {
        let mut cluster = LocalCluster::start(config(4, 1 << 30)).await.unwrap();
        let input = batches(20, 2_000);
        let want = checksum(&input);
        let opts = ShuffleOptions {
            map_bytes: 1 << 30,
            ..options(8, StrategyOptions::named(strategy).unwrap())
        };
        let job = start_job(&cluster, &input, &opts, Duration::ZERO).await;
        let summary = job.mapped().await.unwrap();
        assert_eq!(summary.maps, 1, "{strategy}: one map, on worker 0");
        let before = cluster.driver.replacements();
        // Push: partition p is held by worker p % 4; two-level: worker 1 holds the odd ones
        // of mapper 0. Worker 0 ran the map; worker 1 ran none and holds blocks either way.
        cluster.kill_worker(1).unwrap();
        let mut parts = Vec::new();
        read_rest(&job, 0, &mut parts).await;
        assert_eq!(parts.len(), 8, "{strategy}");
        let rows: Vec<usize> = parts
            .iter()
            .map(|p| p.iter().map(|b| b.num_rows()).sum())
            .collect();
        assert!(rows.iter().all(|&r| r > 0), "{strategy}: {rows:?}");
        assert_eq!(
            checksum(&parts.concat()),
            want,
            "{strategy}: every row once"
        );
        assert_eq!(
            cluster.driver.replacements(),
            before + 1,
            "{strategy}: the kill landed"
        );
        job.close().await.unwrap();
    }
}
