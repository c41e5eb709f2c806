//! Forwarding a worker's committed map outputs to the holders of their partitions: what `auto`
//! does with its first wave of maps when it picks push or two-level after they ran in place
//! ([`crate::strategy::auto`]), so that readers then read the holders only, as under push or
//! two-level from the start.
//!
//! A forward is a merge task with push placement ([`crate::proto::MergeTask`]): the maps'
//! blocks are read back (CRC32C checked), renamed as blocks of the merge group's attempt and,
//! unchanged, sent to the holder of their partition with the pushes of a map task
//! ([`crate::push::Pusher`]); those of this worker's own partitions go back into its store.
//! The group is pending everywhere until the driver commits it: first here, retiring the maps
//! in the same step (refused once a reader has started here), then on the other holders.
//! Each holder, this worker included, then merges it with the maps pushed there like one of
//! them (its group id is a [`FORWARD_GROUP_BASE`] one, which a merge takes; other merge
//! groups are not merged again).

use crate::block::{BlockId, BlockMeta, ShuffleId};
use crate::error::{Error, Result};
use crate::proto;
use crate::store::BlockStore;
use crate::task::MapOutput;
use crate::transport::peers::PeerReader;
use std::sync::Arc;

pub use crate::store::FORWARD_GROUP_BASE;

/// Forward the committed blocks of `m.maps` held in `store` as attempt `m.attempt` of group
/// `m.group` to the holders `m.push_to` names.
pub async fn run(
    store: &Arc<BlockStore>,
    reader: Arc<PeerReader>,
    m: &proto::MergeTask,
) -> Result<MapOutput> {
    let start = std::time::Instant::now();
    let shuffle = ShuffleId(m.shuffle_id);
    let info = store.shuffle_info(shuffle)?;
    let as_map = proto::MapTask {
        shuffle_id: m.shuffle_id,
        map_id: m.group,
        attempt: m.attempt,
        push_peers: m.push_peers.clone(),
        push_to: m.push_to.clone(),
        worker_index: m.worker_index,
        ..Default::default()
    };
    let mut pusher = crate::push::Pusher::for_task(&as_map, info.partitions, reader)?
        .ok_or_else(|| Error::invalid("a forward needs push placement"))?;
    let mut ids = store.committed_blocks_of(shuffle, &m.maps)?;
    if let Some(id) = ids.iter().find(|id| id.partition >= info.partitions) {
        return Err(Error::invalid(format!(
            "block {id} holds rows of several partitions: only blocks of one partition can be \
             forwarded"
        )));
    }
    ids.sort_by_key(|b| (b.partition, b.map, b.seq));
    let mut out = MapOutput::default();
    let mut seq = 0u32;
    let mut last = None;
    for id in ids {
        if last != Some(id.partition) {
            (seq, last) = (0, Some(id.partition));
        }
        let from = store.clone();
        let (meta, data) = tokio::task::spawn_blocking(move || from.get_raw(&id))
            .await
            .map_err(|e| Error::Cluster(format!("reading block {id} to forward failed: {e}")))??;
        let renamed = BlockId {
            map: m.group,
            attempt: m.attempt,
            seq,
            ..id
        };
        seq += 1;
        out.input.rows += meta.rows;
        out.input_bytes += meta.bytes;
        match pusher.remote_holder(id.partition) {
            Some(holder) => {
                let meta = BlockMeta {
                    id: renamed,
                    ..meta
                };
                pusher.send(holder, meta, data).await?;
            }
            None => {
                let (meta, spilled) = store.put_where(renamed, meta.rows, data)?;
                if spilled {
                    out.spilled_bytes += meta.bytes;
                }
                out.blocks.push(meta);
            }
        }
    }
    pusher.finish(store, &mut out).await?;
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}
