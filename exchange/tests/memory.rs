//! One memory budget per worker, on real worker processes: concurrent shuffles share each
//! worker's budget through task admission, and calibrating for `auto` stays small.

use arrow::array::RecordBatch;
use flightshuffle::cluster::LocalCluster;

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_shuffles_share_each_workers_budget() {
    // 64 MiB: map buffers of 8 MiB, so grants of 16 MiB and four tasks at once per worker,
    // where four concurrent shuffles ask for eight.
    let budget = 64u64 << 20;
    let grant = flightshuffle::MapConfig::for_budget(budget).task_grant();
    assert_eq!(grant, 16 << 20);
    let cluster = LocalCluster::start(config(2, budget)).await.unwrap();
    let input = batches(24, 2_000);
    let runs = (0..4).map(|_| shuffle(&cluster, &input, 8, 4));
    for parts in futures::future::try_join_all(runs).await.unwrap() {
        let all: Vec<RecordBatch> = parts.iter().flatten().cloned().collect();
        assert_eq!(checksum(&all), checksum(&input));
    }
    for s in cluster.driver.stats().await.unwrap() {
        assert!(s.admitted_tasks >= 8, "{s:?}");
        assert!(s.waited_tasks > 0, "no task waited for room: {s:?}");
        // Over the budget only by tasks of a lower order than all running ones.
        assert!(
            s.peak_granted_bytes <= budget + s.overdraft_tasks * grant,
            "{s:?}"
        );
        assert!(
            s.peak_running_tasks <= budget / grant + s.overdraft_tasks,
            "{s:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calibrating_stays_small() {
    // `auto` calibrates on the first live worker the first time it is used, on a cluster that
    // may be busy: its scratch data must fit beside the tasks (it once peaked at 276 MB, and
    // glibc kept it resident).
    let cluster = LocalCluster::start(config(2, 64 << 20)).await.unwrap();
    let stats_before = cluster.driver.stats().await.unwrap()[0];
    let before = stats_before.peak_rss_bytes;
    let c = cluster.driver.calibration().await.unwrap();
    assert!(
        c.merge_bytes_per_s > 0.0 && c.partition_bytes_per_s > 0.0,
        "{c:?}"
    );
    let after = cluster.driver.stats().await.unwrap()[0];
    // The transport is timed as reducers see it, through partition streams of probe
    // shuffles read back three times each (64 + 2 partitions): not one unary call.
    let (rpcs_before, rpcs_after) = (stats_before.rpcs, after.rpcs);
    assert!(
        rpcs_after - rpcs_before >= 3 * (64 + 2),
        "{rpcs_before} -> {rpcs_after} calls"
    );
    assert!(c.network_bytes_per_s > 0.0, "{c:?}");
    assert_eq!(
        after.shuffles, stats_before.shuffles,
        "a probe shuffle was left"
    );
    let grown = after.peak_rss_bytes.saturating_sub(before);
    assert!(
        grown < 128 << 20,
        "calibrating grew the worker's peak RSS by {} MiB",
        grown >> 20
    );
    assert!(after.admitted_tasks > 0, "{after:?}");
}
