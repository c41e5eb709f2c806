//! The packed block format: the rows of many reduce partitions in one block, sorted by
//! partition, with the end row of every partition in the block's schema metadata (so the
//! boundaries travel with the bytes, under their CRC32C). Written by packing map tasks
//! ([`crate::packed`]), cut by merges and by the store when a reader asks for one partition.

use super::EncodedBlock;
use crate::error::{Error, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use std::sync::Arc;

pub use crate::ids::PACKED;

/// The schema metadata key of a packed block's partition ends.
const ENDS_KEY: &str = "flightshuffle.packed_ends";

/// Where each partition's rows are in a packed block: partition p is rows
/// `ends[p - 1]..ends[p]` (from 0 for p = 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ends(Arc<[u32]>);

impl Ends {
    /// Ends from a list, checked: one per partition, never decreasing, the last one `rows`.
    pub fn new(ends: Vec<u32>, partitions: u32, rows: u64) -> Result<Ends> {
        if ends.len() != partitions as usize
            || ends.windows(2).any(|w| w[0] > w[1])
            || ends.last().map_or(0, |&e| e as u64) != rows
        {
            return Err(Error::invalid(format!(
                "packed block: {} partition ends for {partitions} partitions and {rows} rows are \
                 not a valid layout",
                ends.len()
            )));
        }
        Ok(Ends(ends.into()))
    }

    /// The rows of partition `p`.
    pub fn range(&self, p: u32) -> std::ops::Range<usize> {
        let p = p as usize;
        let end = self.0.get(p).copied().unwrap_or(0) as usize;
        let start = match p {
            0 => 0,
            _ => self.0.get(p - 1).copied().unwrap_or(0) as usize,
        };
        start..end.max(start)
    }

    /// The partitions that have rows here, in order.
    pub fn non_empty(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.0.len() as u32).filter(|&p| !self.range(p).is_empty())
    }

    /// The ends of a packed block's schema (from its metadata), checked against the shuffle.
    pub fn of_schema(schema: &Schema, partitions: u32, rows: u64) -> Result<Ends> {
        let text = schema
            .metadata()
            .get(ENDS_KEY)
            .ok_or_else(|| Error::invalid("packed block without partition ends"))?;
        let ends = text
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<u32>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::invalid(format!("packed block: bad partition ends: {e}")))?;
        Ends::new(ends, partitions, rows)
    }

    /// The ends of the packed block `bytes` (reads its schema message only).
    pub fn of_block(bytes: &[u8], partitions: u32, rows: u64) -> Result<Ends> {
        Ends::of_schema(super::decode_schema(bytes)?.as_ref(), partitions, rows)
    }
}

/// Encode `batch` (rows sorted by partition) as a packed block with `ends`.
pub fn encode(
    schema: &SchemaRef,
    batch: &RecordBatch,
    ends: &Ends,
    c: crate::Compression,
) -> Result<EncodedBlock> {
    let mut metadata = schema.metadata().clone();
    let text: Vec<String> = ends.0.iter().map(|e| e.to_string()).collect();
    metadata.insert(ENDS_KEY.to_string(), text.join(","));
    let schema = Arc::new(Schema::new_with_metadata(schema.fields().clone(), metadata));
    let batch = super::batch_with(schema.clone(), batch.columns().to_vec(), batch.num_rows())?;
    EncodedBlock::encode(&schema, &[batch], c)
}

/// The rows of partition `p` in a packed block decoded as `schema` and `batches` (`rows` rows,
/// as its commit recorded), with the block's partition ends dropped from their schema: how a
/// reader that fetched the whole block from a map object takes its partition.
pub fn partition_of(
    schema: &Schema,
    batches: &[RecordBatch],
    p: u32,
    rows: u64,
) -> Result<Vec<RecordBatch>> {
    let count = schema
        .metadata()
        .get(ENDS_KEY)
        .map_or(0, |t| t.split(',').filter(|s| !s.is_empty()).count());
    let ends = Ends::of_schema(schema, count as u32, rows)?;
    let mut metadata = schema.metadata().clone();
    metadata.remove(ENDS_KEY);
    let plain = Arc::new(Schema::new_with_metadata(schema.fields().clone(), metadata));
    slice_partition(batches, &ends, p)
        .into_iter()
        .map(|b| {
            Ok(super::batch_with(
                plain.clone(),
                b.columns().to_vec(),
                b.num_rows(),
            )?)
        })
        .collect()
}

/// The rows of partition `p` in the batches of a packed block, as slices (no copy).
pub fn slice_partition(batches: &[RecordBatch], ends: &Ends, p: u32) -> Vec<RecordBatch> {
    let want = ends.range(p);
    let mut out = Vec::new();
    let mut at = 0usize;
    for b in batches {
        let (lo, hi) = (want.start.max(at), want.end.min(at + b.num_rows()));
        if lo < hi {
            out.push(b.slice(lo - at, hi - lo));
        }
        at += b.num_rows();
    }
    out
}
