//! The read side of the block store: block bytes and batches (CRC-checked; packed blocks
//! sliced to one partition where a reader asks for one), committed metadata, partition streams
//! that follow commits until the seal, and map outputs.

use super::{BlockStore, Location};
use crate::block::{BlockId, BlockMeta, ShuffleId};
use crate::error::{Error, Result};
use crate::sync::lock;
use arrow::array::RecordBatch;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::watch;

/// A block's bytes after their CRC32C check.
struct Checked {
    data: Bytes,
    /// Encoded here and read from memory: decoded without re-validation.
    trusted: bool,
    /// A packed block's ends, and the shuffle's schema its batches are relabelled with.
    packed: Option<(crate::block::packed::Ends, arrow::datatypes::SchemaRef)>,
}

impl BlockStore {
    /// Read a block and check its CRC32C.
    pub fn get(&self, id: &BlockId) -> Result<Bytes> {
        self.get_checked(id).map(|c| c.data)
    }

    /// A block's metadata and bytes as stored, CRC32C checked, committed or pending (what a
    /// rebuild from parity reads).
    pub fn get_raw(&self, id: &BlockId) -> Result<(BlockMeta, Bytes)> {
        let meta = {
            let st = lock(&self.state);
            let sh = st
                .get(&id.shuffle)
                .ok_or(Error::UnknownShuffle(id.shuffle))?;
            sh.blocks
                .get(id)
                .map(|e| e.meta)
                .ok_or(Error::BlockNotFound(*id))?
        };
        Ok((meta, self.get(id)?))
    }

    /// Read a block, check its CRC32C and decode it: without arrow's second validation when
    /// this process encoded it ([`EncodedBlock`]), with it otherwise.
    ///
    /// [`EncodedBlock`]: crate::block::EncodedBlock
    pub fn read_batches(&self, id: &BlockId) -> Result<Vec<RecordBatch>> {
        self.read_part(id, None)
    }

    /// [`BlockStore::read_batches`]; of a packed block only the rows of `partition` when one is
    /// named (as slices, no copy).
    pub fn read_part(&self, id: &BlockId, partition: Option<u32>) -> Result<Vec<RecordBatch>> {
        let (batches, ends) = self.decode(id)?;
        Ok(match (ends, partition) {
            (Some(ends), Some(p)) => crate::block::packed::slice_partition(&batches, &ends, p),
            _ => batches,
        })
    }

    /// A packed block's batches and partition ends (a merge task's input).
    pub fn read_packed(
        &self,
        id: &BlockId,
    ) -> Result<(Vec<RecordBatch>, crate::block::packed::Ends)> {
        match self.decode(id)? {
            (batches, Some(ends)) => Ok((batches, ends)),
            (_, None) => Err(Error::invalid(format!("block {id} is not packed"))),
        }
    }

    /// The bytes a reader of `partition` gets for block `id`: the stored bytes, or for a
    /// packed block the rows of that partition encoded again (without compression).
    pub fn get_part(&self, id: &BlockId, partition: Option<u32>) -> Result<Bytes> {
        if id.partition != crate::ids::PACKED || partition.is_none() {
            return self.get(id);
        }
        let batches = self.read_part(id, partition)?;
        let schema = self.shuffle_info(id.shuffle)?.schema;
        crate::block::encode_block(&schema, &batches, crate::Compression::None)
    }

    /// Decode a checked block; a packed block's batches carry the shuffle's schema (not the
    /// block's, whose metadata holds the ends).
    fn decode(
        &self,
        id: &BlockId,
    ) -> Result<(Vec<RecordBatch>, Option<crate::block::packed::Ends>)> {
        let c = self.get_checked(id)?;
        let batches = if c.trusted {
            self.unvalidated_decodes.fetch_add(1, Ordering::Relaxed);
            crate::block::decode_encoded_here(&c.data)?
        } else {
            crate::block::decode_block(&c.data)?.1
        };
        match c.packed {
            None => Ok((batches, None)),
            Some((ends, schema)) => {
                let batches = batches
                    .into_iter()
                    .map(|b| {
                        crate::block::batch_with(schema.clone(), b.columns().to_vec(), b.num_rows())
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Ok((batches, Some(ends)))
            }
        }
    }

    /// Blocks [`BlockStore::read_batches`] decoded without re-validation so far.
    pub fn unvalidated_decodes(&self) -> u64 {
        self.unvalidated_decodes.load(Ordering::Relaxed)
    }

    /// The block's bytes with their CRC32C checked, and what decoding them needs.
    fn get_checked(&self, id: &BlockId) -> Result<Checked> {
        let (entry, schema) = {
            let st = lock(&self.state);
            let sh = st
                .get(&id.shuffle)
                .ok_or(Error::UnknownShuffle(id.shuffle))?;
            let entry = sh
                .blocks
                .get(id)
                .cloned()
                .ok_or(Error::BlockNotFound(*id))?;
            (entry, sh.info.schema.clone())
        };
        let in_memory = matches!(entry.location, Location::Memory(_));
        let data = match entry.location {
            Location::Memory(b) => b,
            Location::Spilled { segment, offset } => {
                let buf = segment.read(offset, entry.meta.bytes)?;
                self.restored_bytes
                    .fetch_add(entry.meta.bytes, Ordering::SeqCst);
                self.restored_blocks.fetch_add(1, Ordering::SeqCst);
                Bytes::from(buf)
            }
        };
        let actual = crc32c::crc32c(&data);
        if actual != entry.meta.crc32c {
            return Err(Error::Checksum {
                block: *id,
                expected: entry.meta.crc32c,
                actual,
            });
        }
        // Only blocks held in memory skip re-validation: bytes read back from a spill file
        // could have been changed on disk in a way the CRC32C does not catch.
        Ok(Checked {
            data,
            trusted: entry.encoded_here && in_memory,
            packed: entry.ends.map(|e| (e, schema)),
        })
    }

    /// Metadata of a committed block (pending blocks are not visible).
    pub fn meta(&self, id: &BlockId) -> Result<BlockMeta> {
        let st = lock(&self.state);
        let sh = st
            .get(&id.shuffle)
            .ok_or(Error::UnknownShuffle(id.shuffle))?;
        match (sh.blocks.get(id), sh.committed.get(&id.map)) {
            (Some(e), Some((a, _))) if *a == id.attempt => Ok(e.meta),
            _ => Err(Error::BlockNotFound(*id)),
        }
    }

    /// Blocks of a partition from position `from` on, whether the shuffle is sealed, and a
    /// receiver that changes when either does.
    pub fn partition_since(
        &self,
        shuffle: ShuffleId,
        partition: u32,
        from: usize,
    ) -> Result<(Vec<BlockId>, bool, watch::Receiver<u64>)> {
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        sh.reads_started = true;
        let list = sh.by_partition.get(partition as usize).ok_or_else(|| {
            Error::invalid(format!(
                "partition {partition} out of range: shuffle {shuffle} has {}",
                sh.info.partitions
            ))
        })?;
        let rx = sh.version.subscribe();
        Ok((list.get(from..).unwrap_or(&[]).to_vec(), sh.sealed, rx))
    }

    /// The committed blocks of one partition in commit order, as a stream; with `wait`, it
    /// follows new commits until the shuffle is sealed (each wait bounded by `timeout`).
    pub fn follow_partition(
        self: Arc<Self>,
        shuffle: ShuffleId,
        partition: u32,
        wait: bool,
        timeout: std::time::Duration,
    ) -> futures::stream::BoxStream<'static, Result<BlockId>> {
        use futures::StreamExt;
        let init = (0usize, VecDeque::<BlockId>::new(), false);
        futures::stream::unfold(init, move |(mut pos, mut queue, mut done)| {
            let store = self.clone();
            async move {
                loop {
                    if let Some(id) = queue.pop_front() {
                        return Some((Ok(id), (pos, queue, done)));
                    }
                    if done {
                        return None;
                    }
                    let (ids, sealed, mut rx) = match store.partition_since(shuffle, partition, pos)
                    {
                        Ok(x) => x,
                        Err(e) => return Some((Err(e), (pos, queue, true))),
                    };
                    pos += ids.len();
                    queue.extend(ids);
                    if sealed || !wait {
                        done = true;
                        continue;
                    }
                    if queue.is_empty()
                        && tokio::time::timeout(timeout, rx.changed()).await.is_err()
                    {
                        let e = Error::Timeout {
                            what: format!("shuffle {shuffle} to be sealed (partition {partition})"),
                            seconds: timeout.as_secs_f64(),
                        };
                        return Some((Err(e), (pos, queue, true)));
                    }
                }
            }
        })
        .boxed()
    }

    /// The committed blocks of one map, in (partition, seq) order, once this store knows the
    /// answer: `Some` when the map committed here or the shuffle is sealed (then an absent map
    /// ran elsewhere: `Some(empty)`), `None` while it may still commit here; with a receiver
    /// that changes when either does.
    pub fn map_output(
        &self,
        shuffle: ShuffleId,
        map: u32,
    ) -> Result<(Option<Vec<BlockId>>, watch::Receiver<u64>)> {
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        sh.reads_started = true;
        if let Some(group) = sh.merged_into.get(&map) {
            return Err(Error::Precondition(format!(
                "map {map} of shuffle {shuffle} was merged into group {group}: read its \
                 partitions, not its map output"
            )));
        }
        let rx = sh.version.subscribe();
        let ids = match sh.committed.get(&map) {
            Some((_, ids)) => {
                // Parity blocks are not rows of the map's output.
                let mut ids: Vec<BlockId> = ids
                    .iter()
                    .filter(|b| b.partition != crate::parity::PARITY)
                    .copied()
                    .collect();
                ids.sort_by_key(|b| (b.partition, b.seq));
                Some(ids)
            }
            None if sh.sealed => Some(Vec::new()),
            None => None,
        };
        Ok((ids, rx))
    }

    /// [`BlockStore::map_output`], waiting (at most `timeout` between changes) for the answer.
    pub async fn wait_map_output(
        &self,
        shuffle: ShuffleId,
        map: u32,
        timeout: std::time::Duration,
    ) -> Result<Vec<BlockId>> {
        loop {
            let (ids, mut rx) = self.map_output(shuffle, map)?;
            if let Some(ids) = ids {
                return Ok(ids);
            }
            if tokio::time::timeout(timeout, rx.changed()).await.is_err() {
                return Err(Error::Timeout {
                    what: format!("map {map} of shuffle {shuffle} to commit"),
                    seconds: timeout.as_secs_f64(),
                });
            }
        }
    }
}
