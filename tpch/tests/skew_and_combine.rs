//! In-exchange combining and skew splits with real worker processes.
//!
//! Combining: a grouped aggregate's exchange moves fewer bytes with combining than without,
//! with the same answer.
//!
//! Skew splits of join probe sides: a fact table where one key holds
//! two thirds of the rows, joined to a dimension table without broadcasts (both sides hash-exchanged).
//! The hot probe partition is split across tasks, and every answer equals single-process
//! DataFusion's; joins whose build rows are emitted at the end are not split, and are exact too.

use datafusion::prelude::{SessionConfig, SessionContext};
use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle_datafusion::DistributedContext;
use std::path::{Path, PathBuf};

/// Four fact files (so four map tasks) of 250k rows, key 7 on two rows of three; 5000 dim rows.
async fn make_data() -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!(
        "flightshuffle-skew-test-{}-{n}",
        std::process::id()
    ));
    std::fs::create_dir_all(dir.join("fact")).unwrap();
    {
        {
            let ctx = SessionContext::new();
            for f in 0..4 {
                let sql = format!(
                    "COPY (SELECT CASE WHEN i % 3 = 0 THEN i % 5000 ELSE 7 END AS k, i AS v, \
                     'row ' || CAST(i AS VARCHAR) AS s \
                     FROM (SELECT unnest(range({lo}, {hi})) AS i)) TO '{}' STORED AS PARQUET",
                    dir.join(format!("fact/{f}.parquet")).display(),
                    lo = f * 250_000,
                    hi = (f + 1) * 250_000,
                );
                ctx.sql(&sql).await.unwrap().collect().await.unwrap();
            }
            let sql = format!(
                "COPY (SELECT i AS k, i * 3 AS w, 'dim ' || CAST(i AS VARCHAR) AS name \
                 FROM (SELECT unnest(range(0, 5000)) AS i)) TO '{}' STORED AS PARQUET",
                dir.join("dim.parquet").display()
            );
            ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        }
    }
    dir
}

async fn register(ctx: &SessionContext, data: &Path) {
    let opts = datafusion::prelude::ParquetReadOptions::default();
    let fact = data.join("fact");
    ctx.register_parquet("fact", fact.to_str().unwrap(), opts.clone())
        .await
        .unwrap();
    let dim = data.join("dim.parquet");
    ctx.register_parquet("dim", dim.to_str().unwrap(), opts)
        .await
        .unwrap();
}

/// Two workers, no broadcast joins, skew splits from 100 KB.
async fn cluster(data: &Path) -> (LocalCluster, DistributedContext) {
    let cfg = LocalClusterConfig::new(
        2,
        vec![env!("CARGO_BIN_EXE_tpch").to_string(), "worker".into()],
    );
    let cluster = LocalCluster::start(cfg).await.unwrap();
    let mut config = DistributedContext::default_config(2);
    let opts = &mut config.options_mut().optimizer;
    opts.hash_join_single_partition_threshold = 0;
    opts.hash_join_single_partition_threshold_rows = 0;
    // Every query distributed, however small the test data.
    let mut options = flightshuffle_datafusion::FlightshuffleOptions::default();
    options.small_query_rows = 0;
    let config = config.with_option_extension(options);
    let ctx = DistributedContext::new(cluster.driver.clone(), config).unwrap();
    register(ctx.session(), data).await;
    ctx.sql("SET flightshuffle.skew_min_bytes = 100000")
        .await
        .unwrap();
    ctx.sql("SET flightshuffle.skew_factor = 3").await.unwrap();
    (cluster, ctx)
}

const QUERIES: [(&str, bool); 5] = [
    // Inner join: the probe side (fact) splits.
    (
        "SELECT f.v % 10 AS g, count(*) AS n, sum(f.v + d.w) AS t, max(f.s) AS ms, \
         min(d.name) AS dn FROM fact f JOIN dim d ON f.k = d.k GROUP BY f.v % 10 ORDER BY g",
        true,
    ),
    // Every fact row with its match or nulls (a right join after the build side is chosen).
    (
        "SELECT count(*) AS n, count(d.k) AS matched, sum(f.v) AS t \
         FROM fact f LEFT JOIN (SELECT * FROM dim WHERE w % 2 = 0) d ON f.k = d.k",
        true,
    ),
    // Semi join on the fact side.
    (
        "SELECT count(*) AS n, sum(v) AS t FROM fact \
         WHERE k IN (SELECT k FROM dim WHERE w % 3 = 0)",
        true,
    ),
    // Dimension rows without a match are emitted at the end: never split, still exact.
    (
        "SELECT count(*) AS n, count(f.v) AS matched FROM dim d FULL JOIN fact f ON f.k = d.k",
        false,
    ),
    // Grouped by the join key, the aggregate needs whole partitions: never split.
    (
        "SELECT f.k, count(*) AS n, sum(d.w) AS t FROM fact f JOIN dim d ON f.k = d.k \
         GROUP BY f.k ORDER BY f.k",
        false,
    ),
];

fn split_note(stages: &[flightshuffle_datafusion::StageMetrics]) -> Option<String> {
    stages
        .iter()
        .map(|s| s.strategy.clone())
        .find(|s| s.contains("skew split"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_probe_partition_is_split_and_the_answer_is_exact() {
    let local = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let data = make_data().await;
    register(&local, &data).await;
    let (_cluster, ctx) = cluster(&data).await;
    for (sql, splits) in QUERIES {
        let expected = local.sql(sql).await.unwrap().collect().await.unwrap();
        let got = ctx.sql(sql).await.unwrap();
        tpch::check::compare(&expected, &got.batches, false)
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let note = split_note(&got.stages);
        assert_eq!(note.is_some(), splits, "{sql}: {:#?}", got.stages);
        if let Some(note) = note {
            assert!(note.contains("partition"), "{note}");
        }
    }
    // Turned off: nothing splits, same answer.
    ctx.sql("SET flightshuffle.skew_factor = 0").await.unwrap();
    let (sql, _) = QUERIES[0];
    let got = ctx.sql(sql).await.unwrap();
    assert_eq!(split_note(&got.stages), None);
    let expected = local.sql(sql).await.unwrap().collect().await.unwrap();
    tpch::check::compare(&expected, &got.batches, false).unwrap();
    let _ = std::fs::remove_dir_all(&data);
}

/// A grouped aggregate: each map task runs two plan partitions (two partial aggregates), so
/// every group leaves a task twice without combining and once with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn combining_moves_fewer_bytes_and_keeps_the_answer() {
    let local = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let data = make_data().await;
    register(&local, &data).await;
    let (_cluster, ctx) = cluster(&data).await;
    let sql = "SELECT v % 20000 AS g, count(*) AS n, sum(v) AS t, avg(k) AS a, max(s) AS m \
               FROM fact GROUP BY v % 20000 ORDER BY g";
    let expected = local.sql(sql).await.unwrap().collect().await.unwrap();
    let mut bytes = Vec::new();
    for on in ["true", "false"] {
        ctx.sql(&format!("SET flightshuffle.combine = {on}"))
            .await
            .unwrap();
        let got = ctx.sql(sql).await.unwrap();
        tpch::check::compare(&expected, &got.batches, true).unwrap();
        let agg = got
            .stages
            .iter()
            .find(|s| s.exchange.starts_with("hash"))
            .expect("an aggregate exchange");
        bytes.push(agg.bytes);
    }
    assert!(
        (bytes[0] as f64) < 0.75 * bytes[1] as f64,
        "combined {} bytes, not combined {}",
        bytes[0],
        bytes[1]
    );
    let _ = std::fs::remove_dir_all(&data);
}
