//! Calibration of this machine for the `auto` strategy's cost model (Seer's idea), the
//! driver's part: a worker measures its own rates ([`crate::worker::probe`]); the driver adds
//! what only calls can show: the latency of one request, and from probe shuffles read back as
//! reducers read them, the cost of a remote block and the bytes per second of the transport
//! ([`crate::driver::Driver::calibration`]). Takes about a second. The result is cached in the
//! driver on first use. A store's rates ([`store_rates`]) are measured apart, on first use by
//! an exchange that has one, and cached with the store.

use crate::block::ShuffleId;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::{Error, Result};
use crate::proto;
use futures::StreamExt;
use std::sync::Arc;

/// Calibrate on a running cluster (see the module doc); [`Driver::calibration`] caches it.
impl Driver {
    /// This machine's calibration for the `auto` strategy, measured on first use: the
    /// first live worker's rates ([`crate::worker::probe`]), the fastest of a few small
    /// requests, and the cost of a remote block and of a byte, from probe shuffles.
    pub async fn calibration(self: &Arc<Self>) -> Result<proto::Calibration> {
        self.calibration_cell()
            .get_or_try_init(|| on_cluster(self))
            .await
            .cloned()
    }
}

/// Small ranged reads timed for a store's request rate, and how many are in flight at once
/// (as a reader keeps them, [`crate::direct`]).
const STORE_REQUESTS: usize = 256;
const STORE_IN_FLIGHT: usize = 64;
/// The object written and read whole for a store's byte rates.
const STORE_PROBE_BYTES: usize = 16 << 20;

/// The rates of the store `run` for the cost model, measured once from the driver: seconds
/// per request with [`STORE_IN_FLIGHT`] in flight, bytes per second of one large read and of
/// one large write. One probe object is written, read and deleted (its requests count in the
/// store's stats). The rates are one process's: the model takes them as the cluster's, which
/// is right for a store on this machine and conservative for one that scales with clients.
pub async fn store_rates(run: &crate::storage::RunStore) -> Result<[f64; 3]> {
    run.rates
        .get_or_try_init(|| async {
            let storage = &run.storage;
            let path = format!("{}/calibrate-{:016x}.bin", run.run, rand::random::<u64>());
            let data = bytes::Bytes::from(vec![7u8; STORE_PROBE_BYTES]);
            let t = std::time::Instant::now();
            storage.put(&path, data).await?;
            let write = STORE_PROBE_BYTES as f64 / t.elapsed().as_secs_f64().max(1e-6);
            let measured = async {
                let t = std::time::Instant::now();
                storage.get(&path).await?;
                let read = STORE_PROBE_BYTES as f64 / t.elapsed().as_secs_f64().max(1e-6);
                let t = std::time::Instant::now();
                let path = &path;
                let small = (0..STORE_REQUESTS).map(|i| async move {
                    let at = (i * 4096) as u64;
                    let range = at..at + 1024;
                    storage.get_ranges(path, std::slice::from_ref(&range)).await
                });
                let done: Vec<Result<Vec<bytes::Bytes>>> = futures::stream::iter(small)
                    .buffer_unordered(STORE_IN_FLIGHT)
                    .collect()
                    .await;
                for d in done {
                    d?;
                }
                let request = t.elapsed().as_secs_f64() / STORE_REQUESTS as f64;
                Ok::<_, Error>([request, read, write])
            }
            .await;
            let _ = storage.delete(&path).await;
            let rates = measured?;
            tracing::info!(
                ?rates,
                "store calibrated (s per request, read and write B/s)"
            );
            Ok(rates)
        })
        .await
        .copied()
}

async fn on_cluster(driver: &Arc<Driver>) -> Result<proto::Calibration> {
    let w = (0..driver.num_workers())
        .find(|&w| driver.is_alive(w))
        .ok_or_else(|| Error::Cluster("no live worker to calibrate on".into()))?;
    let client = driver.worker(w)?;
    let mut latencies = Vec::new();
    for _ in 0..7 {
        let t = std::time::Instant::now();
        client.health(driver.config().health_timeout).await?;
        latencies.push(t.elapsed().as_secs_f64());
    }
    // The fastest, as for every rate here: the median was at times 0.9-3.4 ms against a usual
    // 0.25, and a request cost that high left nothing of the probe's time for its blocks.
    let request_s = latencies.iter().copied().fold(f64::INFINITY, f64::min);
    let mut c = client
        .calibrate(&proto::CalibrateTask {
            measure: true,
            disk_bytes: 32 << 20,
        })
        .await?;
    c.request_s = request_s;
    let loopback = driver
        .addresses()
        .iter()
        .all(|a| a.starts_with("127.") || a.starts_with("localhost") || a.starts_with("[::1]"));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = driver.num_workers();
    c.parallelism = if loopback { n.min(cores) } else { n } as u32;
    c.remote_block_s = remote_block_cost(driver, w, request_s).await?;
    c.network_bytes_per_s = transport_rate(driver, w, &c).await?;
    tracing::info!(?c, "calibrated");
    Ok(c)
}

/// Seconds per small block read from worker `from` inside partition streams: a probe
/// shuffle of 8 maps x 64 partitions of ~8 rows per block, read back on the driver.
async fn remote_block_cost(driver: &Arc<Driver>, from: usize, request_s: f64) -> Result<f64> {
    const PARTITIONS: u32 = 64;
    let read = probe(driver, from, 8, PARTITIONS, 8 * PARTITIONS as u64).await?;
    let secs = read.seconds - PARTITIONS as f64 * request_s;
    Ok((secs / read.blocks.max(1) as f64).max(0.0))
}

/// Bytes per second of the transport as reducers see it: large blocks (4 of ~6 MB) read from
/// worker `from` as partition streams, less what the calibration already charges them (a
/// request per partition, a remote block each, decoding). A unary call carrying 16 MiB of
/// ballast, which this replaced, measured 60 MB/s here, where partition streams move
/// 0.7-0.9 GB/s.
async fn transport_rate(driver: &Arc<Driver>, from: usize, c: &proto::Calibration) -> Result<f64> {
    const PARTITIONS: u32 = 2;
    let read = probe(driver, from, 2, PARTITIONS, 65_536).await?;
    let decode = if c.decode_bytes_per_s > 0.0 {
        read.bytes as f64 / c.decode_bytes_per_s
    } else {
        0.0
    };
    let fixed = PARTITIONS as f64 * c.request_s + read.blocks as f64 * c.remote_block_s + decode;
    // The costs charged apart can at most halve the read's time: a calibration whose other
    // figures came out too slow (a busy spell) does not make the transport look free.
    let half = read.seconds / 2.0;
    if read.seconds - fixed < half {
        tracing::warn!(
            read = read.seconds,
            fixed,
            "calibration: the transport probe's read took little more than its fixed costs"
        );
    }
    let secs = (read.seconds - fixed).max(half).max(1e-6);
    Ok(read.bytes as f64 / secs)
}

/// What reading a probe shuffle back took: the fastest of [`PROBE_READS`] reads.
struct ProbeRead {
    seconds: f64,
    blocks: usize,
    /// The rows' in-memory bytes (the unit of every rate), not their encoded blocks'.
    bytes: u64,
}

/// Reads of a probe shuffle; the fastest counts (as for the worker's rates).
const PROBE_READS: usize = 3;

/// Drops a probe shuffle whose probe was cancelled (a dropped calibration future): its blocks
/// would otherwise stay held against the worker's budget. A probe that ends drops its own.
struct DropProbe(Option<(Arc<Driver>, ShuffleId)>);

impl Drop for DropProbe {
    fn drop(&mut self) {
        if let (Some((driver, id)), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current())
        {
            rt.spawn(async move {
                let _ = driver.drop_shuffle(id).await;
            });
        }
    }
}

/// A probe shuffle: `maps` maps of `rows` lineitem rows each, run one after the other on
/// worker `from` (within its budget), hashed into `partitions`, sealed, and read back whole
/// on the driver [`PROBE_READS`] times.
async fn probe(
    driver: &Arc<Driver>,
    from: usize,
    maps: u64,
    partitions: u32,
    rows: u64,
) -> Result<ProbeRead> {
    let spec = ShuffleSpec {
        id: ShuffleId::random(),
        schema: crate::synthetic::lineitem_schema(),
        partitions,
        partitioner: crate::partitioner::hash(&["l_orderkey"]),
        checksum_inputs: false,
        combine: None,
    };
    let mut guard = DropProbe(Some((driver.clone(), spec.id)));
    let out = probe_run(driver, &spec, from, maps, rows).await;
    // Dropped before returning, so the caller sees the worker without it.
    guard.0 = None;
    let _ = driver.drop_shuffle(spec.id).await;
    out
}

async fn probe_run(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    from: usize,
    maps: u64,
    rows: u64,
) -> Result<ProbeRead> {
    let partitions = spec.partitions;
    driver.create_shuffle(spec).await?;
    let mut input_bytes = 0;
    for m in 0..maps {
        let slice = crate::synthetic::LineitemSlice {
            first_attempt_delay_ms: 0,
            first: m * rows,
            rows,
            seed: 7,
            batch_rows: rows as usize,
        };
        let source = proto::TaskSource {
            kind: crate::synthetic::LINEITEM_SOURCE.into(),
            payload: serde_json::to_vec(&slice).unwrap_or_default(),
        };
        let done = driver
            .submit_map(spec.id, m as u32, from, MapInput::Source(source))
            .await
            .map_err(|e| Error::Cluster(format!("calibration probe: {e}")))??;
        input_bytes += done.input_bytes;
    }
    driver.seal(spec.id).await?;
    let blocks = driver.blocks_of(spec.id);
    let encoded: u64 = blocks.iter().map(|b| b.meta.bytes).sum();
    let mut seconds = f64::INFINITY;
    for _ in 0..PROBE_READS {
        let start = std::time::Instant::now();
        for p in 0..partitions {
            let mut s = driver.read_partition(spec.id, p, true).await?;
            while let Some(b) = s.next().await {
                b?;
            }
        }
        seconds = seconds.min(start.elapsed().as_secs_f64());
    }
    Ok(ProbeRead {
        seconds,
        blocks: blocks.len(),
        // As `auto` counts an exchange's bytes: encoded blocks when the input's size is
        // unknown (or a slice reports its parent buffer), compressed ones included.
        bytes: if input_bytes > 0 {
            input_bytes.min(encoded)
        } else {
            encoded
        },
    })
}

/// A calibration as JSON (benchmark reports, `Cluster.calibration()`).
pub fn to_json(c: &proto::Calibration) -> serde_json::Value {
    serde_json::json!({
        "partition_bytes_per_s": c.partition_bytes_per_s,
        "encode_bytes_per_s": c.encode_bytes_per_s,
        "decode_bytes_per_s": c.decode_bytes_per_s,
        "block_overhead_s": c.block_overhead_s,
        "remote_block_s": c.remote_block_s,
        "merge_bytes_per_s": c.merge_bytes_per_s,
        "disk_write_bytes_per_s": c.disk_write_bytes_per_s,
        "disk_read_bytes_per_s": c.disk_read_bytes_per_s,
        "request_s": c.request_s,
        "network_bytes_per_s": c.network_bytes_per_s,
        "parallelism": c.parallelism,
    })
}
