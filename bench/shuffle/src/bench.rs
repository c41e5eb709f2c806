//! The shuffle bench as a library module of the `flightshuffle-shuffle-bench` binary.
//!
//! `shuffle-bench`: generate lineitem-like rows on the workers, pull-shuffle them by
//! `l_orderkey` into R partitions reduced on the workers — reducers start with the maps and
//! stream each committed map output — check the output multiset against the input (rows and
//! content checksum), and compare with two references measured in the same run: the
//! in-process Arrow IPC encode+decode ceiling, and the same-pipeline bound (every step the
//! rows go through — generate, checksum, hash-partition, encode, decode, checksum again — on
//! one thread, divided by the cores this machine has).

use flightshuffle::block::{decode_block, encode_block, Compression, ShuffleId};
use flightshuffle::checksum::Checksum;
use flightshuffle::cluster::{HostedCluster, LocalCluster, LocalClusterConfig};
use flightshuffle::driver::{MapInput, ShuffleSpec};
use flightshuffle::strategy::{self, pull, StrategyOptions};
use flightshuffle::synthetic::{lineitem_schema, LineitemSlice, LINEITEM_SOURCE};
use flightshuffle::{partitioner, proto};
use flightshuffle::{Error, Result};
use serde_json::json;
use std::time::Instant;

#[derive(Clone)]
pub struct BenchConfig {
    pub rows: u64,
    pub partitions: u32,
    /// Map tasks; 0 = four per worker.
    pub maps: u32,
    pub batch_rows: usize,
    pub seed: u64,
    pub cluster: LocalClusterConfig,
    /// Workers already running at these addresses (started by hand, e.g. on simulated
    /// hosts), dialled with these credentials, instead of the local cluster.
    pub hosted: Option<(Vec<String>, flightshuffle::transport::Credentials)>,
    /// Start the reducers only once the map side is sealed (the pre-pipelining behaviour).
    pub sequential: bool,
    /// The map side's strategy (`merged` starts the reducers after the seal: merges are
    /// refused once readers have started).
    pub strategy: flightshuffle::strategy::Strategy,
    /// Parity shards per stripe (0: none).
    pub parity: u32,
}

/// Rows of the IPC ceiling sample (enough to be stable, small enough to be quick).
const CEILING_ROWS: u64 = 2_000_000;

pub async fn shuffle_bench(cfg: BenchConfig) -> Result<serde_json::Value> {
    if cfg.rows == 0 || cfg.partitions == 0 {
        return Err(Error::invalid(
            "shuffle-bench needs rows > 0 and partitions > 0",
        ));
    }
    let workers = match &cfg.hosted {
        Some((addrs, _)) => addrs.len(),
        None => cfg.cluster.workers,
    };
    let maps = if cfg.maps == 0 {
        4 * workers as u32
    } else {
        cfg.maps
    } as u64;
    let ceiling = ipc_ceiling(cfg.rows.min(CEILING_ROWS), cfg.batch_rows, cfg.seed)?;

    let (mut local, hosted) = match &cfg.hosted {
        None => (Some(LocalCluster::start(cfg.cluster.clone()).await?), None),
        Some((addrs, creds)) => {
            let c = HostedCluster::connect(addrs, creds, cfg.cluster.driver.clone(), None, None);
            (None, Some(c.await?))
        }
    };
    let driver = match (&local, &hosted) {
        (Some(l), _) => l.driver.clone(),
        (_, Some(h)) => h.driver.clone(),
        _ => return Err(Error::Cluster("no cluster".into())),
    };
    // Idle memory of each worker (after its start-up imports settle), reported apart.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let idle: Vec<u64> = driver
        .stats()
        .await?
        .iter()
        .map(|s| s.peak_rss_bytes)
        .collect();
    let spec = ShuffleSpec {
        id: ShuffleId::random(),
        schema: lineitem_schema(),
        partitions: cfg.partitions,
        partitioner: partitioner::hash(&["l_orderkey"]),
        checksum_inputs: true,
        combine: None,
    };
    driver.create_shuffle(&spec).await?;
    let inputs = (0..maps).map(|m| {
        let first = cfg.rows * m / maps;
        let slice = LineitemSlice {
            first_attempt_delay_ms: 0,
            first,
            rows: cfg.rows * (m + 1) / maps - first,
            seed: cfg.seed,
            batch_rows: cfg.batch_rows,
        };
        MapInput::Source(proto::TaskSource {
            kind: LINEITEM_SOURCE.into(),
            payload: serde_json::to_vec(&slice).unwrap_or_default(),
        })
    });
    let sequential =
        cfg.sequential || cfg.strategy != flightshuffle::strategy::Strategy::Pull || cfg.parity > 0;
    let opts = StrategyOptions {
        strategy: cfg.strategy,
        parity: cfg.parity,
        // Reducers of every strategy but pull start after the seal.
        pack: sequential,
        ..StrategyOptions::default()
    };
    // Every reducer runs from the start, following its partition as map outputs commit.
    let reduce_opts = StrategyOptions {
        reduces_per_worker: (cfg.partitions as usize).div_ceil(workers.max(1)),
        ..opts
    };
    // `auto` calibrates when its cluster starts, not inside the timed shuffle.
    let calibration = if cfg.strategy == flightshuffle::strategy::Strategy::Auto {
        let c = driver.calibration().await?;
        Some(flightshuffle::calibration_json(&c))
    } else {
        None
    };
    let start = Instant::now();
    let map_side = async {
        let m = strategy::map_side(&driver, &spec, futures::stream::iter(inputs), opts).await?;
        Ok::<_, Error>((m, start.elapsed().as_secs_f64()))
    };
    let reduce_side = async {
        let r = pull::reduce_on_workers(&driver, &spec, "checksum", reduce_opts).await?;
        Ok::<_, Error>((r, start.elapsed().as_secs_f64()))
    };
    let ((mapped, map_seconds), (reduced, seconds)) = if sequential {
        let m = map_side.await?;
        (m, reduce_side.await?)
    } else {
        futures::future::try_join(map_side, reduce_side).await?
    };
    let reduce_times: Vec<f64> = reduced.iter().map(|r| r.seconds).collect();
    let mut output = Checksum::default();
    for r in &reduced {
        output.add(Checksum {
            rows: r.input_rows,
            sum: r.input_checksum,
        });
    }
    let stats = driver.stats().await?;
    let choice = driver.choice(spec.id);
    let parity_bytes = driver.parity_bytes(spec.id);
    let blocks = driver.live_blocks(spec.id);
    driver.drop_shuffle(spec.id).await?;
    if let Some(l) = local.as_mut() {
        l.stop();
    }
    drop(hosted);
    if output != mapped.input || output.rows != cfg.rows {
        return Err(Error::Cluster(format!(
            "shuffle output differs from its input: {} rows / checksum {:#x} in, {} rows / {:#x} out",
            mapped.input.rows, mapped.input.sum, output.rows, output.sum
        )));
    }
    let bytes = mapped.input_bytes;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let sample_rows = ceiling["rows"].as_f64().unwrap_or(1.0).max(1.0);
    let step = |k: &str| ceiling["one_thread_seconds"][k].as_f64().unwrap_or(0.0);
    let one_thread = step("generate")
        + 2.0 * step("checksum")
        + step("hash_partition")
        + step("ipc_encode_decode");
    let bound = one_thread * cfg.rows as f64 / sample_rows / cores;
    let gbps = bytes as f64 / seconds / 1e9;
    let map_blocks: usize = mapped.maps.iter().map(|m| m.blocks.len()).sum();
    Ok(json!({
        "rows": cfg.rows,
        "bytes": bytes,
        "workers": workers,
        "partitions": cfg.partitions,
        "strategy": cfg.strategy.to_string(),
        "strategy_choice": choice,
        "parity": cfg.parity,
        "parity_bytes": parity_bytes,
        "calibration": calibration,
        "reducers_start": if sequential { "after the map side is sealed" } else { "with the maps" },
        "maps": maps,
        "blocks": blocks,
        "map_blocks": map_blocks,
        "merges": mapped.merges.len(),
        "memory_budget_per_worker": cfg.cluster.memory_budget,
        "seconds": seconds,
        "map_seconds": map_seconds,
        "reduce_tail_seconds": seconds - map_seconds,
        "reduce_task_seconds_max": reduce_times.iter().cloned().fold(0.0, f64::max),
        "same_pipeline_bound_seconds": bound,
        "ratio_to_same_pipeline_bound": seconds / bound,
        "throughput_gb_s": gbps,
        "rows_per_s": cfg.rows as f64 / seconds,
        "checked": {"rows": output.rows, "checksum": format!("{:#018x}", output.sum), "equal": true},
        "spilled_bytes": stats.iter().map(|s| s.spilled_bytes).sum::<u64>(),
        "spill_files": stats.iter().map(|s| s.spill_files).sum::<u64>(),
        "restored_bytes": stats.iter().map(|s| s.restored_bytes).sum::<u64>(),
        "peak_rss_bytes_per_worker": stats.iter().map(|s| s.peak_rss_bytes).collect::<Vec<_>>(),
        "idle_rss_bytes_per_worker": idle,
        "peak_rss_above_idle_bytes_per_worker": stats
            .iter()
            .zip(&idle)
            .map(|(s, i)| s.peak_rss_bytes.saturating_sub(*i))
            .collect::<Vec<_>>(),
        "ipc_ceiling": ceiling,
        "ratio_to_ipc_ceiling": gbps / ceiling["throughput_gb_s"].as_f64().unwrap_or(f64::NAN),
    }))
}

/// One thread doing, on the same kind of data, each step a shuffle's rows go through: the
/// IPC encode+decode ceiling, and for reference generation, checksum and partitioning.
fn ipc_ceiling(rows: u64, batch_rows: usize, seed: u64) -> Result<serde_json::Value> {
    let slice = LineitemSlice {
        first_attempt_delay_ms: 0,
        first: 0,
        rows,
        seed,
        batch_rows,
    };
    let t = Instant::now();
    let batches = slice.batches().collect::<Result<Vec<_>>>()?;
    let generate = t.elapsed().as_secs_f64();
    let bytes: usize = batches.iter().map(|b| b.get_array_memory_size()).sum();
    let schema = lineitem_schema();
    let t = Instant::now();
    let mut decoded_rows = 0;
    for b in &batches {
        let block = encode_block(&schema, std::slice::from_ref(b), Compression::None)?;
        let (_, out) = decode_block(&block)?;
        decoded_rows += out.iter().map(|b| b.num_rows()).sum::<usize>();
    }
    let seconds = t.elapsed().as_secs_f64();
    // Decoding alone, with arrow's validation (blocks from the network) and without it (blocks
    // this process encoded, read from its own store after their CRC32C check).
    let blocks = batches
        .iter()
        .map(|b| encode_block(&schema, std::slice::from_ref(b), Compression::None))
        .collect::<Result<Vec<_>>>()?;
    let t = Instant::now();
    for b in &blocks {
        decode_block(b)?;
    }
    let decode_validated = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for b in &blocks {
        decode_unvalidated_here(b)?;
    }
    let decode_unvalidated = t.elapsed().as_secs_f64();
    drop(blocks);
    let t = Instant::now();
    for b in &batches {
        Checksum::of_batch(b)?;
    }
    let checksum = t.elapsed().as_secs_f64();
    let mut part =
        partitioner::Partitioner::from_proto(&partitioner::hash(&["l_orderkey"]), &schema, 16, 0)?;
    let t = Instant::now();
    for b in &batches {
        part.split(b)?;
    }
    let partition = t.elapsed().as_secs_f64();
    let gbps = |s: f64| bytes as f64 / s / 1e9;
    Ok(json!({
        "rows": decoded_rows,
        "bytes": bytes,
        "seconds": seconds,
        "throughput_gb_s": gbps(seconds),
        "one_thread_gb_s": {
            "ipc_encode_decode": gbps(seconds),
            "generate": gbps(generate),
            "checksum": gbps(checksum),
            "hash_partition_16": gbps(partition),
            "ipc_decode_validated": gbps(decode_validated),
            "ipc_decode_unvalidated": gbps(decode_unvalidated),
        },
        "one_thread_seconds": {
            "ipc_encode_decode": seconds,
            "generate": generate,
            "checksum": checksum,
            "hash_partition": partition,
        },
    }))
}

/// Decode a block this process just encoded without arrow's validation of every offset, length
/// and UTF-8 string: what the block store does for blocks it holds as encoded here.
fn decode_unvalidated_here(bytes: &bytes::Bytes) -> Result<Vec<arrow::array::RecordBatch>> {
    let reader =
        arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes.as_ref()), None)?;
    // SAFETY: the bytes are an IPC stream `encode_block` wrote a moment ago in this process from
    // valid record batches, held in memory since.
    let reader = unsafe { reader.with_skip_validation(true) };
    Ok(reader.collect::<std::result::Result<Vec<_>, _>>()?)
}
