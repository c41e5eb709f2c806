//! Registering shuffles on every worker: one at a time, or the shuffles of one job together
//! (numbered producers first and sharing a group, which the workers' admission uses: see
//! [`crate::admission`]).

use super::{Driver, ShuffleSpec, REPLACE_TIMEOUT};
use crate::block::encode_schema;
use crate::error::{Error, Result};
use crate::proto;
use std::sync::atomic::Ordering;

impl Driver {
    /// Register a shuffle on every worker (after waiting for a lost worker's replacement).
    pub async fn create_shuffle(&self, spec: &ShuffleSpec) -> Result<()> {
        // Taken before the first await: shuffles created one after the other are numbered in
        // the order they were asked for.
        let order = self.shuffle_order.fetch_add(1, Ordering::Relaxed) + 1;
        self.register(spec, order, 0).await
    }

    /// Register the shuffles of one job, producers before consumers (a query's stages): they
    /// are numbered in this order and share a group, so a worker admits a producer's task at
    /// once while a consumer of the same job holds a grant waiting on it.
    pub async fn create_shuffles(&self, specs: &[ShuffleSpec]) -> Result<()> {
        let n = specs.len() as u64;
        let first = self.shuffle_order.fetch_add(n, Ordering::Relaxed) + 1;
        let all = specs
            .iter()
            .zip(first..)
            .map(|(spec, order)| self.register(spec, order, first));
        futures::future::try_join_all(all).await.map(drop)
    }

    /// Register `spec` with its admission `order` and `group` (see [`crate::admission`]).
    pub(super) async fn register(&self, spec: &ShuffleSpec, order: u64, group: u64) -> Result<()> {
        self.wait_all_live(REPLACE_TIMEOUT).await?;
        // Refuse a partitioner that cannot work on this schema before any worker sees it.
        crate::partitioner::Partitioner::from_proto(
            &spec.partitioner,
            &spec.schema,
            spec.partitions,
            0,
        )?;
        let msg = proto::CreateShuffle {
            shuffle_id: spec.id.0,
            schema_ipc: encode_schema(&spec.schema)?.to_vec(),
            partitions: spec.partitions,
            partitioner: Some(spec.partitioner.clone()),
            combine: spec.combine.clone(),
            order,
            group,
            storage: self.storage_message(spec.id),
        };
        let generations = (0..self.num_workers())
            .map(|i| self.generation(i))
            .collect();
        self.update_shuffle(spec.id, |e| {
            e.schema = Some((spec.schema.clone(), spec.checksum_inputs));
            e.partitions = Some(spec.partitions);
            e.created = Some((msg.clone(), generations));
        });
        // A worker found lost here is replaced and the shuffle registered again (registering
        // is idempotent on the workers that have it).
        let mut tries = 0;
        loop {
            let created = self
                .on_all(|w| {
                    let msg = msg.clone();
                    async move { w.create_shuffle(&msg).await }
                })
                .await;
            match created {
                Err(Error::WorkerLost { .. }) if tries < 2 && self.replaces_workers() => {
                    tries += 1;
                    self.wait_all_live(REPLACE_TIMEOUT).await?;
                }
                other => return other,
            }
        }
    }
}
