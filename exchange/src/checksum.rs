//! Order-independent content checksum of a multiset of rows.
//!
//! Each row is normalized with `arrow-row` (so the value, not the physical layout, is hashed),
//! hashed with xxh3, and the hashes are added modulo 2^64: equal multisets give equal sums
//! whatever the order, batching or partitioning of the rows.

use crate::error::Result;
use arrow::array::RecordBatch;
use arrow::row::{RowConverter, SortField};
use xxhash_rust::xxh3::xxh3_64;

/// Rows and checksum of a multiset; `add` merges two multisets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checksum {
    /// Rows in the multiset.
    pub rows: u64,
    /// Wrapping sum of the rows' xxh3 hashes.
    pub sum: u64,
}

impl Checksum {
    /// The rows and checksum of one batch.
    pub fn of_batch(batch: &RecordBatch) -> Result<Self> {
        if batch.num_columns() == 0 || batch.num_rows() == 0 {
            return Ok(Checksum {
                rows: batch.num_rows() as u64,
                sum: 0,
            });
        }
        let fields = batch
            .schema()
            .fields()
            .iter()
            .map(|f| SortField::new(f.data_type().clone()))
            .collect();
        let rows = RowConverter::new(fields)?.convert_columns(batch.columns())?;
        let sum = rows
            .iter()
            .fold(0u64, |acc, r| acc.wrapping_add(xxh3_64(r.as_ref())));
        Ok(Checksum {
            rows: batch.num_rows() as u64,
            sum,
        })
    }

    /// Add `other`'s rows to this multiset.
    pub fn add(&mut self, other: Checksum) {
        self.rows += other.rows;
        self.sum = self.sum.wrapping_add(other.sum);
    }
}

/// Whether partitions read whole (on the driver, and on workers: stage inputs and folds) are
/// checked against the shuffle's manifest (always, unless
/// `FLIGHTSHUFFLE_VERIFY_READS=off`, which exists to measure what the check costs).
pub fn verify_reads() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FLIGHTSHUFFLE_VERIFY_READS").as_deref() != Ok("off"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int32Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    #[test]
    fn order_independent() {
        let s = Arc::new(Schema::new(vec![Field::new("a", DataType::Int32, false)]));
        let b1 = RecordBatch::try_new(s.clone(), vec![Arc::new(Int32Array::from(vec![1, 2, 3]))])
            .unwrap();
        let b2 = RecordBatch::try_new(s, vec![Arc::new(Int32Array::from(vec![3, 1, 2]))]).unwrap();
        assert_eq!(
            Checksum::of_batch(&b1).unwrap(),
            Checksum::of_batch(&b2).unwrap()
        );
        let mut split = Checksum::of_batch(&b1.slice(0, 1)).unwrap();
        split.add(Checksum::of_batch(&b1.slice(1, 2)).unwrap());
        assert_eq!(split, Checksum::of_batch(&b1).unwrap());
    }
}
