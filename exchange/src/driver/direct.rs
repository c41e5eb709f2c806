//! The driver's side of the exchange through the store ([`crate::direct`], strategy `store`):
//! it marks a shuffle read from its map objects, hands every worker the objects with the seal
//! (readers there fetch their partitions by range), and reads partitions the same way itself.

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
        self.with_shuffle(shuffle, |e| {
            let mut objects = Vec::new();
            let mut maps: Vec<(&u32, &super::Made)> = e.outputs.iter().collect();
            maps.sort_by_key(|(m, _)| **m);
            for (map, made) in maps {
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

    /// Partition `partition` of a sealed `shuffle` read through the store, from every map's
    /// object; None for a shuffle read from the workers.
    pub(super) fn read_from_store(
        &self,
        shuffle: ShuffleId,
        partition: u32,
        sealed: bool,
    ) -> Result<Option<BatchStream>> {
        if !sealed || !self.via_store(shuffle) {
            return Ok(None);
        }
        let store = self
            .store_of(shuffle)
            .ok_or_else(|| Error::Cluster(format!("shuffle {shuffle} lost its store")))?;
        let objects = self.objects_to_read(shuffle)?;
        let ranges = crate::direct::ranges_of(&store.storage, &objects, partition, Slice::WHOLE)?;
        Ok(Some(crate::direct::read(store.storage.clone(), ranges)))
    }
}
