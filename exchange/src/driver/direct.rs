//! The driver's side of the exchange through the store ([`crate::direct`], strategy `store`):
//! it marks a shuffle read from its map objects, hands every worker the objects with the seal
//! (readers there fetch their partitions by range), and reads partitions the same way itself.
//! For the two-level exchange it also runs the second level ([`Driver::combine_in_store`]):
//! √M × √R combine tasks on the workers, whose objects readers then read instead.

use super::Driver;
use crate::block::{ShuffleId, Slice};
use crate::error::{Error, Result};
use crate::proto;
use crate::source::BatchStream;

impl Driver {
    /// Make readers of `shuffle` (registered, durable) read it from its map objects once it
    /// is sealed: on the workers too, where readers started before the seal wait for it.
    pub async fn exchange_via_store(&self, shuffle: ShuffleId) -> Result<()> {
        let msg = self.update_shuffle(shuffle, |e| {
            e.via_store = true;
            let (msg, _) = e.created.as_mut()?;
            msg.storage.as_mut()?.read_through = true;
            Some(msg.clone())
        });
        let Some(msg) = msg else {
            return Err(Error::invalid(format!(
                "shuffle {shuffle} is not registered with a store to exchange through"
            )));
        };
        let msg = &msg;
        self.on_all(|w| async move { w.create_shuffle(msg).await })
            .await
    }

    /// Whether readers of `shuffle` read it from its map objects.
    pub fn via_store(&self, shuffle: ShuffleId) -> bool {
        self.with_shuffle(shuffle, |e| e.via_store).unwrap_or(false)
    }

    /// The objects of every committed map of `shuffle` read through the store (empty for any
    /// other shuffle); a committed map without one is an error, never a partition short of
    /// its rows.
    pub(super) fn objects_to_read(&self, shuffle: ShuffleId) -> Result<Vec<proto::StoredObject>> {
        if !self.via_store(shuffle) {
            return Ok(vec![]);
        }
        self.map_objects(shuffle)
    }

    /// The objects that hold every committed map of `shuffle` (the second level's once
    /// written), whether or not it is read through the store; a committed map without one is
    /// an error naming it.
    pub(super) fn map_objects(&self, shuffle: ShuffleId) -> Result<Vec<proto::StoredObject>> {
        self.with_shuffle(shuffle, |e| {
            if let Some(c) = &e.combined {
                return Ok(c.clone());
            }
            let mut objects = Vec::new();
            let mut maps: Vec<(&u32, &super::Made)> = e.outputs.iter().collect();
            maps.sort_by_key(|(m, _)| **m);
            for (map, made) in maps {
                if matches!(made.lineage, super::Lineage::Merge(_)) {
                    continue; // its maps' objects hold its rows
                }
                match &made.object {
                    Some(o) if o.path.is_empty() => {} // it wrote no block
                    Some(o) => objects.push(o.clone()),
                    None => {
                        return Err(Error::Cluster(format!(
                            "map {map} of shuffle {shuffle} is exchanged through the store \
                             but committed no object"
                        )))
                    }
                }
            }
            Ok(objects)
        })
        .unwrap_or(Err(Error::UnknownShuffle(shuffle)))
    }

    /// The second level of the two-level exchange through the store (Seer §3.2) for
    /// `shuffle`, whose maps all committed: the map objects in ⌈√M⌉ groups, the partitions in
    /// ⌈√R⌉ columns, and one combine task per (group, column) on the live workers in turn,
    /// each reading its column from its group's objects (one ranged GET per object) and
    /// writing one object. Readers then read the combined objects. A task whose worker is
    /// lost runs again on another; any other failure fails the exchange. Returns a summary for
    /// `EXPLAIN ANALYZE`.
    pub async fn combine_in_store(
        self: &std::sync::Arc<Self>,
        shuffle: ShuffleId,
        opts: &crate::strategy::StrategyOptions,
    ) -> Result<String> {
        let objects: Vec<proto::StoredObject> = self
            .objects_to_read(shuffle)?
            .into_iter()
            .filter(|o| !o.path.is_empty())
            .collect();
        let partitions = self
            .with_shuffle(shuffle, |e| e.partitions)
            .flatten()
            .ok_or(Error::UnknownShuffle(shuffle))?;
        let (groups, columns) = grid(objects.len(), partitions);
        let per_group = objects.len().div_ceil(groups.max(1)).max(1);
        let width = partitions.div_ceil(columns.max(1)).max(1);
        let mut tasks = Vec::new();
        for (g, maps) in objects.chunks(per_group).enumerate() {
            for c in 0..columns {
                let first = c * width;
                let end = ((c + 1) * width).min(partitions);
                if first < end {
                    tasks.push(proto::CombineTask {
                        shuffle_id: shuffle.0,
                        group: g as u32,
                        column: c,
                        attempt: 0,
                        objects: maps.to_vec(),
                        first_partition: first,
                        end_partition: end,
                    });
                }
            }
        }
        let n = self.num_workers();
        let count = tasks.len();
        let runs = tasks
            .into_iter()
            .enumerate()
            .map(|(i, t)| self.run_combine(t, i % n.max(1)));
        let done: Vec<Result<proto::StoredObject>> =
            futures::StreamExt::collect(futures::StreamExt::buffered(
                futures::stream::iter(runs),
                n.max(1) * opts.maps_per_worker.max(1),
            ))
            .await;
        let mut combined = Vec::new();
        for d in done {
            let o = d?;
            if !o.path.is_empty() {
                combined.push(o);
            }
        }
        let written = combined.len();
        let gets: u64 = (0..columns)
            .map(|c| {
                let cols = c * width..((c + 1) * width).min(partitions);
                objects
                    .iter()
                    .filter(|o| partitions_of(o).any(|p| cols.contains(&p)))
                    .count() as u64
            })
            .sum();
        self.update_shuffle(shuffle, |e| {
            e.combined = Some(combined);
            e.combine_gets = gets;
        });
        Ok(format!(
            "{} map objects in {groups} groups x {columns} columns: {count} combine tasks wrote \
             {written} objects",
            objects.len()
        ))
    }

    /// Run one combine task on worker `first` or, when a worker is lost under it, on the next
    /// live one (a new attempt, so a new object name).
    async fn run_combine(
        &self,
        mut task: proto::CombineTask,
        first: usize,
    ) -> Result<proto::StoredObject> {
        let n = self.num_workers();
        let mut last = None;
        for i in 0..n + 1 {
            let w = (first + i) % n;
            if !self.is_alive(w) {
                continue;
            }
            let r = match self.worker(w) {
                Ok(client) => client.combine(&task).await,
                Err(e) => Err(e),
            };
            match r {
                Ok(o) => return Ok(o),
                Err(e) => match self.classify(e).await {
                    lost @ Error::WorkerLost { .. } => {
                        tracing::warn!(error = %lost, "combine task lost with its worker: again elsewhere");
                        task.attempt += 1;
                        last = Some(lost);
                    }
                    other => return Err(other),
                },
            }
        }
        Err(last.unwrap_or_else(|| Error::Cluster("no live worker to combine objects on".into())))
    }

    /// Ranged GETs reading `shuffle` through the store takes, from the manifest: one per
    /// object and partition it holds (a reader's blocks in one object are one coalesced
    /// range), plus the second level's for two-level; 0 for a shuffle read from the workers.
    pub fn store_reads(&self, shuffle: ShuffleId) -> u64 {
        let Ok(objects) = self.objects_to_read(shuffle) else {
            return 0;
        };
        let second = self.with_shuffle(shuffle, |e| e.combine_gets).unwrap_or(0);
        let reads: usize = objects
            .iter()
            .map(|o| {
                partitions_of(o)
                    .collect::<std::collections::BTreeSet<u32>>()
                    .len()
            })
            .sum();
        second + reads as u64
    }

    /// Partition `partition` of a sealed `shuffle` read through the store, from every map's
    /// object; None for a shuffle read from the workers.
    pub(super) fn read_from_store(
        &self,
        shuffle: ShuffleId,
        partition: u32,
        sealed: bool,
    ) -> Result<Option<BatchStream>> {
        // Sealed as the reader asked, or as the driver knows (a shuffle moved to the store
        // after its seal, see `retire_worker`: its blocks are not all on the workers).
        let sealed = sealed || self.with_shuffle(shuffle, |e| e.sealed).unwrap_or(false);
        if !sealed || !self.via_store(shuffle) {
            return Ok(None);
        }
        let store = self
            .store_of(shuffle)
            .ok_or_else(|| Error::Cluster(format!("shuffle {shuffle} lost its store")))?;
        let objects = self.objects_to_read(shuffle)?;
        let ranges = crate::direct::ranges_of(&store.storage, &objects, partition, Slice::WHOLE)?;
        Ok(Some(crate::direct::read(
            store.storage.clone(),
            ranges,
            partition,
        )))
    }
}

/// Seer's grid for `objects` map objects and `partitions` partitions: ⌈√M⌉ groups of maps by
/// ⌈√R⌉ columns of partitions (at least one of each).
pub(crate) fn grid(objects: usize, partitions: u32) -> (usize, u32) {
    let groups = (objects as f64).sqrt().ceil().max(1.0) as usize;
    let columns = (partitions as f64).sqrt().ceil().max(1.0) as u32;
    (groups, columns)
}

/// The partitions `object` holds blocks of.
fn partitions_of(object: &proto::StoredObject) -> impl Iterator<Item = u32> + '_ {
    object
        .blocks
        .iter()
        .filter_map(|b| b.key.as_ref().map(|k| k.partition))
}
