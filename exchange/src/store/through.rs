//! A shuffle's ties to an object store, as its block store keeps them: the tier its closed
//! spill segments move to ([`super::tier`]), and, exchanged through the store
//! ([`crate::direct`]), the map objects its readers read once it is sealed.

use super::tier::Tier;
use super::BlockStore;
use crate::block::ShuffleId;
use crate::error::{Error, Result};
use crate::proto;
use crate::storage::Storage;
use crate::sync::lock;
use std::sync::Arc;

/// The store and the map objects a shuffle is read from.
pub type ReadThrough = (Arc<Storage>, Arc<[proto::StoredObject]>);

impl BlockStore {
    /// Let `shuffle`'s closed spill segments move to `tier` past the disk budget.
    pub fn set_tier(&self, shuffle: ShuffleId, tier: Arc<Tier>) -> Result<()> {
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        sh.tier = Some(tier);
        Ok(())
    }

    /// Read `shuffle` from its map `objects` through `storage` from now on (it is sealed).
    pub fn read_through(
        &self,
        shuffle: ShuffleId,
        storage: Arc<Storage>,
        objects: Arc<[proto::StoredObject]>,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        sh.objects = Some((storage, objects));
        Ok(())
    }

    /// Whether readers of `shuffle` read it through the store.
    pub fn reads_through(&self, shuffle: ShuffleId) -> bool {
        lock(&self.state)
            .get(&shuffle)
            .is_some_and(|sh| sh.reads_through || sh.objects.is_some())
    }

    /// Make readers of `shuffle` wait for its seal and read its map objects.
    pub fn expect_read_through(&self, shuffle: ShuffleId) -> Result<()> {
        let mut st = lock(&self.state);
        let sh = st.get_mut(&shuffle).ok_or(Error::UnknownShuffle(shuffle))?;
        sh.reads_through = true;
        Ok(())
    }

    /// The store and map objects `shuffle` is read from, once sealed, if it is exchanged
    /// through one: None at once for any other shuffle; for one exchanged through a store,
    /// after waiting (at most `timeout`) for its seal.
    pub async fn wait_read_through(
        &self,
        shuffle: ShuffleId,
        timeout: std::time::Duration,
    ) -> Result<Option<ReadThrough>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut rx = {
                let st = lock(&self.state);
                let Some(sh) = st.get(&shuffle) else {
                    return Ok(None);
                };
                if let Some(o) = &sh.objects {
                    return Ok(Some(o.clone()));
                }
                if !sh.reads_through {
                    return Ok(None);
                }
                if sh.sealed {
                    return Err(Error::Cluster(format!(
                        "shuffle {shuffle} was sealed without the objects to read it through"
                    )));
                }
                sh.version.subscribe()
            };
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return Err(Error::Timeout {
                    what: format!("shuffle {shuffle} to be sealed (read through the store)"),
                    seconds: timeout.as_secs_f64(),
                });
            }
        }
    }

    /// Whether `shuffle`'s segments may move to a tier (their blocks then read by request).
    pub fn has_tier(&self, shuffle: ShuffleId) -> bool {
        lock(&self.state)
            .get(&shuffle)
            .is_some_and(|sh| sh.tier.is_some())
    }
}
