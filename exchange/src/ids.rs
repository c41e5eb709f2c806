//! Identity: what names a shuffle and a block, and the reserved values of a block id's fields
//! (ids at or above them name something other than a map task or a reduce partition). The
//! lowest layer: it imports only the error type and the wire messages.

use crate::proto;
use std::fmt;

/// The partition field of a packed block's id (a block holding rows of many partitions, see
/// [`crate::packed`]).
pub const PACKED: u32 = u32::MAX;

/// The partition field of a parity block's id (never a real partition, never read by
/// readers; see [`crate::parity`]).
pub const PARITY: u32 = u32::MAX - 1;

/// Map ids from here on name merge groups (merging strategies), not map tasks.
pub const MERGE_GROUP_BASE: u32 = 1 << 31;

/// Merge group ids from here on name forwards ([`crate::forward`]): maps moved unmerged to
/// their holders, which merge them again like the maps there. Merges count up from
/// [`MERGE_GROUP_BASE`] below it.
pub const FORWARD_GROUP_BASE: u32 = MERGE_GROUP_BASE + (1 << 30);

/// Whether map id `map` names a merge group (or a forward), not a map task.
pub fn is_group(map: u32) -> bool {
    map >= MERGE_GROUP_BASE
}

/// Names one shuffle across the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShuffleId(pub u64);

impl fmt::Display for ShuffleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl ShuffleId {
    /// A random shuffle id.
    pub fn random() -> Self {
        ShuffleId(rand::random::<u64>())
    }
}

/// (shuffle, map or merge group, reduce partition, attempt, sequence within the attempt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    /// The shuffle the block belongs to.
    pub shuffle: ShuffleId,
    /// The map task that wrote the block, or a merge group (ids from [`MERGE_GROUP_BASE`]).
    pub map: u32,
    /// The reduce partition of its rows ([`PACKED`] or [`PARITY`] for those blocks).
    pub partition: u32,
    /// The attempt of the map task or merge group that wrote it.
    pub attempt: u32,
    /// The block's sequence number within its attempt.
    pub seq: u32,
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shuffle={} map={} partition={} attempt={} seq={}",
            self.shuffle, self.map, self.partition, self.attempt, self.seq
        )
    }
}

impl From<&proto::BlockKey> for BlockId {
    fn from(k: &proto::BlockKey) -> Self {
        BlockId {
            shuffle: ShuffleId(k.shuffle_id),
            map: k.map_id,
            partition: k.partition,
            attempt: k.attempt,
            seq: k.seq,
        }
    }
}

impl From<BlockId> for proto::BlockKey {
    fn from(b: BlockId) -> Self {
        proto::BlockKey {
            shuffle_id: b.shuffle.0,
            map_id: b.map,
            partition: b.partition,
            attempt: b.attempt,
            seq: b.seq,
        }
    }
}
