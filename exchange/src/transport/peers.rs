//! `PeerReader`: one pool of Flight clients per process (one multiplexed connection per peer)
//! and the one place that reads "partition p from every worker". Blocks held by the reader's
//! own worker are read straight from its block store, not over loopback.

use super::client::WorkerClient;
use super::Credentials;
use crate::block::{BlockId, ShuffleId, Slice};
use crate::error::{Error, Result};
use crate::source::{BatchStream, ShuffleReader};
use crate::store::BlockStore;
use crate::sync::lock;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Local blocks decoded ahead of the one being consumed.
const LOCAL_PREFETCH: usize = 2;

/// The process's pool of Flight clients to workers, and its reader of partitions.
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

impl PeerReader {
    /// Partition `partition` (its `slice`) of `shuffle` read from the map objects, when this
    /// worker's store says it is exchanged through a store (waiting for its seal); None for
    /// any other shuffle.
    fn read_through(
        &self,
        shuffle: ShuffleId,
        partition: u32,
        slice: Slice,
    ) -> Option<BatchStream> {
        let (_, store) = self.local.as_ref()?;
        if !store.reads_through(shuffle) {
            return None;
        }
        let (store, timeout) = (store.clone(), self.timeout);
        let read = async move {
            let Some((storage, objects)) = store.wait_read_through(shuffle, timeout).await? else {
                return Err(Error::UnknownShuffle(shuffle));
            };
            let ranges = crate::direct::ranges_of(&storage, &objects, partition, slice)?;
            Ok(crate::direct::read(storage, ranges, partition))
        };
        Some(Box::pin(futures::stream::once(read).try_flatten()))
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
        // Exchanged through the store: once sealed (waiting for it), read every map's object.
        if let Some(through) = self.read_through(shuffle, partition, slice) {
            return through;
        }
        let check = match &self.local {
            Some((me, store))
                if slice.is_whole() && peers.contains(me) && crate::checksum::verify_reads() =>
            {
                Some(store.clone())
            }
            _ => None,
        };
        let stream = self.read_every_peer(peers, move |peer| async move {
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
        });
        match check {
            Some(store) => counted(stream, store, shuffle, partition),
            None => stream,
        }
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

/// `stream` (partition `partition` of `shuffle` read whole from every peer, this worker
/// among them) checked at its end against the rows the manifest lists for it, which the
/// driver sent with the seal: rows missing or read twice end it with [`Error::RowCount`],
/// never a short or doubled partition. The local peer's part ends only once this worker's
/// store is sealed, so the expected rows are known by then (unknown: no check).
fn counted(
    stream: BatchStream,
    store: Arc<BlockStore>,
    shuffle: ShuffleId,
    partition: u32,
) -> BatchStream {
    let rows = Arc::new(AtomicU64::new(0));
    let seen = rows.clone();
    let counting = stream.inspect_ok(move |b| {
        seen.fetch_add(b.num_rows() as u64, Ordering::Relaxed);
    });
    let check = futures::stream::once(async move {
        let expected = store.expected_rows(shuffle, partition)?;
        let received = rows.load(Ordering::Relaxed);
        (received != expected).then(|| {
            tracing::warn!(%shuffle, partition, expected, received, "a partition read on a worker does not match the manifest");
            Err(Error::RowCount {
                shuffle,
                partition,
                expected,
                received,
            })
        })
    })
    .filter_map(futures::future::ready);
    Box::pin(counting.chain(check))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{encode_block, Compression};
    use crate::store::{ShuffleInfo, StoreConfig};
    use arrow::array::{Int32Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};

    /// A worker's own store holding partition 0 of shuffle 1: one committed block of 5 rows.
    fn local_store() -> (tempfile::TempDir, Arc<BlockStore>) {
        let dir = tempfile::tempdir().unwrap();
        let store = BlockStore::new(StoreConfig {
            memory_budget: 1 << 20,
            spill_dir: dir.path().to_path_buf(),
            segment_bytes: 1 << 20,
            disk_budget: None,
        })
        .unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int32, false)]));
        store
            .create_shuffle(ShuffleInfo {
                id: ShuffleId(1),
                schema: schema.clone(),
                partitions: 1,
                partitioner: crate::partitioner::round_robin(),
                combiner: None,
                order: 0,
                group: 0,
            })
            .unwrap();
        let batch =
            RecordBatch::try_new(schema.clone(), vec![Arc::new(Int32Array::from(vec![1; 5]))])
                .unwrap();
        let data = encode_block(&schema, &[batch], Compression::None).unwrap();
        let id = BlockId {
            shuffle: ShuffleId(1),
            map: 0,
            partition: 0,
            attempt: 0,
            seq: 0,
        };
        store.put(id, 5, data).unwrap();
        store.commit(ShuffleId(1), 0, 0, Some(1)).unwrap();
        (dir, Arc::new(store))
    }

    async fn read(store: &Arc<BlockStore>) -> Result<u64> {
        let me = "127.0.0.1:1".to_string();
        let reader = PeerReader::new(
            &Credentials::plain("t"),
            Duration::from_secs(5),
            Some((me.clone(), store.clone())),
        );
        let batches: Vec<_> = reader
            .read_partition(&[me], ShuffleId(1), 0)
            .try_collect()
            .await?;
        Ok(batches.iter().map(|b| b.num_rows() as u64).sum())
    }

    #[tokio::test]
    async fn a_partition_read_on_a_worker_short_of_its_manifest_is_a_row_count_error() {
        let (_dir, store) = local_store();
        store
            .seal_counted(ShuffleId(1), Some(Arc::from(vec![7u64])))
            .unwrap();
        let err = read(&store).await.unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::RowCount { .. }), "{msg}");
        assert!(msg.contains("read 5 rows, its manifest lists 7"), "{msg}");
    }

    #[tokio::test]
    async fn a_partition_read_on_a_worker_matching_its_manifest_or_uncounted_passes() {
        let (_dir, store) = local_store();
        store
            .seal_counted(ShuffleId(1), Some(Arc::from(vec![5u64])))
            .unwrap();
        assert_eq!(read(&store).await.unwrap(), 5);
        let (_dir, store) = local_store();
        store.seal(ShuffleId(1)).unwrap();
        assert_eq!(read(&store).await.unwrap(), 5);
    }
}
