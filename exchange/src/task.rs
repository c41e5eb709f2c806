//! Tasks a worker runs: the map task (partition a [`crate::source::BatchSource`]'s batches
//! into blocks) and the merge task (rewrite committed blocks as few large ones).

use crate::block::{BlockId, BlockMeta, EncodedBlock};
use crate::error::{Error, Result};
pub use crate::map_config::{MapConfig, MapOutput};
use crate::partitioner::Partitioner;
pub use crate::source::BatchStream;
use crate::store::{BlockStore, ShuffleInfo};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use futures::StreamExt;
use std::time::Instant;

struct PartitionBuffer {
    batches: Vec<RecordBatch>,
    bytes: usize,
    rows: u64,
    seq: u32,
}

/// In-exchange combining of one map task's buffers (see [`crate::combine`]).
struct Combining {
    combiner: Option<crate::combine::CombinerRef>,
    /// Combines in a row that removed under a tenth of the rows.
    useless: u32,
}

impl Combining {
    /// Combine `buf` in place. Returns the bytes it freed when the combined rows are at most
    /// [`crate::combine::KEEP_RATIO`] of the rows (they stay buffered, absorbing more);
    /// otherwise the buffer holds the combined rows and `None` says to write them. After
    /// [`crate::combine::GIVE_UP_AFTER`] combines in a row that remove under a tenth of the
    /// rows (keys do not repeat), the task stops combining.
    fn combine(&mut self, buf: &mut PartitionBuffer, info: &ShuffleInfo) -> Result<Option<usize>> {
        let Some(c) = self.combiner.as_ref() else {
            return Ok(None);
        };
        if buf.batches.is_empty() {
            return Ok(None);
        }
        let combined = c.0.combine(&buf.batches)?;
        let combined = combined
            .into_iter()
            .map(|b| {
                crate::block::cast_to(b, &info.schema).and_then(|b| crate::block::compact_views(&b))
            })
            .collect::<Result<Vec<_>>>()?;
        let rows: u64 = combined.iter().map(|b| b.num_rows() as u64).sum();
        let ratio = rows as f64 / buf.rows.max(1) as f64;
        self.useless = if ratio > 0.9 { self.useless + 1 } else { 0 };
        if self.useless >= crate::combine::GIVE_UP_AFTER {
            self.combiner = None;
        }
        let bytes: usize = combined.iter().map(|b| b.get_array_memory_size()).sum();
        buf.rows = rows;
        buf.batches = combined;
        if ratio <= crate::combine::KEEP_RATIO {
            let freed = buf.bytes.saturating_sub(bytes);
            buf.bytes -= freed;
            Ok(Some(freed))
        } else {
            // The caller's count of buffered bytes still holds `buf.bytes` for this buffer,
            // which the flush that follows frees.
            Ok(None)
        }
    }
}

/// Run one map task: read `input`, partition every batch, store the blocks.
pub async fn run_map(
    store: &BlockStore,
    info: &ShuffleInfo,
    map: u32,
    attempt: u32,
    mut input: BatchStream,
    cfg: MapConfig,
    mut push: Option<crate::push::Pusher>,
) -> Result<MapOutput> {
    if cfg.pack && info.combiner.is_none() {
        return crate::packed::run_map(store, info, map, attempt, input, cfg, push).await;
    }
    let start = Instant::now();
    let mut part =
        Partitioner::from_proto(&info.partitioner, &info.schema, info.partitions, map as u64)?;
    let mut bufs: Vec<PartitionBuffer> = (0..info.partitions)
        .map(|_| PartitionBuffer {
            batches: Vec::new(),
            bytes: 0,
            rows: 0,
            seq: 0,
        })
        .collect();
    let mut out = MapOutput::default();
    let mut buffered = 0usize;
    // Blocks encoded for other workers, sent once the CPU-bound section is left.
    let mut outgoing = Vec::new();
    let holders: Vec<Option<u32>> = (0..info.partitions)
        .map(|p| push.as_ref().and_then(|x| x.remote_holder(p)))
        .collect();
    type Outgoing = Vec<(u32, BlockMeta, bytes::Bytes)>;
    let mut combining = Combining {
        combiner: info.combiner.clone(),
        useless: 0,
    };
    let flush = |p: usize,
                 bufs: &mut Vec<PartitionBuffer>,
                 out: &mut MapOutput,
                 outgoing: &mut Outgoing|
     -> Result<usize> {
        let buf = &mut bufs[p];
        if buf.batches.is_empty() {
            return Ok(0);
        }
        out.wrote(p as u32, buf.rows, info.partitions);
        let batches = coalesce(&info.schema, &buf.batches, cfg.batch_rows)?;
        let data = EncodedBlock::encode(&info.schema, &batches, cfg.compression)?;
        let id = BlockId {
            shuffle: info.id,
            map,
            partition: p as u32,
            attempt,
            seq: buf.seq,
        };
        if let Some(holder) = holders[p] {
            let data = data.into_bytes();
            let meta = BlockMeta {
                id,
                rows: buf.rows,
                bytes: data.len() as u64,
                crc32c: crc32c::crc32c(&data),
            };
            outgoing.push((holder, meta, data));
        } else {
            let (meta, spilled) = store.put_encoded(id, buf.rows, data)?;
            if spilled {
                out.spilled_bytes += meta.bytes;
            }
            out.blocks.push(meta);
        }
        let freed = buf.bytes;
        buf.batches.clear();
        buf.bytes = 0;
        buf.rows = 0;
        buf.seq += 1;
        Ok(freed)
    };
    while let Some(batch) = input.next().await {
        // A source that is always ready never yields; yield here so an abort takes effect.
        tokio::task::yield_now().await;
        let batch = batch?;
        if batch.num_rows() == 0 {
            continue;
        }
        let batch = info.conform(batch)?;
        tokio::task::block_in_place(|| -> Result<()> {
            out.count_input(&batch, cfg.checksum)?;
            for (p, piece) in part.split(&batch)? {
                let piece = crate::block::compact_views(&piece)?;
                let size = piece.get_array_memory_size();
                let buf = &mut bufs[p as usize];
                buf.rows += piece.num_rows() as u64;
                buf.bytes += size;
                buf.batches.push(piece);
                buffered += size;
                if bufs[p as usize].bytes >= cfg.block_bytes {
                    if let Some(freed) = combining.combine(&mut bufs[p as usize], info)? {
                        buffered -= freed;
                        continue;
                    }
                    buffered -= flush(p as usize, &mut bufs, &mut out, &mut outgoing)?;
                }
            }
            while buffered > cfg.buffer_bytes {
                let largest = (0..bufs.len()).max_by_key(|&i| bufs[i].bytes).unwrap_or(0);
                if let Some(freed) = combining.combine(&mut bufs[largest], info)? {
                    buffered -= freed;
                    continue;
                }
                buffered -= flush(largest, &mut bufs, &mut out, &mut outgoing)?;
            }
            Ok(())
        })?;
        crate::push::Pusher::send_all(&mut push, &mut outgoing).await?;
    }
    tokio::task::block_in_place(|| -> Result<()> {
        for p in 0..bufs.len() {
            // Whatever is left is combined once more (if combining still pays) and written.
            let _ = combining.combine(&mut bufs[p], info)?;
            flush(p, &mut bufs, &mut out, &mut outgoing)?;
        }
        Ok(())
    })?;
    crate::push::Pusher::send_all(&mut push, &mut outgoing).await?;
    if let Some(pusher) = push {
        pusher.finish(store, &mut out).await?;
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// Concatenate consecutive small batches into batches of at most `target` rows (a batch
/// that is large already is kept as it is, without a copy).
fn coalesce(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    target: usize,
) -> Result<Vec<RecordBatch>> {
    let mut out = Vec::new();
    let mut group: Vec<RecordBatch> = Vec::new();
    let mut rows = 0usize;
    let mut emit = |group: &mut Vec<RecordBatch>| -> Result<()> {
        match group.len() {
            0 => {}
            1 => out.append(group),
            _ => {
                out.push(arrow::compute::concat_batches(schema, group.iter())?);
                group.clear();
            }
        }
        Ok(())
    };
    for b in batches {
        if rows + b.num_rows() > target && !group.is_empty() {
            emit(&mut group)?;
            rows = 0;
        }
        rows += b.num_rows();
        group.push(b.clone());
    }
    emit(&mut group)?;
    Ok(out)
}

/// Merged blocks are cut at this size (Riffle merges map outputs into blocks of a few MiB).
pub const MERGED_BLOCK_BYTES: usize = 8 << 20;

/// Run one merge task (merged strategy): the committed blocks `ids` of a few maps held by
/// `store`, partition by partition, rewritten as few large blocks (each up to
/// [`MERGED_BLOCK_BYTES`] of rows) of map id `group`, attempt `attempt`, pending until the
/// driver commits the group. Rows are not re-partitioned: a block's rows stay in its partition.
/// Packed blocks ([`crate::packed`]) are decoded once and cut by partition (slices, no copy
/// before the merged block is built); blocks of one partition are read partition by partition.
pub fn run_merge(
    store: &BlockStore,
    info: &ShuffleInfo,
    mut ids: Vec<BlockId>,
    group: u32,
    attempt: u32,
    cfg: MapConfig,
) -> Result<MapOutput> {
    let start = std::time::Instant::now();
    ids.sort_by_key(|b| (b.partition, b.map, b.seq));
    let mut out = MapOutput::default();
    let mut seq = 0u32;
    let mut flush =
        |partition: u32, batches: &mut Vec<RecordBatch>, out: &mut MapOutput| -> Result<()> {
            if batches.is_empty() {
                return Ok(());
            }
            // A combined shuffle's merge also combines across the maps it merges.
            if let Some(c) = &info.combiner {
                let combined = c.0.combine(batches)?;
                *batches = combined
                    .into_iter()
                    .map(|b| crate::block::cast_to(b, &info.schema))
                    .collect::<Result<Vec<_>>>()?;
            }
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            let batches_out = coalesce(&info.schema, batches, cfg.batch_rows)?;
            let block = EncodedBlock::encode(&info.schema, &batches_out, cfg.compression)?;
            let id = BlockId {
                shuffle: info.id,
                map: group,
                partition,
                attempt,
                seq,
            };
            seq += 1;
            let (meta, spilled) = store.put_encoded(id, rows as u64, block)?;
            if spilled {
                out.spilled_bytes += meta.bytes;
            }
            out.input.rows += rows as u64;
            out.input_bytes += meta.bytes;
            out.blocks.push(meta);
            batches.clear();
            Ok(())
        };
    // Packed blocks: decoded once, then each partition's rows gathered from all of them by
    // one `interleave` per merged block (not one slice per block and partition).
    let split = ids.partition_point(|id| id.partition != crate::packed::PACKED);
    let packed = Packed::read(store, &ids[split..], info.partitions)?;
    let mut plain = ids[..split].iter().peekable();
    let mut batches = Vec::new();
    for p in 0..info.partitions {
        let mut bytes = 0usize;
        // Blocks of this partition alone (counted by encoded size: decoded arrays share the
        // block's buffer, so their memory sizes would count it once per column).
        while let Some(id) = plain.next_if(|id| id.partition == p) {
            if bytes >= MERGED_BLOCK_BYTES {
                flush(p, &mut batches, &mut out)?;
                bytes = 0;
            }
            bytes += store.meta(id)?.bytes as usize;
            batches.extend(store.read_batches(id)?);
        }
        for chunk in packed.rows_of(p, MERGED_BLOCK_BYTES.saturating_sub(bytes)) {
            if bytes >= MERGED_BLOCK_BYTES {
                flush(p, &mut batches, &mut out)?;
                bytes = 0;
            }
            bytes += chunk.1;
            batches.push(packed.gather(&chunk.0)?);
        }
        flush(p, &mut batches, &mut out)?;
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// The packed blocks of one merge, decoded, with where each partition's rows are.
struct Packed {
    batches: Vec<RecordBatch>,
    /// Per input batch: its partition ends and its estimated encoded bytes per row.
    layout: Vec<(crate::packed::Ends, f64)>,
}

impl Packed {
    fn read(store: &BlockStore, ids: &[BlockId], partitions: u32) -> Result<Packed> {
        let mut out = Packed {
            batches: Vec::new(),
            layout: Vec::new(),
        };
        for id in ids {
            let meta = store.meta(id)?;
            let (batches, ends) = store.read_packed(id)?;
            let batch = match batches.as_slice() {
                [one] => one.clone(),
                many => match many.first() {
                    Some(b) => arrow::compute::concat_batches(&b.schema(), many)?,
                    None => continue,
                },
            };
            if ends.range(partitions.saturating_sub(1)).end != batch.num_rows() {
                return Err(Error::invalid(format!(
                    "block {id}: ends do not match its rows"
                )));
            }
            out.layout
                .push((ends, meta.bytes as f64 / meta.rows.max(1) as f64));
            out.batches.push(batch);
        }
        Ok(out)
    }

    /// The (input, row) pairs of partition `p`, cut into chunks of about
    /// [`MERGED_BLOCK_BYTES`] (the first one `first` bytes), each with its estimated bytes.
    fn rows_of(&self, p: u32, first: usize) -> Vec<(Vec<(usize, usize)>, usize)> {
        let mut chunks = Vec::new();
        let (mut rows, mut bytes, mut limit) = (Vec::new(), 0f64, first.max(1) as f64);
        for (i, (ends, per_row)) in self.layout.iter().enumerate() {
            for r in ends.range(p) {
                if bytes >= limit && !rows.is_empty() {
                    chunks.push((std::mem::take(&mut rows), bytes as usize));
                    (bytes, limit) = (0.0, MERGED_BLOCK_BYTES as f64);
                }
                rows.push((i, r));
                bytes += per_row;
            }
        }
        if !rows.is_empty() {
            chunks.push((rows, bytes as usize));
        }
        chunks
    }

    fn gather(&self, rows: &[(usize, usize)]) -> Result<RecordBatch> {
        let refs: Vec<&RecordBatch> = self.batches.iter().collect();
        Ok(arrow::compute::interleave_record_batch(&refs, rows)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::Checksum;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    #[test]
    fn small_pieces_are_coalesced_and_large_ones_kept() {
        let schema: SchemaRef =
            Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let piece = |n: i64| {
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from_iter_values(0..n))],
            )
            .unwrap()
        };
        let mut input: Vec<RecordBatch> = (0..30).map(|_| piece(100)).collect();
        input.push(piece(10_000));
        input.extend((0..3).map(|_| piece(7)));
        let out = coalesce(&schema, &input, 1000).unwrap();
        let sizes: Vec<usize> = out.iter().map(|b| b.num_rows()).collect();
        assert_eq!(sizes, vec![1000, 1000, 1000, 10_000, 21]);
        let total = |b: &[RecordBatch]| {
            Checksum::of_batch(&arrow::compute::concat_batches(&schema, b).unwrap()).unwrap()
        };
        assert_eq!(total(&out), total(&input));
    }

    #[test]
    fn map_buffers_follow_the_budget() {
        let small = MapConfig::for_budget(89 << 20);
        assert_eq!(small.buffer_bytes, (89 << 20) / 8);
        assert_eq!(small.block_bytes, small.buffer_bytes / 4);
        let tiny = MapConfig::for_budget(1 << 20);
        assert_eq!((tiny.buffer_bytes, tiny.block_bytes), (4 << 20, 1 << 20));
        let large = MapConfig::for_budget(u64::MAX);
        assert_eq!((large.buffer_bytes, large.block_bytes), (32 << 20, 4 << 20));
    }
}
