//! The pipelined stage scheduler: runs a DAG of stages (shuffles with their map inputs) and the
//! consumer that reads the last of them, all at once.
//!
//! Every shuffle is registered first, then every stage's map tasks start together with the
//! consumer. A stage that reads an earlier stage does not wait for it to finish: its readers
//! follow the producer's partitions and receive each map output as soon as the driver commits
//! it; a stage is sealed when all its maps are committed, which ends its readers' streams.
//! Blocks still land in the block store (spilling and re-reading work as for one stage).
//!
//! A stage may instead be *deferred* on a stage it reads ([`Deferred`]): it starts once that
//! stage is sealed, with map inputs chosen from its partition sizes (a skew split).
//!
//! No deadlock: every stage has its own task allowance (`maps_per_worker` per stage), so a
//! consumer's tasks that wait for a producer never hold a slot that producer needs, and a
//! waiting reader is an idle future on the worker, not a blocked thread. The price is that
//! up to (stages × `maps_per_worker`) tasks share a worker's cores at once.

use crate::block::ShuffleId;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::Result;
use crate::strategy::{self, Strategy, StrategyOptions};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;

/// One stage to run: the shuffle it writes, one input per map task, and the strategy of its
/// exchange.
pub struct StageRun {
    pub spec: ShuffleSpec,
    pub inputs: Vec<MapInput>,
    pub strategy: Strategy,
    /// Inputs decided late, from what an earlier stage wrote (see [`Deferred`]); replaces
    /// `inputs`.
    pub deferred: Option<Deferred>,
}

/// A stage whose map inputs depend on the partition sizes of a stage it reads (a skew split
/// of a hot partition): it starts once that stage is sealed, not pipelined with it.
pub struct Deferred {
    /// The shuffle whose sizes decide (a stage of the same run).
    pub after: ShuffleId,
    /// Gets the bytes of each of `after`'s partitions; returns the map inputs and a note for
    /// the stage's report (empty: nothing to say).
    pub decide: DecideInputs,
}

pub type DecideInputs = Box<dyn FnOnce(&[u64]) -> Result<(Vec<MapInput>, String)> + Send>;

/// How a stage went, with times in seconds since the query started.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StageReport {
    /// The strategy that ran the exchange (for `auto`: its pick and the predicted times).
    pub strategy: String,
    pub tasks: usize,
    pub rows: u64,
    pub bytes: u64,
    pub blocks: usize,
    pub spilled_bytes: u64,
    /// Bytes of its largest reduce partition, and of its median partition (skew).
    pub max_partition_bytes: u64,
    pub median_partition_bytes: u64,
    /// When its first map task was submitted.
    pub start_s: f64,
    /// When its first map output was committed (readers could start on it).
    pub first_commit_s: f64,
    /// When its last map output was committed and the shuffle sealed.
    pub end_s: f64,
}

/// Run `stages` and `consumer` concurrently under one health watch; returns the consumer's
/// output and a report per stage (in the order given). The caller drops the shuffles.
pub async fn run_pipelined<T>(
    driver: &Arc<Driver>,
    stages: Vec<StageRun>,
    consumer: impl Future<Output = Result<T>>,
    started: Instant,
    opts: StrategyOptions,
) -> Result<(T, Vec<StageReport>)> {
    let creates = stages.iter().map(|s| driver.create_shuffle(&s.spec));
    futures::future::try_join_all(creates).await?;
    let opts = StrategyOptions {
        watch: false,
        ..opts
    };
    // Each stage publishes its partition sizes once sealed, for the stages deferred on it.
    let sizes: HashMap<ShuffleId, watch::Sender<Option<Arc<Vec<u64>>>>> = stages
        .iter()
        .map(|s| (s.spec.id, watch::channel(None).0))
        .collect();
    for s in &stages {
        if let Some(d) = &s.deferred {
            if !sizes.contains_key(&d.after) {
                return Err(crate::Error::invalid(format!(
                    "stage of shuffle {} waits for shuffle {}, which is not in the run",
                    s.spec.id, d.after
                )));
            }
        }
    }
    let sizes = &sizes;
    let runs = stages.into_iter().map(|s| async move {
        let (inputs, note) = match s.deferred {
            None => (s.inputs, String::new()),
            Some(d) => {
                let mut rx = sizes[&d.after].subscribe();
                let bytes = rx
                    .wait_for(|b| b.is_some())
                    .await
                    .map_err(|_| crate::Error::Cluster("a producing stage ended".into()))?
                    .clone()
                    .unwrap_or_default();
                (d.decide)(&bytes)?
            }
        };
        let start_s = started.elapsed().as_secs_f64();
        let inputs = futures::stream::iter(inputs);
        let opts = StrategyOptions {
            strategy: s.strategy,
            ..opts
        };
        let mapped = strategy::map_side(driver, &s.spec, inputs, opts).await?;
        let secs = |t: Option<Instant>| t.map_or(0.0, |t| t.duration_since(started).as_secs_f64());
        let (max_partition_bytes, median_partition_bytes) =
            mapped.partition_bytes(s.spec.partitions);
        if let Some(tx) = sizes.get(&s.spec.id) {
            tx.send_replace(Some(Arc::new(
                mapped.bytes_per_partition(s.spec.partitions),
            )));
        }
        let mut strategy = driver
            .choice(s.spec.id)
            .unwrap_or_else(|| s.strategy.to_string());
        if !note.is_empty() {
            strategy = format!("{strategy}; {note}");
        }
        Ok::<_, crate::Error>(StageReport {
            strategy,
            max_partition_bytes,
            median_partition_bytes,
            tasks: mapped.maps.len(),
            rows: mapped.input.rows,
            bytes: mapped
                .maps
                .iter()
                .flat_map(|m| &m.blocks)
                .map(|b| b.meta.bytes)
                .sum(),
            blocks: mapped.maps.iter().map(|m| m.blocks.len()).sum(),
            spilled_bytes: mapped.maps.iter().map(|m| m.spilled_bytes).sum(),
            start_s,
            first_commit_s: secs(mapped.first_commit),
            end_s: started.elapsed().as_secs_f64(),
        })
    });
    let outcome = driver
        .watch(futures::future::try_join(
            consumer,
            futures::future::try_join_all(runs),
        ))
        .await;
    match outcome {
        Err(e) if !matches!(e, crate::Error::WorkerLost { .. }) => {
            // The consumer reads while stages run, so a lost worker may first show up as a
            // broken read there; name the lost worker as the cause when there is one.
            driver.check_health().await?;
            Err(e)
        }
        other => other,
    }
}
