//! Packed blocks: the rows of many reduce partitions in one block, sorted by partition, with
//! the end row of every partition in the block's schema metadata (so the boundaries travel
//! with the bytes, under their CRC32C, through pushes and spill files).
//!
//! A map task of a strategy that merges before anyone reads (merged, push and two-level
//! shuffles whose readers start after the seal) writes one packed block per holder per flush
//! instead of one block per partition: at M = R = 1000 on 4 workers that is about M x N map
//! blocks instead of M x R, as Exoshuffle's ES-push* writes one block per merger (§3.2.2).
//! Merge tasks cut packed blocks by partition ([`crate::task::run_merge`]); a reader of a
//! partition whose packed blocks were not merged (best-effort merging gave up) gets its rows
//! sliced out by the worker that holds them ([`crate::store::BlockStore::read_part`]).

use crate::block::{BlockId, BlockMeta, EncodedBlock};
use crate::error::{Error, Result};
use crate::map_config::{MapConfig, MapOutput};
use crate::partitioner::Partitioner;
use crate::source::BatchStream;
use crate::store::{BlockStore, ShuffleInfo};
use arrow::array::{RecordBatch, UInt32Array};
use arrow::compute::take_record_batch;
use futures::StreamExt;

pub use crate::block::packed::{encode, Ends, PACKED};

/// A flush is packed only when its non-empty partitions average fewer bytes than this: larger
/// pieces are blocks of their own, which readers read whole and merges would not take anyway.
pub const PACK_BELOW: usize = 1 << 20;

/// Sort the rows of `batch` by holder, then by partition, with one `take`: returns, per holder
/// that gets rows, the holder, its rows (a slice of the sorted batch) and their ends.
pub fn sort_by_holder(
    batch: &RecordBatch,
    assignment: &[u32],
    partitions: u32,
    holder_of: &[u32],
) -> Result<Vec<(u32, RecordBatch, Vec<u32>)>> {
    let r = partitions as usize;
    // Partitions in (holder, partition) order, and the rank of each.
    let mut order: Vec<u32> = (0..partitions).collect();
    order.sort_by_key(|&p| (holder_of[p as usize], p));
    let mut rank = vec![0usize; r];
    for (i, &p) in order.iter().enumerate() {
        rank[p as usize] = i;
    }
    let mut starts = vec![0u32; r + 1];
    for &p in assignment {
        let p = p as usize;
        if p >= r {
            return Err(Error::invalid(format!(
                "row assigned to partition {p} of {r}"
            )));
        }
        starts[rank[p] + 1] += 1;
    }
    for i in 1..starts.len() {
        starts[i] += starts[i - 1];
    }
    let mut cursor = starts.clone();
    let mut indices = vec![0u32; assignment.len()];
    for (row, &p) in assignment.iter().enumerate() {
        let k = rank[p as usize];
        indices[cursor[k] as usize] = row as u32;
        cursor[k] += 1;
    }
    let sorted = take_record_batch(batch, &UInt32Array::from(indices))?;
    let mut out = Vec::new();
    let mut i = 0;
    while i < r {
        let holder = holder_of[order[i] as usize];
        let first = i;
        while i < r && holder_of[order[i] as usize] == holder {
            i += 1;
        }
        let (lo, hi) = (starts[first], starts[i]);
        if lo == hi {
            continue;
        }
        let mut ends = vec![0u32; r];
        let mut last = 0;
        for (p, end) in ends.iter_mut().enumerate() {
            if holder_of[p] == holder {
                last = starts[rank[p] + 1] - lo;
            }
            *end = last;
        }
        out.push((holder, sorted.slice(lo as usize, (hi - lo) as usize), ends));
    }
    Ok(out)
}

/// One map task that packs (see the module doc): input batches are buffered whole (with the
/// partition of each row) up to the task's buffer size; each flush sorts them by holder and
/// partition and writes one packed block per holder, or one block per partition where the
/// pieces are large. Blocks for other workers go through `push`.
pub async fn run_map(
    store: &BlockStore,
    info: &ShuffleInfo,
    map: u32,
    attempt: u32,
    mut input: BatchStream,
    cfg: MapConfig,
    mut push: Option<crate::push::Pusher>,
) -> Result<MapOutput> {
    let start = std::time::Instant::now();
    let mut part =
        Partitioner::from_proto(&info.partitioner, &info.schema, info.partitions, map as u64)?;
    let me = push.as_ref().map_or(0, |p| p.me());
    let holder_of: Vec<u32> = (0..info.partitions)
        .map(|p| push.as_ref().map_or(me, |x| x.holder(p)))
        .collect();
    let mut out = MapOutput::default();
    let mut writer = Writer {
        store,
        info,
        map,
        attempt,
        cfg,
        me,
        seq: 0,
        outgoing: Vec::new(),
    };
    let mut buffered: Vec<RecordBatch> = Vec::new();
    let mut assignment: Vec<u32> = Vec::new();
    let mut bytes = 0usize;
    while let Some(batch) = input.next().await {
        tokio::task::yield_now().await;
        let batch = batch?;
        if batch.num_rows() == 0 {
            continue;
        }
        let batch = info.conform(batch)?;
        let full = tokio::task::block_in_place(|| -> Result<bool> {
            let size = out.count_input(&batch, cfg.checksum)?;
            assignment.extend(part.assign(&batch)?);
            bytes += size;
            buffered.push(batch);
            Ok(bytes >= cfg.buffer_bytes)
        })?;
        if full {
            tokio::task::block_in_place(|| {
                writer.flush(&buffered, &assignment, bytes, &holder_of, &mut out)
            })?;
            (buffered, assignment, bytes) = (Vec::new(), Vec::new(), 0);
            crate::push::Pusher::send_all(&mut push, &mut writer.outgoing).await?;
        }
    }
    tokio::task::block_in_place(|| {
        writer.flush(&buffered, &assignment, bytes, &holder_of, &mut out)
    })?;
    crate::push::Pusher::send_all(&mut push, &mut writer.outgoing).await?;
    if let Some(pusher) = push {
        pusher.finish(store, &mut out).await?;
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

/// Writes the blocks of one packing map task.
struct Writer<'a> {
    store: &'a BlockStore,
    info: &'a ShuffleInfo,
    map: u32,
    attempt: u32,
    cfg: MapConfig,
    /// This worker's index (its blocks stay here).
    me: u32,
    /// The next block's sequence number (unique within the attempt, whatever the partition).
    seq: u32,
    outgoing: Vec<(u32, BlockMeta, bytes::Bytes)>,
}

impl Writer<'_> {
    fn flush(
        &mut self,
        buffered: &[RecordBatch],
        assignment: &[u32],
        bytes: usize,
        holder_of: &[u32],
        out: &mut MapOutput,
    ) -> Result<()> {
        if buffered.is_empty() {
            return Ok(());
        }
        let batch = match buffered {
            [one] => one.clone(),
            many => arrow::compute::concat_batches(&self.info.schema, many)?,
        };
        let r = self.info.partitions;
        for (holder, rows, ends) in sort_by_holder(&batch, assignment, r, holder_of)? {
            let ends = Ends::new(ends, r, rows.num_rows() as u64)?;
            for p in ends.non_empty() {
                out.wrote(p, ends.range(p).len() as u64, r);
            }
            let pieces = ends.non_empty().count();
            let piece_bytes = bytes * rows.num_rows() / batch.num_rows().max(1) / pieces.max(1);
            if pieces > 1 && piece_bytes < PACK_BELOW {
                let block = encode(&self.info.schema, &rows, &ends, self.cfg.compression)?;
                self.write(
                    holder,
                    PACKED,
                    rows.num_rows() as u64,
                    block,
                    Some(ends),
                    out,
                )?;
            } else {
                for p in ends.non_empty().collect::<Vec<_>>() {
                    let range = ends.range(p);
                    let piece = rows.slice(range.start, range.len());
                    let block = EncodedBlock::encode(
                        &self.info.schema,
                        &[crate::block::compact_views(&piece)?],
                        self.cfg.compression,
                    )?;
                    self.write(holder, p, piece.num_rows() as u64, block, None, out)?;
                }
            }
        }
        Ok(())
    }

    fn write(
        &mut self,
        holder: u32,
        partition: u32,
        rows: u64,
        block: EncodedBlock,
        ends: Option<Ends>,
        out: &mut MapOutput,
    ) -> Result<()> {
        let id = BlockId {
            shuffle: self.info.id,
            map: self.map,
            partition,
            attempt: self.attempt,
            seq: self.seq,
        };
        self.seq += 1;
        if holder == self.me {
            let (meta, spilled) = self.store.put_encoded_with(id, rows, block, ends)?;
            if spilled {
                out.spilled_bytes += meta.bytes;
            }
            out.blocks.push(meta);
        } else {
            let data = block.into_bytes();
            let meta = BlockMeta {
                id,
                rows,
                bytes: data.len() as u64,
                crc32c: crc32c::crc32c(&data),
            };
            self.outgoing.push((holder, meta, data));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::packed::slice_partition;
    use crate::checksum::Checksum;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::Schema;
    use arrow::datatypes::{DataType, Field};
    use proptest::prelude::*;
    use std::sync::Arc;

    fn batch(keys: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
        ]));
        let s: StringArray = keys
            .iter()
            .map(|k| (k % 3 != 0).then(|| format!("v{k}")))
            .collect();
        RecordBatch::try_new(
            schema,
            vec![Arc::new(Int64Array::from(keys.to_vec())), Arc::new(s)],
        )
        .unwrap()
    }

    proptest! {
        /// Sorting by holder and packing loses no row and puts every row in its partition and
        /// at its partition's holder; the ends survive the encoding.
        #[test]
        fn packed_blocks_keep_every_row_in_its_partition(
            keys in proptest::collection::vec(-50i64..50, 0..300),
            partitions in 1u32..12,
            workers in 1u32..5,
        ) {
            let b = batch(&keys);
            let assignment: Vec<u32> = keys.iter().map(|k| k.rem_euclid(partitions as i64) as u32).collect();
            let holder_of: Vec<u32> = (0..partitions).map(|p| p % workers).collect();
            let mut seen = Checksum::default();
            for (holder, rows, ends) in sort_by_holder(&b, &assignment, partitions, &holder_of).unwrap() {
                let ends = Ends::new(ends, partitions, rows.num_rows() as u64).unwrap();
                let block = encode(&b.schema(), &rows, &ends, crate::Compression::None).unwrap();
                let (schema, decoded) = crate::block::decode_block(block.bytes()).unwrap();
                let back = Ends::of_schema(&schema, partitions, rows.num_rows() as u64).unwrap();
                prop_assert_eq!(&back, &ends);
                prop_assert_eq!(Ends::of_block(block.bytes(), partitions, rows.num_rows() as u64).unwrap(), ends.clone());
                for p in 0..partitions {
                    for piece in slice_partition(&decoded, &back, p) {
                        prop_assert_eq!(holder_of[p as usize], holder);
                        let k = piece.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                        prop_assert!(k.values().iter().all(|k| k.rem_euclid(partitions as i64) as u32 == p));
                        let piece = RecordBatch::try_new(b.schema(), piece.columns().to_vec()).unwrap();
                        seen.add(Checksum::of_batch(&piece).unwrap());
                    }
                }
            }
            prop_assert_eq!(seen, Checksum::of_batch(&b).unwrap());
        }
    }

    #[test]
    fn bad_ends_are_refused() {
        assert!(Ends::new(vec![1, 0], 2, 0).is_err(), "decreasing");
        assert!(Ends::new(vec![1, 2], 3, 2).is_err(), "too few");
        assert!(Ends::new(vec![1, 2], 2, 3).is_err(), "rows differ");
        let plain = crate::block::encode_schema(&batch(&[1]).schema()).unwrap();
        assert!(Ends::of_block(&plain, 1, 0).is_err(), "no ends");
        let e = Ends::new(vec![0, 2, 2, 5], 4, 5).unwrap();
        assert_eq!(e.non_empty().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!((e.range(0), e.range(1), e.range(3)), (0..0, 0..2, 2..5));
    }
}

/// Map tasks and holders encode slices of sorted batches: the IPC writer must write only the
/// slice's rows, not the buffers it shares with the whole batch.
#[cfg(test)]
mod slice_size {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::Schema;
    use arrow::datatypes::{DataType, Field};
    use std::sync::Arc;

    #[test]
    fn an_encoded_slice_carries_only_its_rows() {
        let n = 100_000;
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let s: StringArray = (0..n).map(|i| Some(format!("value {i}"))).collect();
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from_iter_values(0..n as i64)),
                Arc::new(s),
            ],
        )
        .unwrap();
        let whole =
            crate::block::encode_block(&schema, std::slice::from_ref(&b), crate::Compression::None)
                .unwrap();
        let part =
            crate::block::encode_block(&schema, &[b.slice(n / 2, 10)], crate::Compression::None)
                .unwrap();
        assert!(
            part.len() * 100 < whole.len(),
            "whole {} slice {}",
            whole.len(),
            part.len()
        );
    }
}
