//! What a map task is tuned with ([`MapConfig`]: block and buffer sizes, compression) and what
//! it reports ([`MapOutput`]: its blocks, input checksum, rows per partition). Shared by the
//! map writers (the per-partition one in [`crate::task`], the packing one in
//! [`crate::packed`]) and the worker that runs them.

use crate::block::{BlockMeta, Compression};
use crate::checksum::Checksum;
use crate::error::Result;
use arrow::array::RecordBatch;

/// Map task tuning. Blocks are flushed per partition at `block_bytes`; the whole task never
/// buffers more than `buffer_bytes` of partitioned rows.
#[derive(Debug, Clone, Copy)]
pub struct MapConfig {
    /// Bytes of partitioned rows at which a partition's buffer is flushed as a block.
    pub block_bytes: usize,
    /// Most bytes of partitioned rows the whole task buffers.
    pub buffer_bytes: usize,
    /// IPC buffer compression of the blocks it writes.
    pub compression: Compression,
    /// Checksum the input rows (order-independent multiset checksum) for verification.
    pub checksum: bool,
    /// Small per-partition pieces are coalesced into batches of up to this many rows before
    /// a block is encoded (fewer IPC messages, full-size batches for the reader).
    pub batch_rows: usize,
    /// Write packed blocks, one per holder per flush ([`crate::packed`]), where the strategy
    /// merges them before anyone reads (not with a combiner).
    pub pack: bool,
}

impl Default for MapConfig {
    fn default() -> Self {
        MapConfig {
            block_bytes: 4 << 20,
            buffer_bytes: 32 << 20,
            compression: Compression::None,
            checksum: true,
            batch_rows: 8192,
            pack: false,
        }
    }
}

impl MapConfig {
    /// The bytes a map or merge task is granted from its worker's budget: its partition
    /// buffers and as much again for the blocks it encodes and the input batches in flight.
    pub fn task_grant(&self) -> u64 {
        2 * self.buffer_bytes as u64
    }

    /// Buffers sized to a worker's budget: a task buffers at most 1/8 of it (4-32 MiB) and
    /// flushes blocks of a quarter of that (1-4 MiB), so the few map tasks a worker runs at
    /// once hold a fraction of the budget beside it, not a fixed 32 MiB each. Shuffle bench,
    /// 4 workers, 89 MiB budget: peak RSS per worker 420-460 MiB with 32 MiB buffers (see
    /// `docs/bench/pipelined-scheduler.md` for the figure with this sizing).
    pub fn for_budget(budget: u64) -> Self {
        let budget = usize::try_from(budget).unwrap_or(usize::MAX);
        let buffer_bytes = (budget / 8).clamp(4 << 20, 32 << 20);
        MapConfig {
            buffer_bytes,
            block_bytes: (buffer_bytes / 4).clamp(1 << 20, 4 << 20),
            ..MapConfig::default()
        }
    }
}

/// What a map task reports: its blocks and a checksum of the rows it read.
#[derive(Debug, Clone, Default)]
pub struct MapOutput {
    /// Blocks stored here.
    pub blocks: Vec<BlockMeta>,
    /// Blocks pushed to other workers, per worker.
    pub pushed: Vec<crate::proto::PushedBlocks>,
    pub input: Checksum,
    pub input_bytes: u64,
    pub spilled_bytes: u64,
    pub seconds: f64,
    /// Rows written per reduce partition (map tasks), wherever the blocks went.
    pub partition_rows: Vec<u64>,
    /// A durable shuffle's pushed blocks, kept until the map's object is written: (holder,
    /// block, bytes).
    pub sent: Vec<(u32, BlockMeta, bytes::Bytes)>,
}

impl MapOutput {
    /// Count `rows` written to `partition` of a shuffle of `partitions`.
    pub(crate) fn wrote(&mut self, partition: u32, rows: u64, partitions: u32) {
        if self.partition_rows.len() < partitions as usize {
            self.partition_rows.resize(partitions as usize, 0);
        }
        if let Some(r) = self.partition_rows.get_mut(partition as usize) {
            *r += rows;
        }
    }

    /// Count one input batch: its rows (with their multiset checksum when `checksum`) and its
    /// in-memory bytes, which it returns.
    pub(crate) fn count_input(&mut self, batch: &RecordBatch, checksum: bool) -> Result<usize> {
        if checksum {
            self.input.add(Checksum::of_batch(batch)?);
        } else {
            self.input.rows += batch.num_rows() as u64;
        }
        let size = batch.get_array_memory_size();
        self.input_bytes += size as u64;
        Ok(size)
    }
}
