//! Calibration of this machine for the `auto` strategy's cost model (Seer's idea): a worker
//! measures, on one core, how fast it partitions, encodes and decodes rows, what one small
//! block costs in the block store (put, commit, read back: the per-block overhead that makes
//! many small blocks slow), and how fast its spill directory writes and reads (as spills do:
//! unsynced, so mostly through the page cache). Rates are per in-memory Arrow byte, without
//! compression (what a local cluster uses). The driver adds
//! what only a call can show: the latency of one request and the bytes per second of the
//! transport ([`crate::driver::Driver::calibration`]). Takes a few hundred milliseconds.

use crate::block::{decode_block, BlockId, EncodedBlock, ShuffleId};
use crate::error::{Error, Result};
use crate::gen::{lineitem_batch, lineitem_schema};
use crate::proto;
use crate::store::{BlockStore, ShuffleInfo, StoreConfig};
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// Each rate is measured in this many windows of [`WINDOW`]; the fastest window counts (on a
/// shared machine the slow ones measure the neighbours, not this code).
const WINDOWS: u32 = 3;
const WINDOW: Duration = Duration::from_millis(30);
/// Small blocks put and read back to find the per-block cost.
const SMALL_BLOCKS: u32 = 400;

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

/// Measure this worker's rates; `disk_bytes` are written to and read from `spill_dir`.
pub fn measure(spill_dir: &Path, disk_bytes: u64) -> Result<proto::Calibration> {
    let schema = lineitem_schema();
    let batch = lineitem_batch(0, 65_536, 7)?;
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
    })?;
    let schema = lineitem_schema();
    let shuffle = ShuffleId::random();
    store.create_shuffle(ShuffleInfo {
        id: shuffle,
        schema: schema.clone(),
        partitions: SMALL_BLOCKS,
        partitioner: crate::partitioner::round_robin(),
    })?;
    let small = lineitem_batch(0, 16, 7)?;
    let start = Instant::now();
    for p in 0..SMALL_BLOCKS {
        let data = EncodedBlock::encode(&schema, std::slice::from_ref(&small), Default::default())?;
        let id = BlockId {
            shuffle,
            map: 0,
            partition: p,
            attempt: 0,
            seq: 0,
        };
        store.put(id, 16, data.into_bytes())?;
    }
    store.commit(shuffle, 0, 0, None)?;
    for p in 0..SMALL_BLOCKS {
        let id = BlockId {
            shuffle,
            map: 0,
            partition: p,
            attempt: 0,
            seq: 0,
        };
        store.read_batches(&id)?;
    }
    let secs = start.elapsed().as_secs_f64() / SMALL_BLOCKS as f64;
    store.drop_shuffle(shuffle)?;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(secs)
}

/// Seconds to write `bytes` to a file in `dir` and to read them back, as spills do.
fn disk(dir: &Path, bytes: u64) -> Result<(f64, f64)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let path = dir.join(format!("calibrate-{}.tmp", ShuffleId::random()));
    let chunk = vec![0x5au8; 1 << 20];
    let result = (|| {
        let start = Instant::now();
        let mut f = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
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
