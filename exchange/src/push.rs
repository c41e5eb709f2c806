//! Pushing a map task's blocks to the workers that hold their partitions (push and two-level
//! strategies; Magnet, Exoshuffle ES-push). The driver's placement names a holder per
//! partition ([`crate::strategy::Placement`]); a block for this worker goes to its own store,
//! every other block goes over one `do_put` stream per holder, opened on the first block for
//! it. Each stream is fed through a bounded channel, so a map task gets ahead of a slow holder
//! by at most [`IN_FLIGHT`] blocks per holder (the backpressure); holders spill what does not
//! fit their budget like any other block. Pushed blocks are pending on their holders until
//! the driver commits the attempt on each of them.
//!
//! A parity shuffle's pusher keeps what it sent until the map ends, then encodes the map's
//! parity shards ([`crate::parity`]) and sends them the same way (to itself: into its store).

use crate::block::{BlockId, BlockMeta, ShuffleId};
use crate::error::{Error, Result};
use crate::proto;
use crate::transport::client::WorkerClient;
use crate::transport::peers::PeerReader;
use bytes::Bytes;
use std::collections::HashMap;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Blocks queued for one holder before the map task waits for it.
pub const IN_FLIGHT: usize = 2;

type Sent = JoinHandle<Result<proto::TaskResult>>;

/// One map attempt's pushes.
pub struct Pusher {
    /// The holder (worker index) of each partition.
    to: Vec<u32>,
    me: u32,
    peers: Vec<String>,
    reader: std::sync::Arc<PeerReader>,
    push: proto::PushBlocks,
    streams: HashMap<u32, (mpsc::Sender<(proto::BlockMeta, Bytes)>, Sent)>,
    /// Parity shards per stripe (0: none), and the blocks sent so far while encoding one
    /// (or, with `keep`, until the map's object is written: a durable shuffle).
    parity: u32,
    sent: Vec<(u32, BlockMeta, Bytes)>,
    keep: bool,
}

impl Pusher {
    /// Send the blocks `outgoing` holds to their holders (a no-op without a pusher).
    pub(crate) async fn send_all(
        push: &mut Option<Pusher>,
        outgoing: &mut Vec<(u32, crate::block::BlockMeta, bytes::Bytes)>,
    ) -> crate::error::Result<()> {
        if let Some(pusher) = push.as_mut() {
            for (holder, meta, data) in outgoing.drain(..) {
                pusher.send(holder, meta, data).await?;
            }
        }
        Ok(())
    }

    /// The pusher `task` asks for (None when it keeps every block here). Its placement must
    /// name a holder among its peers for each of the shuffle's `partitions`.
    pub fn for_task(
        task: &proto::MapTask,
        partitions: u32,
        reader: std::sync::Arc<PeerReader>,
    ) -> Result<Option<Self>> {
        if task.push_to.is_empty() {
            if task.parity > 0 {
                return Err(Error::invalid(
                    "a map task with parity needs push placement (partition owners)",
                ));
            }
            return Ok(None);
        }
        let n = task.push_peers.len() as u32;
        crate::parity::check(n as usize, task.parity)?;
        if task.push_to.len() != partitions as usize
            || task.worker_index >= n
            || task.push_to.iter().any(|&w| w >= n)
        {
            return Err(Error::invalid(format!(
                "push placement names {} holders among {n} peers (this worker {}) for {partitions} \
                 partitions; it needs one valid holder per partition",
                task.push_to.len(),
                task.worker_index
            )));
        }
        Ok(Some(Pusher {
            to: task.push_to.clone(),
            me: task.worker_index,
            peers: task.push_peers.clone(),
            reader,
            push: proto::PushBlocks {
                shuffle_id: task.shuffle_id,
                map_id: task.map_id,
                attempt: task.attempt,
            },
            streams: HashMap::new(),
            parity: task.parity,
            sent: Vec::new(),
            keep: false,
        }))
    }

    /// Keep every block sent, for the map's object (a durable shuffle): [`Pusher::finish`]
    /// hands them over in [`crate::map_config::MapOutput::sent`].
    pub fn keep_sent(&mut self) {
        self.keep = true;
    }

    /// This worker's index among the peers.
    pub fn me(&self) -> u32 {
        self.me
    }

    /// The holder of `partition` (this worker's index for the partitions it keeps).
    pub fn holder(&self, partition: u32) -> u32 {
        self.to.get(partition as usize).copied().unwrap_or(self.me)
    }

    /// The holder of `partition` when it is another worker (None: store it here).
    pub fn remote_holder(&self, partition: u32) -> Option<u32> {
        let to = *self.to.get(partition as usize)?;
        (to != self.me).then_some(to)
    }

    /// Send one block to `holder` (waits while [`IN_FLIGHT`] blocks are queued for it).
    pub async fn send(&mut self, holder: u32, meta: BlockMeta, data: Bytes) -> Result<()> {
        if self.parity > 0 || self.keep {
            self.sent.push((holder, meta, data.clone()));
        }
        if !self.streams.contains_key(&holder) {
            let client: WorkerClient = self
                .reader
                .client(holder as usize, &self.peers[holder as usize])?;
            let (tx, rx) = mpsc::channel(IN_FLIGHT);
            let push = self.push;
            let sent = tokio::spawn(async move { client.push_blocks(push, rx).await });
            self.streams.insert(holder, (tx, sent));
        }
        let Some((tx, _)) = self.streams.get(&holder) else {
            return Err(Error::Cluster("push stream vanished".into()));
        };
        if tx.send(((&meta).into(), data)).await.is_err() {
            // The stream ended early: its task holds the reason.
            let (_, sent) = self
                .streams
                .remove(&holder)
                .ok_or_else(|| Error::Cluster("push stream vanished".into()))?;
            return Err(match sent.await {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => Error::Cluster(format!("worker {holder} ended a push stream early")),
                Err(e) => Error::Cluster(format!("push stream task failed: {e}")),
            });
        }
        Ok(())
    }

    /// Send the map's parity shards (a parity shuffle), close every stream and record in
    /// `out` what each holder stored.
    pub async fn finish(
        mut self,
        store: &crate::store::BlockStore,
        out: &mut crate::map_config::MapOutput,
    ) -> Result<()> {
        self.send_parity(store, out).await?;
        if self.keep {
            out.sent = std::mem::take(&mut self.sent);
        }
        let mut waits = Vec::new();
        for (holder, (tx, sent)) in std::mem::take(&mut self.streams) {
            drop(tx);
            waits.push(async move { (holder, sent.await) });
        }
        for (holder, r) in futures::future::join_all(waits).await {
            let stored =
                r.map_err(|e| Error::Cluster(format!("push stream task failed: {e}")))??;
            out.pushed.push(proto::PushedBlocks {
                worker: holder,
                blocks: stored.blocks,
            });
        }
        out.pushed.sort_by_key(|p| p.worker);
        Ok(())
    }

    /// Encode the parity of this attempt's output, stripe by stripe ([`crate::parity`]): a
    /// worker's shard is the blocks it holds, in (partition, seq) order, cut into pieces.
    /// Parity for this worker goes into its store, the rest to their holders.
    async fn send_parity(
        &mut self,
        store: &crate::store::BlockStore,
        out: &mut crate::map_config::MapOutput,
    ) -> Result<()> {
        let r = std::mem::take(&mut self.parity);
        if r == 0 {
            return Ok(());
        }
        let n = self.peers.len();
        let mut held: Vec<Vec<(BlockId, Bytes)>> = vec![Vec::new(); n];
        for m in &out.blocks {
            held[self.me as usize].push((m.id, store.get(&m.id)?));
        }
        for (h, m, d) in std::mem::take(&mut self.sent) {
            held.get_mut(h as usize)
                .ok_or_else(|| Error::Cluster(format!("block sent to unknown worker {h}")))?
                .push((m.id, d));
        }
        let push = self.push;
        let encoded = tokio::task::block_in_place(|| -> Result<Vec<(usize, BlockId, Bytes)>> {
            let shards: Vec<Vec<u8>> = held.iter_mut().map(|b| shard(b)).collect();
            let k = crate::parity::pieces(n, r);
            let mut parity = Vec::new();
            for (s, stripe) in crate::parity::stripes(n, r)?.iter().enumerate() {
                let pieces: Vec<Vec<u8>> = stripe
                    .members
                    .iter()
                    .map(|&(w, j)| shards[w][crate::parity::piece(shards[w].len(), k, j)].to_vec())
                    .collect();
                for (j, p) in crate::parity::encode(&pieces, r)?.into_iter().enumerate() {
                    let id = BlockId {
                        shuffle: ShuffleId(push.shuffle_id),
                        map: push.map_id,
                        partition: crate::parity::PARITY,
                        attempt: push.attempt,
                        seq: crate::parity::parity_seq(s, r, j),
                    };
                    parity.push((stripe.parity[j], id, Bytes::from(p)));
                }
            }
            Ok(parity)
        })?;
        for (holder, id, data) in encoded {
            if holder == self.me as usize {
                let (meta, spilled) = store.put_where(id, 0, data)?;
                if spilled {
                    out.spilled_bytes += meta.bytes;
                }
                out.blocks.push(meta);
            } else {
                let meta = BlockMeta {
                    id,
                    rows: 0,
                    bytes: data.len() as u64,
                    crc32c: crc32c::crc32c(&data),
                };
                self.send(holder as u32, meta, data).await?;
            }
        }
        Ok(())
    }
}

/// One worker's shard of a map's output: its blocks' bytes in (partition, seq) order.
pub fn shard(blocks: &mut [(BlockId, Bytes)]) -> Vec<u8> {
    blocks.sort_by_key(|(id, _)| (id.partition, id.seq));
    let mut out = Vec::with_capacity(blocks.iter().map(|(_, d)| d.len()).sum());
    for (_, d) in blocks.iter() {
        out.extend_from_slice(d);
    }
    out
}

impl Drop for Pusher {
    fn drop(&mut self) {
        // A map that fails or is aborted stops its streams (the holders keep what arrived as
        // pending; the driver's cancel or the seal removes it).
        for (_, sent) in self.streams.values() {
            sent.abort();
        }
    }
}
