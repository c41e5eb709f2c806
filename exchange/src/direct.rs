//! Seer's direct exchange through the object store (strategy `store`; Seer §3): every map
//! writes its output as one object ([`crate::storage`], blocks sorted by partition, so a
//! partition's blocks in an object are adjacent), and a reader fetches its partition from
//! each map's object by byte range: one ranged GET per (map, reducer), no LIST (the manifest
//! names every object and range), each block checked against its CRC32C before it is
//! decoded. Readers then depend on the store only, never on the worker that ran the map.

use crate::block::{decode_block, BlockMeta, Slice};
use crate::error::{Error, Result};
use crate::proto;
use crate::source::BatchStream;
use crate::storage::Storage;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;

/// Objects read at once by one reader (each read is one request; a store answers one in some
/// milliseconds, so many are kept in flight).
const OBJECTS_IN_FLIGHT: usize = 64;

/// One partition's blocks in the map objects: each object's path and its blocks there, with
/// the offset each starts at.
pub type PartitionRanges = Vec<(String, Vec<(BlockMeta, u64)>)>;

/// The blocks of `partition` (of `slice` of it) in `objects`, object by object. An object
/// whose index does not parse or that holds packed blocks (several partitions in one block)
/// is an error naming it.
pub fn ranges_of(
    storage: &Storage,
    objects: &[proto::StoredObject],
    partition: u32,
    slice: Slice,
) -> Result<PartitionRanges> {
    let mut out = Vec::new();
    for o in objects {
        let bad = |reason: String| Error::Storage {
            object: storage.name(&o.path),
            reason,
        };
        if o.blocks.len() != o.offsets.len() {
            return Err(bad("its index lists blocks and offsets apart".into()));
        }
        let mut blocks = Vec::new();
        for (m, &offset) in o.blocks.iter().zip(&o.offsets) {
            let meta = BlockMeta::try_from(m).map_err(|e| bad(format!("a block entry: {e}")))?;
            if meta.id.partition == crate::ids::PACKED {
                return Err(bad("it holds packed blocks, not read by range".into()));
            }
            if meta.id.partition == partition && slice.contains(&meta.id) {
                match offset.checked_add(meta.bytes) {
                    Some(end) if end <= o.size => blocks.push((meta, offset)),
                    _ => return Err(bad(format!("block {} runs past its end", meta.id))),
                }
            }
        }
        if !blocks.is_empty() {
            out.push((o.path.clone(), blocks));
        }
    }
    Ok(out)
}

/// Read `ranges` from `storage`: each object's blocks in one ranged request (adjacent ranges
/// coalesced), a few objects at a time; every block checked and decoded, in object order.
pub fn read(storage: Arc<Storage>, ranges: PartitionRanges) -> BatchStream {
    let reads = futures::stream::iter(ranges)
        .map(move |(path, blocks)| {
            let storage = storage.clone();
            async move {
                let want: Vec<std::ops::Range<u64>> = blocks
                    .iter()
                    .map(|(m, offset)| *offset..offset + m.bytes)
                    .collect();
                let data = storage.get_ranges(&path, &want).await?;
                let mut batches = Vec::new();
                for ((meta, offset), d) in blocks.iter().zip(data) {
                    let crc = crc32c::crc32c(&d);
                    if crc != meta.crc32c || d.len() as u64 != meta.bytes {
                        return Err(Error::Storage {
                            object: storage.name(&path),
                            reason: format!(
                                "block {} at {offset} has CRC32C {crc:#010x}, the commit \
                                 recorded {:#010x} (corrupted object)",
                                meta.id, meta.crc32c
                            ),
                        });
                    }
                    let (_, b) = decode_block(&d)?;
                    batches.extend(b);
                }
                Ok::<_, Error>(futures::stream::iter(batches.into_iter().map(Ok)))
            }
        })
        .buffered(OBJECTS_IN_FLIGHT)
        .try_flatten();
    Box::pin(reads)
}
