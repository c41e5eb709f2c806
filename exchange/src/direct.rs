//! Seer's direct exchange through the object store (strategy `store`; Seer §3): every map
//! writes its output as one object ([`crate::storage`], blocks sorted by partition, so a
//! partition's blocks in an object are adjacent), and a reader fetches its partition from
//! each map's object by byte range: one ranged GET per (map, reducer), no LIST (the manifest
//! names every object and range), each block checked against its CRC32C before it is
//! decoded. Readers then depend on the store only, never on the worker that ran the map.
//!
//! Seer's two-level exchange (§3.2, strategy `store-two-level`) adds a level: [`combine`]
//! gathers the blocks of one range of partitions (a column) from a group of map objects into
//! one object, partition by partition; readers then read the combined objects exactly as they
//! read map objects (a block keeps its map's id), one ranged GET per object, so a shuffle of
//! p maps and p partitions makes about 2·p·√p requests instead of p².

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

/// The blocks of `partition` (of `slice` of it) in `objects`, object by object. A packed
/// block (several partitions in one, written by a map of a merging strategy before its
/// shuffle moved to the store, see `Driver::retire_worker`) is read whole by every partition's
/// reader, which keeps its rows. An object whose index does not parse is an error naming it.
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
            let packed = meta.id.partition == crate::ids::PACKED;
            if (packed || meta.id.partition == partition) && slice.contains(&meta.id) {
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

/// Read `ranges` of `partition` from `storage`: each object's blocks in one ranged request
/// (adjacent ranges coalesced), a few objects at a time; every block checked and decoded, in
/// object order (a packed block's rows of `partition` only).
pub fn read(storage: Arc<Storage>, ranges: PartitionRanges, partition: u32) -> BatchStream {
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
                    let (schema, b) = decode_block(&d)?;
                    if meta.id.partition == crate::ids::PACKED {
                        batches.extend(crate::block::packed::partition_of(
                            &schema, &b, partition, meta.rows,
                        )?);
                    } else {
                        batches.extend(b);
                    }
                }
                Ok::<_, Error>(futures::stream::iter(batches.into_iter().map(Ok)))
            }
        })
        .buffered(OBJECTS_IN_FLIGHT)
        .try_flatten();
    Box::pin(reads)
}

/// One block read from a map object, with its holder when the map committed.
type Fetched = (BlockMeta, u32, bytes::Bytes);

/// The blocks of partitions `partitions` in `object`, in one ranged request, each checked
/// against its CRC32C.
async fn fetch_column(
    storage: Arc<Storage>,
    object: proto::StoredObject,
    partitions: std::ops::Range<u32>,
) -> Result<Vec<Fetched>> {
    let bad = |reason: String| Error::Storage {
        object: storage.name(&object.path),
        reason,
    };
    if object.blocks.len() != object.offsets.len() {
        return Err(bad("its index lists blocks and offsets apart".into()));
    }
    let mut want = Vec::new();
    for (i, (m, &offset)) in object.blocks.iter().zip(&object.offsets).enumerate() {
        let meta = BlockMeta::try_from(m).map_err(|e| bad(format!("a block entry: {e}")))?;
        if meta.id.partition == crate::ids::PACKED {
            return Err(bad("it holds packed blocks, not read by range".into()));
        }
        if !partitions.contains(&meta.id.partition) {
            continue;
        }
        match offset.checked_add(meta.bytes) {
            Some(end) if end <= object.size => {}
            _ => return Err(bad(format!("block {} runs past its end", meta.id))),
        }
        let holder = object.holders.get(i).copied().unwrap_or(u32::MAX);
        want.push((meta, holder, offset));
    }
    if want.is_empty() {
        return Ok(vec![]);
    }
    let ranges: Vec<std::ops::Range<u64>> = want.iter().map(|(m, _, o)| *o..o + m.bytes).collect();
    let data = storage.get_ranges(&object.path, &ranges).await?;
    let mut out = Vec::with_capacity(want.len());
    for ((meta, holder, offset), d) in want.into_iter().zip(data) {
        let crc = crc32c::crc32c(&d);
        if crc != meta.crc32c || d.len() as u64 != meta.bytes {
            return Err(bad(format!(
                "block {} at {offset} has CRC32C {crc:#010x}, the commit recorded {:#010x} \
                 (corrupted object)",
                meta.id, meta.crc32c
            )));
        }
        out.push((meta, holder, d));
    }
    Ok(out)
}

/// The second level of the two-level exchange: the blocks of `partitions` in each of
/// `objects` (one ranged request per object, each block CRC-checked), written to `storage` as
/// the one object `path`, ordered by partition so a reader's partition is one range of it.
/// An empty record (no path) and no object when the objects hold none of those partitions.
pub async fn combine(
    storage: Arc<Storage>,
    objects: Vec<proto::StoredObject>,
    partitions: std::ops::Range<u32>,
    path: String,
) -> Result<proto::StoredObject> {
    let reads = objects
        .into_iter()
        .filter(|o| !o.path.is_empty())
        .map(|o| fetch_column(storage.clone(), o, partitions.clone()));
    let mut blocks: Vec<Fetched> = futures::stream::iter(reads)
        .buffered(OBJECTS_IN_FLIGHT)
        .try_concat()
        .await?;
    if blocks.is_empty() {
        return Ok(proto::StoredObject::default());
    }
    blocks.sort_by_key(|(m, _, _)| (m.id.partition, m.id.map, m.id.seq));
    let mut w = crate::storage::ObjectWriter::new(&storage, path);
    for (meta, holder, data) in &blocks {
        if let Err(e) = w.push(meta, *holder, data).await {
            w.abort().await;
            return Err(e);
        }
    }
    w.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockId, ShuffleId};
    use crate::storage::{ObjectWriter, StorageConfig};

    /// A map object of map `map` with one block per partition 0..6, each `map` x `p` bytes;
    /// `bad` gets a CRC the bytes do not match.
    async fn map_object(storage: &Storage, map: u32, bad: Option<u32>) -> proto::StoredObject {
        let mut w = ObjectWriter::new(storage, format!("s/{map}-0.fsobj"));
        for p in 0..6u32 {
            let data = vec![(map * 10 + p) as u8; (10 + p) as usize];
            let crc = crc32c::crc32c(&data) ^ u32::from(bad == Some(p));
            let meta = BlockMeta {
                id: BlockId {
                    shuffle: ShuffleId(1),
                    map,
                    partition: p,
                    attempt: 0,
                    seq: 0,
                },
                rows: 1,
                bytes: data.len() as u64,
                crc32c: crc,
            };
            w.push(&meta, map % 2, &data).await.unwrap();
        }
        w.finish().await.unwrap()
    }

    fn memory() -> Arc<Storage> {
        Arc::new(Storage::open(&StorageConfig::new("memory:///", []).unwrap()).unwrap())
    }

    /// A column of three map objects becomes one object holding exactly their blocks of
    /// those partitions, partition by partition, one ranged GET per map object; a reader's
    /// partition in it is then one range. A block whose bytes fail their CRC fails the
    /// combine naming the object, and nothing is written.
    #[tokio::test]
    async fn a_column_of_map_objects_becomes_one_object_of_its_partitions() {
        let storage = memory();
        let mut objects = Vec::new();
        for m in 0..3 {
            objects.push(map_object(&storage, m, None).await);
        }
        let gets = storage.stats().gets;
        let out = combine(
            storage.clone(),
            objects.clone(),
            2..4,
            "s/c0-0-0.fsobj".into(),
        )
        .await
        .unwrap();
        assert_eq!(
            storage.stats().gets - gets,
            3,
            "one ranged GET per map object"
        );
        let got: Vec<(u32, u32)> = out
            .blocks
            .iter()
            .map(|b| BlockMeta::try_from(b).unwrap().id)
            .map(|id| (id.partition, id.map))
            .collect();
        assert_eq!(got, vec![(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)]);
        assert_eq!(out.holders, vec![0, 1, 0, 0, 1, 0]);
        // Read back through the reader's path: partition 3 from the combined object.
        let ranges = ranges_of(&storage, std::slice::from_ref(&out), 3, Slice::WHOLE).unwrap();
        assert_eq!(ranges.len(), 1);
        let (path, blocks) = &ranges[0];
        let want: Vec<std::ops::Range<u64>> = blocks.iter().map(|(m, o)| *o..o + m.bytes).collect();
        let data = storage.get_ranges(path, &want).await.unwrap();
        let bytes: Vec<Vec<u8>> = data.iter().map(|d| d.to_vec()).collect();
        assert_eq!(bytes, vec![vec![3u8; 13], vec![13u8; 13], vec![23u8; 13]]);
        // No block of the column: no object, no request.
        let none = combine(storage.clone(), vec![], 0..6, "s/c1-0-0.fsobj".into())
            .await
            .unwrap();
        assert!(none.path.is_empty());
        // A corrupted block.
        objects.push(map_object(&storage, 3, Some(2)).await);
        let err = combine(storage.clone(), objects, 2..4, "s/c0-0-1.fsobj".into())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("s/3-0.fsobj") && err.contains("CRC32C"),
            "{err}"
        );
        assert!(
            storage.get("s/c0-0-1.fsobj").await.is_err(),
            "nothing written"
        );
    }
}
