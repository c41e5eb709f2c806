//! Shrinking a cluster with real worker processes and a real store (`file://`):
//! `remove_worker` takes a worker out for good while shuffles of every strategy are alive and
//! half read; the rest of each reads exactly, no map runs again, the process is gone, and the
//! smaller cluster runs new shuffles exactly. What cannot be removed without losing rows is
//! refused, naming the shuffle, with nothing changed.

use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle::strategy::StrategyOptions;
use flightshuffle::StorageConfig;
use std::path::Path;
use std::time::Duration;

mod common;
use common::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn durable_config(workers: usize, dir: &Path) -> LocalClusterConfig {
    let mut cfg = config(workers, 1 << 30);
    let url = format!("file://{}", dir.display());
    cfg.driver.storage = Some(StorageConfig::new(url, []).unwrap());
    cfg
}

fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// One shuffle of `input` with `strategy`, every partition read, exact.
async fn run_exact(cluster: &LocalCluster, strategy: &str, input: &[arrow::array::RecordBatch]) {
    let opts = options(8, StrategyOptions::named(strategy).unwrap());
    let job = start_job(cluster, input, &opts, Duration::ZERO).await;
    let mut parts = Vec::new();
    read_rest(&job, 0, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), checksum(input), "{strategy}");
    assert_keys_not_split(&parts);
    job.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_worker_costs_no_row_and_no_map_rerun() {
    flightshuffle::worker::init_logging();
    let _serial = SERIAL.lock().await;
    let store = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(durable_config(5, store.path()))
        .await
        .unwrap();
    let input = batches(60, 2_000);
    let want = checksum(&input);
    // (strategy, slot removed): a middle slot, the first, the last, a middle one again.
    let rounds = [("pull", 1), ("merged", 0), ("push", 2), ("two-level", 1)];
    for (round, (strategy, slot)) in rounds.into_iter().enumerate() {
        let n = cluster.driver.num_workers();
        let (recomputed, reruns) = (cluster.driver.recomputed_maps(), cluster.driver.reruns());
        let opts = options(8, StrategyOptions::named(strategy).unwrap());
        let job = start_job(&cluster, &input, &opts, Duration::ZERO).await;
        let summary = job.mapped().await.unwrap();
        assert!(summary.maps >= 6, "{summary:?}");
        // Every slot ran maps: the removed one holds committed blocks.
        assert!(
            cluster.driver.live_blocks_on(job.id, slot) > 0,
            "round {round}: slot {slot} holds blocks"
        );
        let mut parts = Vec::new();
        let (_, first) = job.next_partition().await.unwrap().unwrap();
        parts.push(first);
        let pids = cluster.pids();
        let gone = pids[slot];
        let retired = cluster.remove_worker(slot).await.unwrap();
        assert_eq!(cluster.driver.num_workers(), n - 1, "round {round}");
        assert_eq!(cluster.pids().len(), n - 1);
        assert!(!cluster.pids().contains(&gone));
        assert!(!process_exists(gone), "round {round}: the process stopped");
        assert_eq!(retired.through_store, 1, "round {round}: {retired:?}");
        if slot < n - 1 {
            assert_eq!(retired.moved_from, Some(n - 1));
            assert_eq!(cluster.pids()[slot], pids[n - 1], "the last slot moved in");
        }
        read_rest(&job, 1, &mut parts).await;
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
            "round {round}: no map ran again"
        );
        assert_eq!(cluster.driver.reruns(), reruns, "round {round}: no rerun");
        job.close().await.unwrap();
        // The smaller cluster runs a new shuffle of the same strategy exactly.
        run_exact(&cluster, strategy, &input).await;
    }
    assert_eq!(cluster.driver.num_workers(), 1);
    // Nothing left in the store once every shuffle was dropped.
    let left: Vec<_> = walk(store.path());
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_would_lose_rows_is_refused_naming_the_shuffle() {
    flightshuffle::worker::init_logging();
    let _serial = SERIAL.lock().await;
    let input = batches(30, 1_000);
    // Not durable: a live shuffle's blocks exist only on the workers.
    let cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let opts = options(4, StrategyOptions::named("pull").unwrap());
    let job = start_job(&cluster, &input, &opts, Duration::ZERO).await;
    job.mapped().await.unwrap();
    let err = cluster.remove_worker(1).await.unwrap_err().to_string();
    assert!(
        err.contains(&job.id.to_string()) && err.contains("not durable"),
        "{err}"
    );
    assert_eq!(cluster.driver.num_workers(), 3, "nothing changed");
    assert!(cluster.pids().iter().all(|&p| process_exists(p)));
    let mut parts = Vec::new();
    read_rest(&job, 0, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), checksum(&input));
    job.close().await.unwrap();
    // No shuffle alive: nothing to lose, so it goes.
    cluster.remove_worker(2).await.unwrap();
    assert_eq!(cluster.driver.num_workers(), 2);
    run_exact(&cluster, "push", &input).await;
    drop(cluster);

    // Durable, but the map side still running (a slow producer).
    let store = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(durable_config(2, store.path()))
        .await
        .unwrap();
    let job = start_job(&cluster, &input, &opts, Duration::from_millis(20)).await;
    let err = cluster.remove_worker(0).await.unwrap_err().to_string();
    assert!(err.contains("still being written"), "{err}");
    let mut parts = Vec::new();
    read_rest(&job, 0, &mut parts).await;
    assert_eq!(checksum(&parts.concat()), checksum(&input));
    job.close().await.unwrap();
    cluster.remove_worker(0).await.unwrap();
    let err = cluster.remove_worker(0).await.unwrap_err().to_string();
    assert!(err.contains("last worker"), "{err}");
    let err = cluster.remove_worker(5).await.unwrap_err().to_string();
    assert!(err.contains("no worker 5"), "{err}");
    run_exact(&cluster, "pull", &input).await;
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
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
