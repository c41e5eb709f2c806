//! Block metadata, and the Arrow IPC codec blocks are stored in (block identity is in
//! [`crate::ids`], re-exported here).
//!
//! A block is one Arrow IPC stream (schema message, batch messages, end marker), optionally with
//! LZ4-frame or ZSTD buffer compression, plus its row count, byte size and CRC32C.

pub mod packed;

use crate::error::{Error, Result};
use crate::proto;
use arrow::array::{Array, ArrayRef, BinaryViewArray, RecordBatch, StringViewArray};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};
use arrow::ipc::CompressionType;
use bytes::Bytes;
use std::fmt;
use std::sync::Arc;

pub use crate::ids::{BlockId, ShuffleId};

/// A part of one reduce partition for a skew split: the reader of slice `index` of `count`
/// reads only the blocks [`Slice::contains`] assigns to it, so `count` readers of the same
/// partition together read each of its blocks exactly once. Blocks are dealt round-robin by
/// (map + sequence), which spreads every map's blocks evenly over the slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slice {
    /// This slice's index, below `count`.
    pub index: u32,
    /// Slices the partition is cut into (1: the whole partition).
    pub count: u32,
}

impl Slice {
    /// The whole partition.
    pub const WHOLE: Slice = Slice { index: 0, count: 1 };

    /// Slice `index` of `count`; an index outside `0..count` is an error.
    pub fn new(index: u32, count: u32) -> Result<Slice> {
        let count = count.max(1);
        if index >= count {
            return Err(Error::invalid(format!(
                "slice {index} of {count}: the index must be below the count"
            )));
        }
        Ok(Slice { index, count })
    }

    /// Whether this is the whole partition (a count of 1).
    pub fn is_whole(&self) -> bool {
        self.count <= 1
    }

    /// Whether block `id` belongs to this slice.
    pub fn contains(&self, id: &BlockId) -> bool {
        self.is_whole() || id.map.wrapping_add(id.seq) % self.count == self.index
    }
}

/// Rows, encoded bytes and CRC32C of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMeta {
    /// The block's identity.
    pub id: BlockId,
    /// Rows in the block.
    pub rows: u64,
    /// The block's encoded size, in bytes.
    pub bytes: u64,
    /// CRC32C of the block's encoded bytes.
    pub crc32c: u32,
}

impl From<&BlockMeta> for proto::BlockMeta {
    fn from(m: &BlockMeta) -> Self {
        proto::BlockMeta {
            key: Some(m.id.into()),
            rows: m.rows,
            bytes: m.bytes,
            crc32c: m.crc32c,
        }
    }
}

impl TryFrom<&proto::BlockMeta> for BlockMeta {
    type Error = Error;
    fn try_from(m: &proto::BlockMeta) -> Result<Self> {
        let key = m
            .key
            .as_ref()
            .ok_or_else(|| Error::invalid("block metadata without a key"))?;
        Ok(BlockMeta {
            id: key.into(),
            rows: m.rows,
            bytes: m.bytes,
            crc32c: m.crc32c,
        })
    }
}

/// IPC buffer compression of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// No compression.
    #[default]
    None,
    /// LZ4-frame buffer compression.
    Lz4,
    /// ZSTD buffer compression.
    Zstd,
}

impl std::str::FromStr for Compression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "" => Ok(Compression::None),
            "lz4" | "lz4_frame" => Ok(Compression::Lz4),
            "zstd" => Ok(Compression::Zstd),
            other => Err(Error::invalid(format!(
                "unknown compression {other:?}: expected none, lz4, zstd (or auto on a cluster)"
            ))),
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        })
    }
}

fn write_options(c: Compression) -> Result<IpcWriteOptions> {
    let ct = match c {
        Compression::None => None,
        Compression::Lz4 => Some(CompressionType::LZ4_FRAME),
        Compression::Zstd => Some(CompressionType::ZSTD),
    };
    Ok(IpcWriteOptions::default().try_with_compression(ct)?)
}

/// Encode batches as one IPC stream. View arrays are compacted first so a block never carries
/// the unused parts of buffers shared with other slices.
pub fn encode_block(schema: &SchemaRef, batches: &[RecordBatch], c: Compression) -> Result<Bytes> {
    let mut buf = Vec::with_capacity(batches.iter().map(|b| b.get_array_memory_size()).sum());
    {
        let mut w = StreamWriter::try_new_with_options(&mut buf, schema, write_options(c)?)?;
        for b in batches.iter().flat_map(cut_batch) {
            w.write(&compact_views(&b)?)?;
        }
        w.finish()?;
    }
    // The reservation is the batches' in-memory size; compressed or compacted blocks are
    // smaller, and `Bytes` would keep the whole allocation alive while the store counts only
    // the length. Give the rest back (a realloc that shrinks in place or remaps, no copy).
    if buf.capacity() - buf.len() > buf.len() / 16 {
        buf.shrink_to_fit();
    }
    Ok(Bytes::from(buf))
}

/// Largest record batch written into a block, in memory bytes: a bigger one is cut into row
/// slices, so each IPC message (one batch) stays well under the transport's message cap
/// ([`crate::transport::MAX_MESSAGE_BYTES`]). Only a single row larger than the cap cannot be
/// cut: sending it fails with a status naming the limit.
pub const MAX_BATCH_BYTES: usize = 16 << 20;

/// `b` cut into row slices of at most about [`MAX_BATCH_BYTES`] each.
fn cut_batch(b: &RecordBatch) -> Vec<RecordBatch> {
    let (bytes, rows) = (b.get_array_memory_size(), b.num_rows());
    if bytes <= MAX_BATCH_BYTES || rows <= 1 {
        return vec![b.clone()];
    }
    let per = (rows as u128 * MAX_BATCH_BYTES as u128 / bytes as u128).max(1) as usize;
    (0..rows)
        .step_by(per)
        .map(|o| b.slice(o, per.min(rows - o)))
        .collect()
}

/// A block encoded in this process from record batches (which arrow validated when they were
/// built), so its bytes are a well-formed IPC stream. Only [`EncodedBlock::encode`] makes one.
/// The block store remembers which blocks came this way; reading one back from memory whose
/// CRC32C still matches, it decodes without validating every buffer again
/// ([`BlockStore::read_batches`]). Bytes from anywhere else (the network, a test, a spill file
/// read back from disk) are validated. Batches a source imported through the C data interface
/// (Python tasks) are validated where they are imported, since arrow does not check them.
///
/// [`BlockStore::read_batches`]: crate::store::BlockStore::read_batches
#[derive(Debug, Clone)]
pub struct EncodedBlock(Bytes);

impl EncodedBlock {
    /// Encode batches as one IPC stream (see [`encode_block`]).
    pub fn encode(schema: &SchemaRef, batches: &[RecordBatch], c: Compression) -> Result<Self> {
        encode_block(schema, batches, c).map(EncodedBlock)
    }

    /// The encoded IPC stream.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// The encoded IPC stream, taking it out of the block.
    pub fn into_bytes(self) -> Bytes {
        self.0
    }
}

/// Decode bytes that an [`EncodedBlock`] held and that passed their CRC32C check since, without
/// arrow's validation of every offset, length and UTF-8 string (the encoder's input was valid).
/// Only the block store calls this, for blocks it holds as encoded here.
pub(crate) fn decode_encoded_here(bytes: &Bytes) -> Result<Vec<RecordBatch>> {
    let reader = StreamReader::try_new(std::io::Cursor::new(bytes.as_ref()), None)?;
    // SAFETY: the bytes are an IPC stream `encode_block` wrote from valid record batches in
    // this process (the store keeps this flag only for blocks put as `EncodedBlock`), and the
    // CRC32C taken when they were stored matched again just before this call, so they are the
    // bytes the encoder wrote (a corruption the CRC misses has odds of about 2^-32).
    let reader = unsafe { reader.with_skip_validation(true) };
    Ok(reader.collect::<std::result::Result<Vec<_>, _>>()?)
}

/// Decode one block's IPC stream.
pub fn decode_block(bytes: &Bytes) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let reader = StreamReader::try_new(std::io::Cursor::new(bytes.as_ref()), None)?;
    let schema = reader.schema();
    let batches = reader.collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((schema, batches))
}

/// Encode a schema alone (an IPC stream without batches).
pub fn encode_schema(schema: &Schema) -> Result<Bytes> {
    encode_block(&Arc::new(schema.clone()), &[], Compression::None)
}

/// Decode a schema sent by [`encode_schema`]; malformed bytes are an error, never a panic.
pub fn decode_schema(bytes: &[u8]) -> Result<SchemaRef> {
    // Schemas come from the network: a malformed one must be an error, even where arrow's
    // flatbuffer decoding panics on it.
    let decoded = std::panic::catch_unwind(|| {
        StreamReader::try_new(std::io::Cursor::new(bytes), None).map(|r| r.schema())
    });
    match decoded {
        Ok(Ok(schema)) => Ok(schema),
        Ok(Err(e)) => Err(Error::invalid(format!("bad IPC schema: {e}"))),
        Err(_) => Err(Error::invalid("bad IPC schema: it could not be decoded")),
    }
}

/// Whether a view array's data buffers hold more than twice the bytes its views use.
fn wasteful<T: arrow::datatypes::ByteViewType + ?Sized>(
    a: &arrow::array::GenericByteViewArray<T>,
) -> bool {
    let held: usize = a.data_buffers().iter().map(|b| b.len()).sum();
    held > 2 * a.total_buffer_bytes_used()
}

/// Copy the live bytes of top-level view arrays (Utf8View/BinaryView) into fresh buffers,
/// when their buffers are mostly unused (slices of larger arrays); compact arrays are kept
/// as they are, so compacting twice costs nothing the second time.
pub fn compact_views(batch: &RecordBatch) -> Result<RecordBatch> {
    let needs = batch
        .schema()
        .fields()
        .iter()
        .any(|f| matches!(f.data_type(), DataType::Utf8View | DataType::BinaryView));
    if !needs {
        return Ok(batch.clone());
    }
    let cols: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|c| match c.data_type() {
            DataType::Utf8View => c
                .as_any()
                .downcast_ref::<StringViewArray>()
                .filter(|a| wasteful(*a))
                .map(|a| Arc::new(a.gc()) as ArrayRef)
                .unwrap_or_else(|| c.clone()),
            DataType::BinaryView => c
                .as_any()
                .downcast_ref::<BinaryViewArray>()
                .filter(|a| wasteful(*a))
                .map(|a| Arc::new(a.gc()) as ArrayRef)
                .unwrap_or_else(|| c.clone()),
            _ => c.clone(),
        })
        .collect();
    Ok(batch_with(batch.schema(), cols, batch.num_rows())?)
}

/// `batch` cast to `schema` where a column's type differs (dictionaries to their values).
pub fn cast_to(batch: RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    if batch.schema() == *schema {
        return Ok(batch);
    }
    if batch.num_columns() != schema.fields().len() {
        return Err(Error::invalid(format!(
            "a batch has {} columns, the shuffle's schema {}",
            batch.num_columns(),
            schema.fields().len()
        )));
    }
    let cols = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                arrow::compute::cast(c, f.data_type()).map_err(Error::from)
            }
        })
        .collect::<Result<Vec<arrow::array::ArrayRef>>>()?;
    Ok(batch_with(schema.clone(), cols, batch.num_rows())?)
}

/// `columns` under `schema`, keeping the row count also when there are no columns (a
/// zero-column batch, as under `count(*)`, carries nothing but its rows).
pub fn batch_with(
    schema: arrow::datatypes::SchemaRef,
    columns: Vec<ArrayRef>,
    rows: usize,
) -> std::result::Result<RecordBatch, arrow::error::ArrowError> {
    let opts = arrow::array::RecordBatchOptions::new().with_row_count(Some(rows));
    RecordBatch::try_new_with_options(schema, columns, &opts)
}

/// True when two schemas carry the same column names and types (metadata and nullability aside).
pub fn same_columns(a: &Schema, b: &Schema) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields())
            .all(|(x, y)| x.name() == y.name() && x.data_type() == y.data_type())
}

/// The schema's columns as `[name: type, ...]`, for messages.
pub fn schema_summary(s: &Schema) -> String {
    let cols: Vec<String> = s
        .fields()
        .iter()
        .map(|f| format!("{}: {}", f.name(), f.data_type()))
        .collect();
    format!("[{}]", cols.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringViewArray};
    use arrow::datatypes::Field;
    use proptest::prelude::*;

    proptest! {
        /// The slices of a skew split cover every block exactly once, and evenly: each map's
        /// blocks of one partition differ by at most one between slices.
        #[test]
        fn slices_partition_the_blocks(maps in 1u32..6, blocks in 0u32..40, count in 1u32..9) {
            let mut per_slice = vec![vec![0u32; maps as usize]; count as usize];
            for map in 0..maps {
                for seq in 0..blocks {
                    let id = BlockId { shuffle: ShuffleId(1), map, partition: 3, attempt: 0, seq };
                    let owners: Vec<u32> = (0..count)
                        .filter(|&i| Slice::new(i, count).unwrap().contains(&id))
                        .collect();
                    prop_assert_eq!(owners.len(), 1);
                    per_slice[owners[0] as usize][map as usize] += 1;
                    prop_assert!(Slice::WHOLE.contains(&id));
                }
            }
            for map in 0..maps as usize {
                let n: Vec<u32> = per_slice.iter().map(|s| s[map]).collect();
                prop_assert!(n.iter().max().unwrap() - n.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn a_slice_index_beyond_its_count_is_refused() {
        assert!(Slice::new(3, 3).is_err());
        assert_eq!(Slice::new(0, 0).unwrap(), Slice::WHOLE);
    }

    fn batch() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("s", DataType::Utf8View, true),
        ]));
        let s: StringViewArray = (0..1000)
            .map(|i| Some(format!("a long enough string value {i}")))
            .collect();
        RecordBatch::try_new(
            schema,
            vec![Arc::new(Int64Array::from_iter_values(0..1000)), Arc::new(s)],
        )
        .unwrap()
    }

    #[test]
    fn roundtrip_every_codec() {
        let b = batch();
        for c in [Compression::None, Compression::Lz4, Compression::Zstd] {
            let bytes = encode_block(&b.schema(), &[b.clone(), b.slice(3, 10)], c).unwrap();
            let (schema, out) = decode_block(&bytes).unwrap();
            assert_eq!(schema, b.schema());
            assert_eq!(out[0], b);
            assert_eq!(out[1], b.slice(3, 10));
        }
    }

    #[test]
    fn view_slices_are_compacted() {
        let b = batch();
        let full = encode_block(&b.schema(), std::slice::from_ref(&b), Compression::None).unwrap();
        let small = encode_block(&b.schema(), &[b.slice(0, 10)], Compression::None).unwrap();
        assert!(
            small.len() * 20 < full.len(),
            "{} vs {}",
            small.len(),
            full.len()
        );
    }

    #[test]
    fn batches_over_the_cap_are_cut_into_row_slices() {
        let schema = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, false)]));
        let big = "x".repeat(12_000);
        let s: arrow::array::StringArray = (0..3000).map(|i| Some(format!("{i}{big}"))).collect();
        let b = RecordBatch::try_new(schema.clone(), vec![Arc::new(s)]).unwrap();
        assert!(b.get_array_memory_size() > 2 * MAX_BATCH_BYTES);
        let bytes = encode_block(&schema, std::slice::from_ref(&b), Compression::None).unwrap();
        let (_, out) = decode_block(&bytes).unwrap();
        assert!(out.len() >= 3, "{} batches", out.len());
        assert!(out.iter().all(|o| o.num_rows() * 12_000 <= MAX_BATCH_BYTES));
        let joined = arrow::compute::concat_batches(&schema, &out).unwrap();
        assert_eq!(joined, b);
    }
}
