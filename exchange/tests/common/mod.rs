//! Helpers shared by the end-to-end tests: clusters, inputs, checksums, lineitem tasks.
#![allow(dead_code)]

use arrow::array::{Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use flightshuffle::checksum::Checksum;
use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle::driver::{MapInput, ShuffleSpec};
use flightshuffle::job::{self, ShuffleJob, ShuffleOptions};
use flightshuffle::strategy::{pull, StrategyOptions};
use flightshuffle::{partitioner, proto, ShuffleId};
use futures::TryStreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

pub fn config(workers: usize, budget: u64) -> LocalClusterConfig {
    let mut c = LocalClusterConfig::new(
        workers,
        vec![env!("CARGO_BIN_EXE_flightshuffle-worker").to_string()],
    );
    c.memory_budget = budget;
    c
}

pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Utf8, true),
    ]))
}

pub fn batches(n: usize, per: usize) -> Vec<RecordBatch> {
    (0..n)
        .map(|b| {
            let keys: Int64Array = (0..per).map(|i| ((b * per + i) % 997) as i64).collect();
            let vals: StringArray = (0..per)
                .map(|i| (i % 11 != 0).then(|| format!("value-{b}-{i}")))
                .collect();
            RecordBatch::try_new(schema(), vec![Arc::new(keys), Arc::new(vals)]).unwrap()
        })
        .collect()
}

pub fn checksum(batches: &[RecordBatch]) -> Checksum {
    let mut c = Checksum::default();
    for b in batches {
        c.add(Checksum::of_batch(b).unwrap());
    }
    c
}

/// A shuffle of [`schema`] rows into `partitions`, hashed on `k`, its map inputs checksummed.
pub fn spec_k(partitions: u32) -> ShuffleSpec {
    ShuffleSpec {
        id: ShuffleId::random(),
        schema: schema(),
        partitions,
        partitioner: partitioner::hash(&["k"]),
        checksum_inputs: true,
        combine: None,
    }
}

/// `input` as map inputs streamed from the driver (read once), `per` batches each.
pub fn stream_inputs(input: &[RecordBatch], per: usize) -> Vec<MapInput> {
    input
        .chunks(per.max(1))
        .map(|c| {
            let owned: Vec<RecordBatch> = c.to_vec();
            MapInput::Stream(Box::pin(futures::stream::iter(owned.into_iter().map(Ok))))
        })
        .collect()
}

/// Shuffle `input` from the driver in `maps` map tasks; return every partition's batches.
pub async fn shuffle(
    cluster: &LocalCluster,
    input: &[RecordBatch],
    maps: usize,
    partitions: u32,
) -> flightshuffle::Result<Vec<Vec<RecordBatch>>> {
    let driver = cluster.driver.clone();
    let spec = spec_k(partitions);
    driver.create_shuffle(&spec).await?;
    let chunk = input.len().div_ceil(maps);
    let inputs = stream_inputs(input, chunk);
    let mapped = pull::map_side(
        &driver,
        &spec,
        futures::stream::iter(inputs),
        StrategyOptions::default(),
    )
    .await?;
    assert_eq!(mapped.input, checksum(input));
    let mut out = Vec::new();
    for p in 0..partitions {
        let s = driver.read_partition(spec.id, p, true).await?;
        out.push(s.try_collect::<Vec<_>>().await?);
    }
    let reduced =
        pull::reduce_on_workers(&driver, &spec, "checksum", StrategyOptions::default()).await?;
    let mut on_workers = Checksum::default();
    for r in reduced {
        on_workers.add(Checksum {
            rows: r.input_rows,
            sum: r.input_checksum,
        });
    }
    assert_eq!(
        on_workers, mapped.input,
        "reducers on workers see the same multiset"
    );
    Ok(out)
}

pub fn assert_keys_not_split(parts: &[Vec<RecordBatch>]) {
    let mut home: HashMap<i64, usize> = HashMap::new();
    for (p, batches) in parts.iter().enumerate() {
        for b in batches {
            let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            for key in k.values() {
                assert_eq!(*home.entry(*key).or_insert(p), p, "key {key} split");
            }
        }
    }
}

/// Sum the `(rows, checksum)` rows a checksum reducer emits.
pub fn checksum_rows(batches: &[RecordBatch]) -> Checksum {
    use arrow::array::UInt64Array;
    let mut c = Checksum::default();
    for b in batches {
        let rows = b.column(0).as_any().downcast_ref::<UInt64Array>().unwrap();
        let sums = b.column(1).as_any().downcast_ref::<UInt64Array>().unwrap();
        for i in 0..b.num_rows() {
            c.add(Checksum {
                rows: rows.value(i),
                sum: sums.value(i),
            });
        }
    }
    c
}

/// A raw Flight client (no token) to worker `w`, over TLS with the cluster's CA when it has
/// one.
pub async fn raw_client(
    cluster: &LocalCluster,
    w: usize,
) -> arrow_flight::flight_service_client::FlightServiceClient<tonic::transport::Channel> {
    let addr = cluster.driver.worker(w).unwrap().addr.clone();
    let tls = cluster.driver.credentials().tls.clone();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint =
        tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}")).unwrap();
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls.config()).unwrap();
    }
    arrow_flight::flight_service_client::FlightServiceClient::new(endpoint.connect().await.unwrap())
}

pub fn lineitem_task(rows: u64) -> proto::TaskSource {
    lineitem_slice(0, rows, 4096, 0)
}

/// A lineitem source task: `rows` rows from `first`; attempt 0 waits `delay_ms` first.
pub fn lineitem_slice(
    first: u64,
    rows: u64,
    batch_rows: usize,
    delay_ms: u64,
) -> proto::TaskSource {
    let slice = flightshuffle::synthetic::LineitemSlice {
        first_attempt_delay_ms: delay_ms,
        first,
        rows,
        seed: 7,
        batch_rows,
    };
    proto::TaskSource {
        kind: flightshuffle::synthetic::LINEITEM_SOURCE.into(),
        payload: serde_json::to_vec(&slice).unwrap(),
    }
}

pub fn lineitem_spec(checksum_inputs: bool) -> ShuffleSpec {
    ShuffleSpec {
        id: ShuffleId::random(),
        schema: flightshuffle::synthetic::lineitem_schema(),
        partitions: 3,
        partitioner: partitioner::hash(&["l_orderkey"]),
        checksum_inputs,
        combine: None,
    }
}

/// A shuffle of `maps` map inputs of 200 rows, fed from the driver: each input counts in
/// `started` when it is first read (its map task started) and then waits for a permit of
/// `permits` before sending its rows; created on `driver`. For tests of when the map runner
/// starts maps.
pub struct Gated {
    pub spec: ShuffleSpec,
    pub inputs: Vec<MapInput>,
    /// The rows of all inputs.
    pub want: Checksum,
    pub started: Arc<std::sync::atomic::AtomicUsize>,
    pub permits: Arc<tokio::sync::Semaphore>,
}

pub async fn gated(driver: &flightshuffle::driver::Driver, maps: usize) -> Gated {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let input = batches(maps, 200);
    let want = checksum(&input);
    let started = Arc::new(AtomicUsize::new(0));
    let permits = Arc::new(tokio::sync::Semaphore::new(0));
    let inputs = input
        .into_iter()
        .map(|b| {
            let (started, permits) = (started.clone(), permits.clone());
            let once = futures::stream::once(async move {
                started.fetch_add(1, Ordering::SeqCst);
                let permit = permits.acquire().await.map_err(|e| {
                    flightshuffle::Error::Cancelled(format!("test gate closed: {e}"))
                })?;
                permit.forget();
                Ok(b)
            });
            MapInput::Stream(Box::pin(once))
        })
        .collect();
    let spec = spec_k(3);
    driver
        .create_shuffle(&spec)
        .await
        .expect("create the gated shuffle");
    Gated {
        spec,
        inputs,
        want,
        started,
        permits,
    }
}

/// Wait until `done()` holds, checking every 10 ms; panics after 30 s.
pub async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A hash shuffle on `k` into `partitions` under `strategy`.
pub fn options(partitions: u32, strategy: StrategyOptions) -> ShuffleOptions {
    ShuffleOptions {
        by: vec!["k".into()],
        partitions,
        partitioner: job::PartitionerKind::Hash,
        map_bytes: 60_000,
        strategy,
    }
}

/// Start a job of `input` with `opts`, one batch handed over every `pace`.
pub async fn start_job(
    cluster: &LocalCluster,
    input: &[RecordBatch],
    opts: &ShuffleOptions,
    pace: Duration,
) -> ShuffleJob {
    let owned: Vec<RecordBatch> = input.to_vec();
    let it: job::Input = Box::new(owned.into_iter().map(move |b| {
        std::thread::sleep(pace);
        Ok(b)
    }));
    let (spec, it) = job::prepare(&schema(), it, opts).unwrap();
    ShuffleJob::start(cluster.driver.clone(), spec, it, opts)
        .await
        .unwrap()
}

/// Read the rest of the job's partitions (in order from `next`), with a deadline.
pub async fn read_rest(job: &ShuffleJob, next: u32, parts: &mut Vec<Vec<RecordBatch>>) {
    let mut want = next;
    while let Some(p) = tokio::time::timeout(Duration::from_secs(120), job.next_partition())
        .await
        .expect("a partition within 120 s")
    {
        let (i, b) = p.unwrap();
        assert_eq!(i, want, "partitions in order, none twice");
        want += 1;
        parts.push(b);
    }
}

/// Every partition of a sealed `shuffle` read on the driver, in partition order.
pub async fn read_partitions(
    driver: &Arc<flightshuffle::driver::Driver>,
    shuffle: ShuffleId,
    partitions: u32,
) -> Vec<RecordBatch> {
    let mut out = Vec::new();
    for p in 0..partitions {
        let s = driver.read_partition(shuffle, p, true).await.unwrap();
        out.extend(s.try_collect::<Vec<_>>().await.unwrap());
    }
    out
}

/// A calibration whose Flight transport is slow (1 MB/s) and everything else fast: push wins
/// among the Flight strategies (it overlaps the transfer with the map side), and an exchange
/// through a store on local disk beats them all.
pub fn slow_network() -> proto::Calibration {
    proto::Calibration {
        partition_bytes_per_s: 1e9,
        encode_bytes_per_s: 1e9,
        decode_bytes_per_s: 1e9,
        block_overhead_s: 50e-6,
        disk_write_bytes_per_s: 1e9,
        disk_read_bytes_per_s: 1e9,
        request_s: 100e-6,
        network_bytes_per_s: 1e6,
        parallelism: 2,
        remote_block_s: 100e-6,
        merge_bytes_per_s: 1e9,
        ..Default::default()
    }
}
