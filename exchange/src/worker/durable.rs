//! Durable shuffles on the worker ([`crate::storage`]): a shuffle registered with a store has
//! each map attempt's blocks held here written as one object before the attempt reports
//! done, so the commit that follows can record the object in the driver's manifest. The
//! worker keeps one store client per store (URL and options) for all its shuffles.
//!
//! With a disk budget, the same store is the tier below local disk for the shuffle's spill
//! segments ([`crate::store::tier`]); a shuffle registered `tier_only` uses it for that alone.

use super::state::WorkerState;
use crate::block::{BlockMeta, ShuffleId};
use crate::error::Result;
use crate::proto;
use crate::storage::{add_stats, ObjectWriter, Storage, StorageConfig};
use crate::store::tier::Tier;
use crate::sync::lock;
use std::sync::{Arc, Mutex};

/// Open store clients, one per store (URL and options).
pub(crate) type Clients = Vec<(StorageConfig, Arc<Storage>)>;

impl WorkerState {
    /// Remember that `shuffle` writes its map outputs to `storage` (opening a client for a
    /// store not seen before).
    pub(crate) fn set_durable(&self, shuffle: ShuffleId, storage: &proto::Storage) -> Result<()> {
        let client = client_of(&self.storages, storage)?;
        if !storage.tier_only {
            lock(&self.durable).insert(shuffle, (client, storage.prefix.clone()));
        }
        Ok(())
    }

    /// With a disk budget, let the closed spill segments of `shuffle` (registered) move to
    /// its store past the budget ([`crate::store::tier`]).
    pub(crate) fn use_tier(&self, shuffle: ShuffleId, storage: &proto::Storage) -> Result<()> {
        if self.store.config().disk_budget.is_none() {
            return Ok(());
        }
        let client = client_of(&self.tier_storages, storage)?;
        // Segment files are numbered alike on every worker: each process has its own name.
        static PROCESS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let me = PROCESS.get_or_init(rand::random::<u64>);
        let prefix = format!("{}/spill/{me:016x}", storage.prefix);
        let tier = Tier::new(client, prefix, tier_runtime()?);
        self.store.set_tier(shuffle, Arc::new(tier))
    }

    /// The store client `shuffle` writes its map outputs with, if durable.
    pub(crate) fn durable_storage(&self, shuffle: ShuffleId) -> Option<Arc<Storage>> {
        lock(&self.durable).get(&shuffle).map(|(s, _)| s.clone())
    }

    /// Whether `shuffle` is durable.
    pub(crate) fn is_durable(&self, shuffle: ShuffleId) -> bool {
        lock(&self.durable).contains_key(&shuffle)
    }

    /// Forget a dropped shuffle's store (its client stays for other shuffles).
    pub(crate) fn forget_durable(&self, shuffle: ShuffleId) {
        lock(&self.durable).remove(&shuffle);
    }

    /// Write the blocks of one map attempt as one object of a durable shuffle: `held` here
    /// (worker slot `here`), and `sent` to other workers (with their bytes; each block's
    /// holder is recorded). None: `shuffle` is not durable; an
    /// empty record and no object: the map wrote no block.
    /// The object's name carries the map and the attempt, so two attempts of a map never
    /// write the same object.
    pub(crate) async fn write_object(
        &self,
        shuffle: ShuffleId,
        map: u32,
        attempt: u32,
        here: u32,
        held: &[BlockMeta],
        sent: &[(u32, BlockMeta, bytes::Bytes)],
    ) -> Result<Option<proto::StoredObject>> {
        let Some((storage, prefix)) = lock(&self.durable).get(&shuffle).cloned() else {
            return Ok(None);
        };
        if held.is_empty() && sent.is_empty() {
            // Nothing held here (no rows, or all pushed elsewhere): no object, and a record
            // that says so (a lost worker that held nothing loses nothing).
            return Ok(Some(proto::StoredObject::default()));
        }
        let mut ordered: Vec<(BlockMeta, u32, Option<&bytes::Bytes>)> = held
            .iter()
            .map(|m| (*m, here, None))
            .chain(sent.iter().map(|(to, m, d)| (*m, *to, Some(d))))
            .collect();
        ordered.sort_by_key(|(m, _, _)| (m.id.partition, m.id.seq));
        let mut w = ObjectWriter::new(&storage, format!("{prefix}/{map}-{attempt}.fsobj"));
        for (meta, holder, data) in &ordered {
            let pushed = match data {
                Some(d) => w.push(meta, *holder, d).await,
                None => match tokio::task::block_in_place(|| self.store.get_raw(&meta.id)) {
                    Ok((_, d)) => w.push(meta, *holder, &d).await,
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = pushed {
                w.abort().await;
                return Err(e);
            }
        }
        w.finish().await.map(Some)
    }

    /// The second level of a two-level exchange through the store: the blocks of one range
    /// of partitions of a group of map objects written as one object, named by its group,
    /// column and attempt ([`crate::direct::combine`]).
    pub(crate) async fn combine_objects(
        &self,
        task: proto::CombineTask,
    ) -> Result<proto::StoredObject> {
        let shuffle = ShuffleId(task.shuffle_id);
        let info = self.store.shuffle_info(shuffle)?;
        let Some((storage, prefix)) = lock(&self.durable).get(&shuffle).cloned() else {
            return Err(crate::Error::invalid(format!(
                "shuffle {shuffle} has no store to combine objects in"
            )));
        };
        let parts = task.first_partition..task.end_partition;
        if parts.is_empty() || parts.end > info.partitions {
            return Err(crate::Error::invalid(format!(
                "combine of partitions {parts:?}: shuffle {shuffle} has {}",
                info.partitions
            )));
        }
        let mine = format!("{prefix}/");
        if let Some(o) = task.objects.iter().find(|o| !o.path.starts_with(&mine)) {
            return Err(crate::Error::invalid(format!(
                "combine of object {:?}: not an object of shuffle {shuffle}",
                o.path
            )));
        }
        let path = format!(
            "{prefix}/c{}-{}-{}.fsobj",
            task.group, task.column, task.attempt
        );
        crate::direct::combine(storage, task.objects, parts, path).await
    }

    /// Requests this worker made to object stores, over all its clients.
    pub fn storage_stats(&self) -> proto::StorageStats {
        let mut total = proto::StorageStats::default();
        for (_, s) in lock(&self.storages)
            .iter()
            .chain(lock(&self.tier_storages).iter())
        {
            add_stats(&mut total, &s.stats());
        }
        total
    }
}

/// The client in `clients` of the store `storage` names, opened and added if it is new.
fn client_of(clients: &Mutex<Clients>, storage: &proto::Storage) -> Result<Arc<Storage>> {
    let cfg = StorageConfig::from_proto(storage)?;
    let mut clients = lock(clients);
    if let Some((_, s)) = clients.iter().find(|(c, _)| *c == cfg) {
        return Ok(s.clone());
    }
    let s = Arc::new(Storage::open(&cfg)?);
    clients.push((cfg, s.clone()));
    Ok(s)
}

/// The runtime every tier of this process runs its requests on: one thread of its own, so a
/// block store caller waiting for a tiered read never blocks the requests it waits for.
fn tier_runtime() -> Result<tokio::runtime::Handle> {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Handle> = std::sync::OnceLock::new();
    if let Some(h) = RUNTIME.get() {
        return Ok(h.clone());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("flightshuffle-tier")
        .enable_all()
        .build()
        .map_err(|e| crate::error::Error::Cluster(format!("tier runtime: {e}")))?;
    let handle = RUNTIME.get_or_init(|| rt.handle().clone()).clone();
    // It lives as long as the process (a runtime cannot be dropped from async code).
    std::mem::forget(rt);
    Ok(handle)
}
