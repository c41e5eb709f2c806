//! The tier below local disk: a shuffle registered with a store ([`crate::storage`]) on a
//! worker with a disk budget has its coldest closed spill segments moved to the store when the
//! worker's segment files pass the budget, and their blocks read back by byte range
//! ([`super::segment::Segment`] switches its backing from the file to the object).
//!
//! The block store is synchronous (its callers run it on blocking threads), so a [`Tier`]
//! runs its requests on a runtime of its own and waits for them, under the store's request
//! deadline: a store that stops answering is an error naming the object, never a hang.

use crate::error::{Error, Result};
use crate::storage::{Storage, REQUEST_DEADLINE};
use bytes::Bytes;
use std::future::Future;
use std::sync::Arc;

/// One shuffle's place in a store for its spilled segments, and the runtime its requests run
/// on.
pub struct Tier {
    storage: Arc<Storage>,
    /// Where this shuffle's segments from this process go (under the shuffle's prefix, so
    /// the driver's drop and `flightshuffle storage sweep` find them too; one name per
    /// process, as every worker numbers its segment files alike).
    prefix: String,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tier")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl Tier {
    /// A tier in `storage` under `prefix`, whose requests run on `runtime` (one the block
    /// store's callers never block).
    pub fn new(storage: Arc<Storage>, prefix: String, runtime: tokio::runtime::Handle) -> Self {
        Tier {
            storage,
            prefix,
            runtime,
        }
    }

    /// The object a segment file named `file` moves to.
    pub fn object_of(&self, file: &str) -> String {
        format!("{}/{file}", self.prefix)
    }

    /// The full name of `object`, for messages.
    pub fn name(&self, object: &str) -> String {
        self.storage.name(object)
    }

    /// Run `fut` on the tier's runtime and wait for it (at most the request deadline).
    fn wait<T: Send + 'static>(
        &self,
        object: &str,
        fut: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.runtime.spawn(async move {
            let _ = tx.send(fut.await);
        });
        match rx.recv_timeout(REQUEST_DEADLINE) {
            Ok(r) => r,
            Err(_) => Err(Error::Storage {
                object: self.name(object),
                reason: format!("no answer within {} s", REQUEST_DEADLINE.as_secs()),
            }),
        }
    }

    /// Write `data` (a closed segment file's bytes) as `object`.
    pub fn upload(&self, object: &str, data: Bytes) -> Result<()> {
        let (s, o) = (self.storage.clone(), object.to_string());
        self.wait(object, async move { s.put(&o, data).await })
    }

    /// Read `len` bytes of `object` from `offset`.
    pub fn read(&self, object: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        let end = offset.checked_add(len).ok_or_else(|| Error::Storage {
            object: self.name(object),
            reason: format!("range {offset}+{len} overflows"),
        })?;
        let (s, o) = (self.storage.clone(), object.to_string());
        let mut got = self.wait(object, async move {
            s.get_ranges(&o, std::slice::from_ref(&(offset..end))).await
        })?;
        match got.pop() {
            Some(b) if b.len() as u64 == len => Ok(b.to_vec()),
            _ => Err(Error::Storage {
                object: self.name(object),
                reason: format!("range {offset}..{end} came back short"),
            }),
        }
    }

    /// Delete `object` without waiting (a dropped shuffle's; the driver's drop and the sweep
    /// remove what a failed delete leaves).
    pub fn delete_later(&self, object: &str) {
        let (s, o) = (self.storage.clone(), object.to_string());
        self.runtime.spawn(async move {
            if let Err(e) = s.delete(&o).await {
                tracing::debug!("tiered segment not deleted: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockId, ShuffleId};
    use crate::store::{BlockStore, ShuffleInfo, StoreConfig};
    use arrow::datatypes::{DataType, Field, Schema};

    fn files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                match e.path() {
                    p if p.is_dir() => todo.push(p),
                    p => out.push(p),
                }
            }
        }
        out
    }

    fn info(id: u64) -> ShuffleInfo {
        ShuffleInfo {
            id: ShuffleId(id),
            schema: Arc::new(Schema::new(vec![Field::new("a", DataType::Int32, false)])),
            partitions: 2,
            partitioner: crate::partitioner::round_robin(),
            combiner: None,
            order: 0,
            group: 0,
        }
    }

    /// Past the disk budget closed segments move to the store, oldest first; every block reads
    /// back exact from its object, a corrupted object is caught by the block's CRC32C, a
    /// shuffle without a tier keeps its files, and dropping the shuffle deletes its objects.
    #[test]
    fn segments_past_the_disk_budget_move_to_the_store_and_read_back_by_range() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (spill, objects) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let cfg =
            crate::storage::StorageConfig::new(format!("file://{}", objects.path().display()), [])
                .unwrap();
        let storage = Arc::new(Storage::open(&cfg).unwrap());
        let s = BlockStore::new(StoreConfig {
            memory_budget: 0,
            spill_dir: spill.path().to_path_buf(),
            segment_bytes: 1000,
            disk_budget: Some(1500),
        })
        .unwrap();
        s.create_shuffle(info(1)).unwrap();
        s.create_shuffle(info(2)).unwrap();
        let tier = Arc::new(Tier::new(
            storage.clone(),
            "run/1/spill/a".into(),
            rt.handle().clone(),
        ));
        s.set_tier(ShuffleId(1), tier).unwrap();
        let id = |shuffle: u64, map: u32| BlockId {
            shuffle: ShuffleId(shuffle),
            map,
            partition: map % 2,
            attempt: 0,
            seq: 0,
        };
        let data = |map: u32| bytes::Bytes::from(vec![map as u8; 400]);
        // Shuffle 2 (no tier) first: its two closed segments are the oldest, and stay.
        for map in 0..6 {
            s.put(id(2, map), 1, data(map)).unwrap();
            s.commit(ShuffleId(2), map, 0, Some(1)).unwrap();
        }
        for map in 0..30 {
            s.put(id(1, map), 1, data(map)).unwrap();
            s.commit(ShuffleId(1), map, 0, Some(1)).unwrap();
        }
        s.seal(ShuffleId(1)).unwrap();
        let m = s.metrics();
        assert!(m.tiered_segments >= 8, "{m:?}");
        assert_eq!(m.tiered_bytes, m.tiered_segments * 1200, "{m:?}");
        // What is left on disk: shuffle 2's segments, over the budget alone.
        assert_eq!(m.disk_bytes, 6 * 400, "{m:?}");
        let local: Vec<_> = files(spill.path());
        assert!(local.iter().all(|p| p
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&ShuffleId(2).to_string())));
        let stored = files(objects.path());
        assert_eq!(stored.len() as u64, m.tiered_segments, "{stored:?}");
        for map in 0..30 {
            assert_eq!(s.get(&id(1, map)).unwrap(), data(map), "block {map}");
        }
        assert!(storage.stats().gets >= 30);
        // A flipped byte in an object: the read fails on the block's CRC32C.
        let first = stored.iter().min().unwrap();
        let mut bytes = std::fs::read(first).unwrap();
        bytes[10] ^= 0xff;
        std::fs::write(first, bytes).unwrap();
        let bad = (0..30).filter(|m| s.get(&id(1, *m)).is_err()).count();
        assert_eq!(bad, 1);
        s.drop_shuffle(ShuffleId(1)).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !files(objects.path()).is_empty() {
            assert!(std::time::Instant::now() < deadline, "objects not deleted");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(s.metrics().disk_bytes, 6 * 400);
        s.drop_shuffle(ShuffleId(2)).unwrap();
        assert_eq!(s.metrics().disk_bytes, 0);
    }
}
