//! Partitioners: assign each row of a batch to one of R reduce partitions.
//!
//! * hash: key columns hashed natively, column by column ([`hashing`]); key types without a
//!   native path use `arrow-row` normalized key bytes hashed with xxh3. Both are deterministic
//!   across processes (the choice depends only on the schema, so every map task agrees);
//! * range: binary search of the normalized key among R-1 sampled, sorted boundaries;
//! * round-robin: rows dealt in turn, starting at an offset chosen per map task.

use crate::block::{decode_block, encode_block, Compression};
use crate::error::{Error, Result};
use crate::proto;
use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::compute::SortOptions;
use arrow::compute::{concat_batches, take_record_batch};
use arrow::datatypes::{Schema, SchemaRef};
use arrow::row::{OwnedRow, RowConverter, SortField};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

pub mod hashing;

/// A partitioner bound to a schema and a partition count.
pub struct Partitioner {
    kind: Kind,
    partitions: u32,
}

enum Kind {
    Hash {
        keys: Vec<usize>,
        converter: RowConverter,
        /// Every key type has a native hashing path.
        native: bool,
    },
    Range {
        keys: Vec<usize>,
        converter: RowConverter,
        boundaries: Vec<OwnedRow>,
    },
    RoundRobin {
        next: u64,
    },
}

fn key_indices(schema: &Schema, keys: &[String]) -> Result<Vec<usize>> {
    if keys.is_empty() {
        return Err(Error::invalid(
            "a hash or range partitioner needs at least one key column",
        ));
    }
    keys.iter()
        .map(|k| {
            schema.index_of(k).map_err(|_| {
                Error::invalid(format!(
                    "key column {k:?} is not in the schema {}",
                    crate::block::schema_summary(schema)
                ))
            })
        })
        .collect()
}

fn sort_fields(schema: &Schema, keys: &[usize], descending: &[bool]) -> Vec<SortField> {
    keys.iter()
        .enumerate()
        .map(|(i, &k)| {
            let opts = SortOptions {
                descending: descending.get(i).copied().unwrap_or(false),
                nulls_first: true,
            };
            SortField::new_with_options(schema.field(k).data_type().clone(), opts)
        })
        .collect()
}

/// The most reduce partitions a shuffle may have: every map task and every worker keeps
/// state per partition, so the count is checked before anything is allocated for it.
pub const MAX_PARTITIONS: u32 = 1 << 16;

impl Partitioner {
    /// Build from the protocol message. `seed` varies round-robin start offsets between maps.
    pub fn from_proto(
        spec: &proto::Partitioner,
        schema: &Schema,
        partitions: u32,
        seed: u64,
    ) -> Result<Self> {
        if partitions == 0 {
            return Err(Error::invalid("a shuffle needs at least one partition"));
        }
        if partitions > MAX_PARTITIONS {
            return Err(Error::invalid(format!(
                "{partitions} partitions asked for; a shuffle has at most {MAX_PARTITIONS} \
                 (every map task and worker keeps state per partition)"
            )));
        }
        let kind = match &spec.kind {
            Some(proto::partitioner::Kind::Hash(h)) => {
                let keys = key_indices(schema, &h.keys)?;
                let converter = RowConverter::new(sort_fields(schema, &keys, &[]))?;
                let native = keys
                    .iter()
                    .all(|&k| hashing::supported(schema.field(k).data_type()));
                Kind::Hash {
                    keys,
                    converter,
                    native,
                }
            }
            Some(proto::partitioner::Kind::Range(r)) => {
                let keys = key_indices(schema, &r.keys)?;
                let converter = RowConverter::new(sort_fields(schema, &keys, &r.descending))?;
                let (_, batches) = decode_block(&bytes::Bytes::copy_from_slice(&r.boundaries_ipc))
                    .map_err(|e| Error::invalid(format!("bad range boundaries: {e}")))?;
                let mut boundaries = Vec::new();
                for b in &batches {
                    if b.num_columns() != keys.len() {
                        return Err(Error::invalid(
                            "range boundaries must hold the key columns only",
                        ));
                    }
                    let rows = converter.convert_columns(b.columns())?;
                    boundaries.extend(rows.iter().map(|r| r.owned()));
                }
                if boundaries.len() + 1 != partitions as usize {
                    return Err(Error::invalid(format!(
                        "range partitioner has {} boundaries for {partitions} partitions (expected {})",
                        boundaries.len(),
                        partitions - 1
                    )));
                }
                if boundaries.windows(2).any(|w| w[0] > w[1]) {
                    return Err(Error::invalid("range boundaries are not sorted"));
                }
                Kind::Range {
                    keys,
                    converter,
                    boundaries,
                }
            }
            Some(proto::partitioner::Kind::RoundRobin(_)) => Kind::RoundRobin {
                next: seed % partitions as u64,
            },
            None => return Err(Error::invalid("partitioner has no kind")),
        };
        Ok(Partitioner { kind, partitions })
    }

    /// Reduce partitions it assigns rows to.
    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// The partition of every row.
    pub fn assign(&mut self, batch: &RecordBatch) -> Result<Vec<u32>> {
        let n = batch.num_rows();
        let r = self.partitions as u64;
        Ok(match &mut self.kind {
            Kind::Hash {
                keys,
                converter,
                native,
            } => {
                let cols: Vec<ArrayRef> = keys.iter().map(|&k| batch.column(k).clone()).collect();
                if *native {
                    if let Some(h) = hashing::hash_rows(&cols, n) {
                        return Ok(h.into_iter().map(|x| (x % r) as u32).collect());
                    }
                }
                let rows = converter.convert_columns(&cols)?;
                rows.iter()
                    .map(|row| (xxh3_64(row.as_ref()) % r) as u32)
                    .collect()
            }
            Kind::Range {
                keys,
                converter,
                boundaries,
            } => {
                let cols: Vec<ArrayRef> = keys.iter().map(|&k| batch.column(k).clone()).collect();
                let rows = converter.convert_columns(&cols)?;
                rows.iter()
                    .map(|row| boundaries.partition_point(|b| b.row() <= row) as u32)
                    .collect()
            }
            Kind::RoundRobin { next } => {
                let start = *next;
                *next = (start + n as u64) % r;
                (0..n as u64).map(|i| ((start + i) % r) as u32).collect()
            }
        })
    }

    /// Split a batch into (partition, rows of that partition) pieces, in partition order.
    pub fn split(&mut self, batch: &RecordBatch) -> Result<Vec<(u32, RecordBatch)>> {
        let assignment = self.assign(batch)?;
        split_by_assignment(batch, &assignment, self.partitions)
    }
}

/// Gather the rows of each partition with one `take` per non-empty partition.
pub fn split_by_assignment(
    batch: &RecordBatch,
    assignment: &[u32],
    partitions: u32,
) -> Result<Vec<(u32, RecordBatch)>> {
    let mut counts = vec![0u32; partitions as usize + 1];
    for &p in assignment {
        counts[p as usize + 1] += 1;
    }
    for i in 1..counts.len() {
        counts[i] += counts[i - 1];
    }
    let offsets = counts.clone();
    let mut indices = vec![0u32; assignment.len()];
    let mut cursor = counts;
    for (row, &p) in assignment.iter().enumerate() {
        indices[cursor[p as usize] as usize] = row as u32;
        cursor[p as usize] += 1;
    }
    let indices = UInt32Array::from(indices);
    let mut out = Vec::new();
    for p in 0..partitions as usize {
        let (lo, hi) = (offsets[p] as usize, offsets[p + 1] as usize);
        if hi == lo {
            continue;
        }
        let piece = if hi - lo == batch.num_rows() {
            batch.clone()
        } else {
            take_record_batch(batch, &indices.slice(lo, hi - lo))?
        };
        out.push((p as u32, piece));
    }
    Ok(out)
}

/// Range boundaries from a sample: the R-1 quantiles of the sampled keys, IPC-encoded.
pub fn range_boundaries(
    sample: &[RecordBatch],
    schema: &SchemaRef,
    keys: &[String],
    descending: &[bool],
    partitions: u32,
) -> Result<proto::RangePartitioner> {
    let idx = key_indices(schema, keys)?;
    let key_schema = Arc::new(schema.project(&idx)?);
    let projected: Vec<RecordBatch> = sample
        .iter()
        .map(|b| b.project(&idx))
        .collect::<std::result::Result<_, _>>()?;
    let all = concat_batches(&key_schema, &projected)?;
    let converter = RowConverter::new(sort_fields(
        &key_schema,
        &(0..idx.len()).collect::<Vec<_>>(),
        descending,
    ))?;
    let rows = converter.convert_columns(all.columns())?;
    let mut order: Vec<usize> = (0..rows.num_rows()).collect();
    order.sort_by(|&a, &b| rows.row(a).cmp(&rows.row(b)));
    let picks: Vec<u32> = if order.is_empty() {
        Vec::new()
    } else {
        (1..partitions as usize)
            .map(|i| order[(i * order.len() / partitions as usize).min(order.len() - 1)] as u32)
            .collect()
    };
    let boundaries = if picks.len() + 1 == partitions as usize {
        take_record_batch(&all, &UInt32Array::from(picks))?
    } else {
        return Err(Error::invalid(
            "range partitioning needs a non-empty sample",
        ));
    };
    Ok(proto::RangePartitioner {
        keys: keys.to_vec(),
        descending: descending.to_vec(),
        boundaries_ipc: encode_block(&key_schema, &[boundaries], Compression::None)?.to_vec(),
    })
}

/// A hash partitioner over the key columns `keys`.
pub fn hash(keys: &[&str]) -> proto::Partitioner {
    proto::Partitioner {
        kind: Some(proto::partitioner::Kind::Hash(proto::HashPartitioner {
            keys: keys.iter().map(|s| s.to_string()).collect(),
        })),
    }
}

/// A round-robin partitioner: rows dealt to the partitions in turn.
pub fn round_robin() -> proto::Partitioner {
    proto::Partitioner {
        kind: Some(proto::partitioner::Kind::RoundRobin(
            proto::RoundRobinPartitioner {},
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field};
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn batch(keys: &[i64], names: &[String]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(keys.to_vec())),
                Arc::new(StringArray::from_iter_values(names)),
            ],
        )
        .unwrap()
    }

    fn check_split(p: &mut Partitioner, b: &RecordBatch, r: u32) -> Vec<(u32, RecordBatch)> {
        let pieces = p.split(b).unwrap();
        let total: usize = pieces.iter().map(|(_, x)| x.num_rows()).sum();
        assert_eq!(
            total,
            b.num_rows(),
            "every row lands in exactly one partition"
        );
        assert!(pieces.iter().all(|(q, _)| *q < r));
        let mut sum = crate::checksum::Checksum::default();
        for (_, piece) in &pieces {
            sum.add(crate::checksum::Checksum::of_batch(piece).unwrap());
        }
        assert_eq!(sum, crate::checksum::Checksum::of_batch(b).unwrap());
        pieces
    }

    proptest! {
        #[test]
        fn hash_keeps_equal_keys_together(keys in prop::collection::vec(0i64..50, 1..300), r in 1u32..20) {
            let names: Vec<String> = keys.iter().map(|k| format!("n{k}")).collect();
            let b = batch(&keys, &names);
            let mut p = Partitioner::from_proto(&hash(&["k", "s"]), &b.schema(), r, 0).unwrap();
            let pieces = check_split(&mut p, &b, r);
            let mut home: HashMap<i64, u32> = HashMap::new();
            for (q, piece) in &pieces {
                let ks = piece.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                for k in ks.values() {
                    prop_assert_eq!(*home.entry(*k).or_insert(*q), *q);
                }
            }
            // Deterministic: a fresh partitioner (as in another process) agrees.
            let mut p2 = Partitioner::from_proto(&hash(&["k", "s"]), &b.schema(), r, 7).unwrap();
            prop_assert_eq!(p.assign(&b).unwrap(), p2.assign(&b).unwrap());
        }

        #[test]
        fn range_is_ordered(keys in prop::collection::vec(-1000i64..1000, 1..300), r in 1u32..10) {
            let names: Vec<String> = keys.iter().map(|_| String::new()).collect();
            let b = batch(&keys, &names);
            let spec = range_boundaries(std::slice::from_ref(&b), &b.schema(), &["k".into()], &[], r).unwrap();
            let spec = proto::Partitioner { kind: Some(proto::partitioner::Kind::Range(spec)) };
            let mut p = Partitioner::from_proto(&spec, &b.schema(), r, 0).unwrap();
            let pieces = check_split(&mut p, &b, r);
            let mut last_max = i64::MIN;
            for (_, piece) in &pieces {
                let ks = piece.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                let min = ks.values().iter().min().copied().unwrap();
                prop_assert!(min >= last_max);
                last_max = ks.values().iter().max().copied().unwrap();
            }
        }

        #[test]
        fn round_robin_balances(n in 1usize..500, r in 1u32..16, seed in 0u64..100) {
            let keys: Vec<i64> = (0..n as i64).collect();
            let names: Vec<String> = keys.iter().map(|_| String::new()).collect();
            let b = batch(&keys, &names);
            let mut p = Partitioner::from_proto(&round_robin(), &b.schema(), r, seed).unwrap();
            let pieces = check_split(&mut p, &b, r);
            let sizes: Vec<usize> = pieces.iter().map(|(_, x)| x.num_rows()).collect();
            prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1 || pieces.len() < r as usize);
        }
    }

    #[test]
    fn nulls_hash_together_and_bad_keys_error() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from(vec![None, Some(1), None]))],
        )
        .unwrap();
        let mut p = Partitioner::from_proto(&hash(&["k"]), &schema, 4, 0).unwrap();
        let a = p.assign(&b).unwrap();
        assert_eq!(a[0], a[2]);
        assert!(b.column(0).is_null(0));
        let err = Partitioner::from_proto(&hash(&["nope"]), &schema, 4, 0)
            .err()
            .unwrap();
        assert!(err.to_string().contains("nope"));
        assert!(Partitioner::from_proto(&hash(&["k"]), &schema, 0, 0).is_err());
    }
}
