//! TPC-H through the distributed exchange with real worker processes (this crate's binary in
//! `worker` mode): answers equal single-process DataFusion's, and staged plans are snapshotted
//! so a change in staging shows up in review.

use datafusion::prelude::{SessionConfig, SessionContext};
use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle_datafusion::DistributedContext;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const SF: f64 = 0.01;

fn data() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("flightshuffle-tpch-test-sf{SF}"));
        if !tpch::is_generated(&dir) {
            tpch::generate(SF, &dir, false).unwrap();
        }
        dir
    })
}

/// A cluster and a context that cuts every gather into a stage (at SF 0.01 every table is
/// under the default small-gather threshold, and these tests are about the exchange).
async fn cluster(workers: usize) -> (LocalCluster, DistributedContext) {
    cluster_with_broadcasts(workers, None).await
}

/// As [`cluster`], with DataFusion's broadcast threshold (bytes and rows) set to `threshold`.
async fn cluster_with_broadcasts(
    workers: usize,
    threshold: Option<usize>,
) -> (LocalCluster, DistributedContext) {
    let cfg = LocalClusterConfig::new(
        workers,
        vec![env!("CARGO_BIN_EXE_tpch").to_string(), "worker".into()],
    );
    let cluster = LocalCluster::start(cfg).await.unwrap();
    let mut config = DistributedContext::default_config(workers);
    if let Some(t) = threshold {
        let opts = &mut config.options_mut().optimizer;
        opts.hash_join_single_partition_threshold = t;
        opts.hash_join_single_partition_threshold_rows = t;
    }
    // Every query distributed, however small the test data.
    let mut options = flightshuffle_datafusion::FlightshuffleOptions::default();
    options.small_query_rows = 0;
    let config = config.with_option_extension(options);
    let ctx = DistributedContext::new(cluster.driver.clone(), config)
        .unwrap()
        .with_small_gather_rows(0);
    tpch::register(ctx.session(), data()).await.unwrap();
    (cluster, ctx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_queries_match_single_process_datafusion() {
    let (_cluster, ctx) = cluster(2).await;
    let local = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    tpch::register(&local, data()).await.unwrap();
    let mut wrong = Vec::new();
    for q in 1..=22 {
        let sql = tpch::query(q, SF).unwrap();
        let expected = local.sql(&sql).await.unwrap().collect().await.unwrap();
        match ctx.sql(&sql).await {
            Ok(got) => {
                if let Err(e) = tpch::check::compare(&expected, &got.batches, tpch::is_ordered(q)) {
                    wrong.push(format!("q{q}: {e}"));
                }
                assert!(!got.stages.is_empty(), "q{q} ran no exchange");
                // One map task per (stage, worker), except sorted runs (one per partition).
                for s in &got.stages {
                    assert!(s.median_partition_bytes <= s.max_partition_bytes);
                    assert!(
                        s.max_partition_bytes <= s.bytes
                            && (s.bytes == 0) == (s.max_partition_bytes == 0)
                    );
                    assert!(
                        s.exchange.starts_with("sorted runs") || s.tasks <= 2,
                        "q{q} stage {} ran {} map tasks on 2 workers",
                        s.stage,
                        s.tasks
                    );
                }
            }
            Err(e) => wrong.push(format!("q{q} failed: {e}")),
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// With the default threshold, a query over small tables runs whole on the driver, and one
/// that scans a large table keeps its stages (the check reads every node, scans included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_exchange_free_gathers_are_not_cut() {
    let (_cluster, ctx) = cluster(2).await;
    let ctx = ctx.with_small_gather_rows(flightshuffle_datafusion::planner::SMALL_GATHER_ROWS);
    let small = ctx
        .plan("SELECT n_name, r_name FROM nation JOIN region ON n_regionkey = r_regionkey")
        .await
        .unwrap();
    assert!(small.stages.is_empty(), "{}", small.display());
    let sql = tpch::query(6, SF).unwrap();
    let tiny = ctx.with_small_gather_rows(10);
    assert!(!tiny.plan(&sql).await.unwrap().stages.is_empty());
}

/// With every query's work on the workers, a query without any exchange (an in-memory
/// table of one partition, travelling inside the plan) runs as one task on a worker, and its
/// answer (ordered too) equals single-process DataFusion's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_without_exchanges_run_on_a_worker_when_asked() {
    let (_cluster, ctx) = cluster(2).await;
    let ctx = ctx.with_all_on_workers(true);
    let local = SessionContext::new();
    let create = "CREATE TABLE t AS VALUES (3, 'c'), (1, 'a'), (2, NULL), (1, 'b')";
    for c in [ctx.session(), &local] {
        c.sql(create).await.unwrap().collect().await.unwrap();
    }
    for sql in [
        "SELECT column1 + 1 AS x, column2 FROM t ORDER BY x DESC, column2",
        "SELECT 1 + 2",
        "SELECT column2 FROM t WHERE column1 = 1 ORDER BY column2",
    ] {
        let staged = ctx.plan(sql).await.unwrap();
        assert_eq!(staged.stages.len(), 1, "{sql}: {}", staged.display());
        let got = ctx.sql(sql).await.unwrap();
        let want = local.sql(sql).await.unwrap().collect().await.unwrap();
        let fmt = |b: &[arrow::array::RecordBatch]| {
            arrow::util::pretty::pretty_format_batches(b)
                .unwrap()
                .to_string()
        };
        assert_eq!(fmt(&got.batches), fmt(&want), "{sql}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_plans_snapshot() {
    let (_cluster, ctx) = cluster(2).await;
    for q in 1..=22 {
        let sql = tpch::query(q, SF).unwrap();
        let text = ctx.explain(&sql, false).await.unwrap();
        insta::assert_snapshot!(format!("q{q:02}"), redact(&text, data()));
    }
}

/// A plan's text with what changes from run to run or machine to machine taken out: the data
/// directory (as `<data>`).
fn redact(plan: &str, data: &Path) -> String {
    let root = data.to_string_lossy();
    plan.replace(root.trim_start_matches('/'), "<data>")
}

/// A hash exchange hashes plain key columns where they are (no copy of the key travels with
/// each row), and hash-exchanged joins on columns and on expressions (which DataFusion
/// evaluates into columns below the exchange) give single-process answers. Broadcasts are off
/// here so the joins are hash-exchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_exchanges_hash_key_columns_in_place() {
    let (_cluster, ctx) = cluster_with_broadcasts(2, Some(0)).await;
    let local = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    tpch::register(&local, data()).await.unwrap();
    let select = "SELECT count(*) AS n, sum(o_totalprice) AS p, min(c_name) AS c, \
                  max(o_comment) AS m FROM orders JOIN customer";
    for on in ["o_custkey = c_custkey", "o_custkey + 1 = c_custkey + 1"] {
        let sql = format!("{select} ON {on}");
        let text = ctx.explain(&sql, false).await.unwrap();
        assert!(text.contains("HashJoinExec: mode=Partitioned"), "{text}");
        assert!(!text.contains("__fs_key_"), "{text}");
        let got = ctx.sql(&sql).await.unwrap();
        assert!(
            got.stages
                .iter()
                .filter(|s| s.exchange.starts_with("hash("))
                .count()
                >= 2
        );
        let expected = local.sql(&sql).await.unwrap().collect().await.unwrap();
        tpch::check::compare(&expected, &got.batches, false).unwrap();
    }
}

/// Over DataFusion's absolute broadcast threshold (1 byte here), a join whose build side is
/// small next to its probe side is still broadcast (`crate::broadcast`), with the same answer;
/// a zero threshold turns broadcasts off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_with_a_relatively_small_build_side_are_broadcast() {
    let local = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    tpch::register(&local, data()).await.unwrap();
    let sql = "SELECT count(*) AS n, sum(l_quantity) AS q, max(o_comment) AS m \
               FROM lineitem JOIN orders ON l_orderkey = o_orderkey WHERE o_orderpriority = '1-URGENT'";
    let expected = local.sql(sql).await.unwrap().collect().await.unwrap();
    for (threshold, mode) in [(1, "CollectLeft"), (0, "Partitioned")] {
        let (_cluster, ctx) = cluster_with_broadcasts(2, Some(threshold)).await;
        let text = ctx.explain(sql, false).await.unwrap();
        assert!(
            text.contains(&format!("HashJoinExec: mode={mode}")),
            "{text}"
        );
        let got = ctx.sql(sql).await.unwrap();
        tpch::check::compare(&expected, &got.batches, false).unwrap();
    }
}

/// Exchanges set to the merged strategy stream to their consumers like pull (a pipelined
/// reader starts before the maps end, so the store refuses merges) and give the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_exchanges_under_pipelined_readers_give_the_same_answers() {
    let (_cluster, ctx) = cluster(2).await;
    let local = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    tpch::register(&local, data()).await.unwrap();
    for q in [3, 18] {
        let sql = tpch::query(q, SF).unwrap();
        let mut staged = ctx.plan(&sql).await.unwrap();
        let ids: Vec<u32> = staged.stages.iter().map(|s| s.id()).collect();
        for id in ids {
            staged
                .set_strategy(id, flightshuffle::strategy::Strategy::Merged)
                .unwrap();
        }
        assert!(staged.display().contains("strategy merged"));
        let (got, _) = ctx.execute(&staged).await.unwrap();
        let expected = local.sql(&sql).await.unwrap().collect().await.unwrap();
        tpch::check::compare(&expected, &got, tpch::is_ordered(q)).unwrap();
    }
}
