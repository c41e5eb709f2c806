//! A worker's part of the calibration for the `auto` strategy's cost model (Seer's idea): on
//! one core, how fast it partitions, encodes and decodes rows, what one small block costs in
//! the block store (put, commit, read back: the per-block overhead that makes many small
//! blocks slow), and how fast its spill directory writes and reads (as spills do: unsynced,
//! so mostly through the page cache). Rates are per in-memory Arrow byte, without
//! compression. The driver adds what only calls can show ([`crate::calibrate`]).

use crate::block::{decode_block, BlockId, EncodedBlock, ShuffleId};
use crate::error::{Error, Result};
use crate::proto;
use crate::store::{BlockStore, ShuffleInfo, StoreConfig};
use crate::synthetic::{lineitem_batch, lineitem_schema};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Each rate is measured in this many windows of [`WINDOW`]; the fastest window counts (on a
/// shared machine the slow ones measure the neighbours, not this code).
const WINDOWS: u32 = 5;
const WINDOW: Duration = Duration::from_millis(30);
/// Small blocks put and read back to find the per-block cost.
const SMALL_BLOCKS: u32 = 400;
/// Rows of the lineitem batches the rates are measured on (~3 MB each): large enough that
/// per-call costs vanish, small enough that calibrating stays within a worker's budget.
/// (65,536-row batches made a calibration peak at 276 MB, and glibc kept it resident.)
const ROWS: usize = 16_384;
/// What calibrating holds at its peak, as [`CALIBRATION_GRANT`] asks of the worker's budget:
/// the merge's four packed maps in its scratch store, decoded, and their merged output.
pub const CALIBRATION_GRANT: u64 = 48 << 20;

/// Seconds per call of `f`: the fastest of [`WINDOWS`] windows of at least [`WINDOW`] each.
fn per_call(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..WINDOWS {
        let start = Instant::now();
        let mut n = 0u32;
        while n == 0 || start.elapsed() < WINDOW {
            f()?;
            n += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / n as f64);
    }
    Ok(best)
}

/// Free a 16 MiB buffer, as a worker that has moved blocks has: glibc's malloc then raises
/// its mmap threshold to that size and serves multi-MB buffers from its heap. A fresh worker
/// maps and faults in every one of them instead: encoding 3 MB batches measured 0.8-1.0 GB/s
/// that way, against 12-23 GB/s warm (every earlier calibration was warmed by accident, by
/// the 16 MiB payload the driver then timed the transport with).
fn warm_allocator() {
    drop(std::hint::black_box(vec![1u8; 16 << 20]));
}

/// A worker's side of [`proto::CalibrateTask`]: measure its rates ([`measure`]) within its
/// memory budget like any task (the lowest order: an `auto` exchange waits on it); without
/// `measure`, nothing.
pub async fn on_worker(
    admission: &Arc<crate::admission::Admission>,
    spill_dir: std::path::PathBuf,
    m: proto::CalibrateTask,
) -> Result<proto::Calibration> {
    if !m.measure {
        return Ok(proto::Calibration::default());
    }
    let disk_bytes = m.disk_bytes.min(256 << 20);
    let grant = admission.admit(0, CALIBRATION_GRANT).await;
    tokio::task::spawn_blocking(move || {
        let _grant = grant;
        measure(&spill_dir, disk_bytes)
    })
    .await
    .map_err(|e| Error::Cluster(format!("calibration failed to run: {e}")))?
}

/// Measure this worker's rates; `disk_bytes` are written to and read from `spill_dir`.
pub fn measure(spill_dir: &Path, disk_bytes: u64) -> Result<proto::Calibration> {
    warm_allocator();
    let schema = lineitem_schema();
    let batch = lineitem_batch(0, ROWS, 7)?;
    let bytes = batch.get_array_memory_size() as f64;
    let mut part = crate::partitioner::Partitioner::from_proto(
        &crate::partitioner::hash(&["l_orderkey"]),
        &schema,
        64,
        0,
    )?;
    let partition_s = per_call(|| part.split(&batch).map(drop))?;
    let block = EncodedBlock::encode(&schema, std::slice::from_ref(&batch), Default::default())?;
    let encode_s = per_call(|| {
        EncodedBlock::encode(&schema, std::slice::from_ref(&batch), Default::default()).map(drop)
    })?;
    let encoded = block.into_bytes();
    let decode_s = per_call(|| decode_block(&encoded).map(drop))?;
    let (disk_write_s, disk_read_s) = disk(spill_dir, disk_bytes)?;
    Ok(proto::Calibration {
        partition_bytes_per_s: bytes / partition_s,
        encode_bytes_per_s: bytes / encode_s,
        decode_bytes_per_s: bytes / decode_s,
        block_overhead_s: small_block_cost(spill_dir)?.min(small_block_cost(spill_dir)?),
        merge_bytes_per_s: merge_rate(spill_dir)?,
        disk_write_bytes_per_s: disk_bytes as f64 / disk_write_s,
        disk_read_bytes_per_s: disk_bytes as f64 / disk_read_s,
        ..Default::default()
    })
}

/// Seconds one small block costs: put, commit and read back from a scratch store.
fn small_block_cost(spill_dir: &Path) -> Result<f64> {
    let dir = spill_dir.join(format!("calibrate-{}", ShuffleId::random()));
    let store = BlockStore::new(StoreConfig {
        memory_budget: 64 << 20,
        spill_dir: dir.clone(),
        segment_bytes: crate::store::DEFAULT_SEGMENT_BYTES,
        disk_budget: None,
    })?;
    let schema = lineitem_schema();
    let shuffle = ShuffleId::random();
    store.create_shuffle(ShuffleInfo {
        id: shuffle,
        schema: schema.clone(),
        partitions: SMALL_BLOCKS,
        partitioner: crate::partitioner::round_robin(),
        combiner: None,
        order: 0,
        group: 0,
    })?;
    let small = lineitem_batch(0, 16, 7)?;
    let start = Instant::now();
    let id = |partition| BlockId {
        shuffle,
        map: 0,
        partition,
        attempt: 0,
        seq: 0,
    };
    for p in 0..SMALL_BLOCKS {
        let data = EncodedBlock::encode(&schema, std::slice::from_ref(&small), Default::default())?;
        store.put(id(p), 16, data.into_bytes())?;
    }
    store.commit(shuffle, 0, 0, None)?;
    for p in 0..SMALL_BLOCKS {
        store.read_batches(&id(p))?;
    }
    let secs = start.elapsed().as_secs_f64() / SMALL_BLOCKS as f64;
    store.drop_shuffle(shuffle)?;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(secs)
}

/// Bytes per second of a merge task ([`crate::task::run_merge`]) over packed map blocks
/// ([`crate::packed`]) of lineitem rows cut into 64 partitions: the fastest of a few merges
/// of the same four [`ROWS`]-row blocks, in a scratch store.
fn merge_rate(spill_dir: &Path) -> Result<f64> {
    const MAPS: u32 = 4;
    const PARTITIONS: u32 = 64;
    let dir = spill_dir.join(format!("calibrate-{}", ShuffleId::random()));
    let store = BlockStore::new(StoreConfig {
        memory_budget: 64 << 20,
        spill_dir: dir.clone(),
        segment_bytes: crate::store::DEFAULT_SEGMENT_BYTES,
        disk_budget: None,
    })?;
    let result = (|| {
        let schema = lineitem_schema();
        let info = ShuffleInfo {
            id: ShuffleId::random(),
            schema: schema.clone(),
            partitions: PARTITIONS,
            partitioner: crate::partitioner::hash(&["l_orderkey"]),
            combiner: None,
            order: 0,
            group: 0,
        };
        store.create_shuffle(info.clone())?;
        let mut part =
            crate::partitioner::Partitioner::from_proto(&info.partitioner, &schema, PARTITIONS, 0)?;
        let mut ids = Vec::new();
        let mut bytes = 0u64;
        for map in 0..MAPS {
            let batch = lineitem_batch(map as u64 * ROWS as u64, ROWS, 7)?;
            let assignment = part.assign(&batch)?;
            let holders = vec![0u32; PARTITIONS as usize];
            for (_, rows, ends) in
                crate::packed::sort_by_holder(&batch, &assignment, PARTITIONS, &holders)?
            {
                let n = rows.num_rows() as u64;
                let ends = crate::packed::Ends::new(ends, PARTITIONS, n)?;
                let block = crate::packed::encode(&schema, &rows, &ends, Default::default())?;
                let id = BlockId {
                    shuffle: info.id,
                    map,
                    partition: crate::packed::PACKED,
                    attempt: 0,
                    seq: 0,
                };
                let (meta, _) = store.put_encoded_with(id, n, block, Some(ends))?;
                bytes += meta.bytes;
                ids.push(id);
            }
            store.commit(info.id, map, 0, None)?;
        }
        let mut best = f64::INFINITY;
        for group in 0..WINDOWS {
            let start = Instant::now();
            crate::task::run_merge(
                &store,
                &info,
                ids.clone(),
                MAPS + group,
                0,
                crate::task::MapConfig::default(),
            )?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best.max(1e-9))
    })();
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Seconds to write `bytes` to a file in `dir` and to read them back, as spills do.
fn disk(dir: &Path, bytes: u64) -> Result<(f64, f64)> {
    crate::private::create_dir(dir)?;
    let path = dir.join(format!("calibrate-{}.tmp", ShuffleId::random()));
    let chunk = vec![0x5au8; 1 << 20];
    let result = (|| {
        let start = Instant::now();
        let mut f = crate::private::create_file(&path)?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n]).map_err(|e| Error::io(&path, e))?;
            left -= n as u64;
        }
        // Not synced: spill segments are not either, so this is the rate a spill sees
        // (through the page cache); the read-back likewise mostly comes from the cache.
        f.flush().map_err(|e| Error::io(&path, e))?;
        let write = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let mut f = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
        let mut buf = vec![0u8; 1 << 20];
        while f.read(&mut buf).map_err(|e| Error::io(&path, e))? > 0 {}
        Ok((write, start.elapsed().as_secs_f64()))
    })();
    let _ = std::fs::remove_file(&path);
    result
}
