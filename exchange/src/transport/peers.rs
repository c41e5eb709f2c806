//! `PeerReader`: one pool of Flight clients per process (one multiplexed connection per peer)
//! and the one place that reads "partition p from every worker". Blocks held by the reader's
//! own worker are read straight from its block store, not over loopback.

use super::client::WorkerClient;
use super::Credentials;
use crate::block::{BlockId, ShuffleId, Slice};
use crate::error::{Error, Result};
use crate::store::BlockStore;
use crate::task::{BatchStream, ShuffleReader};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Local blocks decoded ahead of the one being consumed.
const LOCAL_PREFETCH: usize = 2;

pub struct PeerReader {
    creds: Credentials,
    timeout: Duration,
    clients: Mutex<HashMap<String, WorkerClient>>,
    /// This process's own worker: its advertised address and its store.
    local: Option<(String, Arc<BlockStore>)>,
    /// The runtime the pool was made on: clients are made there, so their connections' tasks
    /// run on it (a worker's serving runtime), not on whichever runtime first asked for a
    /// peer (a map task's, whose threads run at a lower priority).
    runtime: Option<tokio::runtime::Handle>,
}

impl PeerReader {
    /// A pool dialing with `creds`; `local` is the worker this process hosts, if any.
    pub fn new(
        creds: &Credentials,
        timeout: Duration,
        local: Option<(String, Arc<BlockStore>)>,
    ) -> Self {
        PeerReader {
            creds: creds.clone(),
            timeout,
            clients: Mutex::new(HashMap::new()),
            local,
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// A pool seeded with existing clients (the driver's).
    pub fn with_clients(creds: &Credentials, timeout: Duration, clients: &[WorkerClient]) -> Self {
        let me = PeerReader::new(creds, timeout, None);
        lock(&me.clients).extend(clients.iter().map(|c| (c.addr.clone(), c.clone())));
        me
    }

    /// The pooled client of `addr` (created on first use; connects lazily).
    pub fn client(&self, index: usize, addr: &str) -> Result<WorkerClient> {
        let mut clients = lock(&self.clients);
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let _on = self.runtime.as_ref().map(|rt| rt.enter());
        let c = WorkerClient::new(index, addr, &self.creds, self.timeout)?;
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    fn local_store(&self, addr: &str) -> Option<Arc<BlockStore>> {
        match &self.local {
            Some((me, store)) if me == addr => Some(store.clone()),
            _ => None,
        }
    }

    /// Decode the blocks named by `ids` from a local store, a few ahead.
    fn local_blocks(
        store: Arc<BlockStore>,
        ids: BoxStream<'static, Result<BlockId>>,
        partition: Option<u32>,
    ) -> BatchStream {
        let batches = ids
            .map(move |id| {
                let store = store.clone();
                async move {
                    let id = id?;
                    tokio::task::spawn_blocking(move || store.read_part(&id, partition))
                        .await
                        .map_err(|e| Error::Cluster(format!("local block read failed: {e}")))?
                }
            })
            .buffered(LOCAL_PREFETCH)
            .map_ok(|batches| futures::stream::iter(batches.into_iter().map(Ok)))
            .try_flatten();
        Box::pin(batches)
    }

    /// Open one stream per peer with `open` and merge them in arrival order.
    fn read_every_peer<F, Fut>(&self, peers: &[String], open: F) -> BatchStream
    where
        F: Fn(Peer) -> Fut,
        Fut: std::future::Future<Output = Result<BatchStream>> + Send + 'static,
    {
        let opens: Result<Vec<Fut>> = peers
            .iter()
            .enumerate()
            .map(|(i, addr)| {
                let peer = match self.local_store(addr) {
                    Some(store) => Peer::Local(store),
                    None => Peer::Remote(Box::new(self.client(i, addr)?)),
                };
                Ok(open(peer))
            })
            .collect();
        let all = async move {
            let streams = futures::future::try_join_all(opens?).await?;
            Ok::<_, Error>(futures::stream::select_all(streams))
        };
        Box::pin(futures::stream::once(all).try_flatten())
    }
}

/// Where one peer's blocks come from.
enum Peer {
    Local(Arc<BlockStore>),
    Remote(Box<WorkerClient>),
}

impl ShuffleReader for PeerReader {
    fn read_partition_slice(
        &self,
        peers: &[String],
        shuffle: ShuffleId,
        partition: u32,
        slice: Slice,
    ) -> BatchStream {
        let timeout = self.timeout;
        self.read_every_peer(peers, move |peer| async move {
            match peer {
                Peer::Local(store) => {
                    let ids = store
                        .clone()
                        .follow_partition(shuffle, partition, true, timeout)
                        .try_filter(move |id| futures::future::ready(slice.contains(id)))
                        .boxed();
                    Ok(PeerReader::local_blocks(store, ids, Some(partition)))
                }
                Peer::Remote(c) => c.read_partition(shuffle.0, partition, true, slice).await,
            }
        })
    }

    fn read_map_output(&self, peers: &[String], shuffle: ShuffleId, map: u32) -> BatchStream {
        let timeout = self.timeout;
        self.read_every_peer(peers, move |peer| async move {
            match peer {
                Peer::Local(store) => {
                    let ids = store.wait_map_output(shuffle, map, timeout).await?;
                    let ids = futures::stream::iter(ids.into_iter().map(Ok)).boxed();
                    Ok(PeerReader::local_blocks(store, ids, None))
                }
                Peer::Remote(c) => c.read_map_output(shuffle.0, map).await,
            }
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
