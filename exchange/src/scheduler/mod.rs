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
//!
//! A lost worker does not make the run start over: the pipelined pass stops, and
//! [`recover`] finishes the stages the consumer still needs, one after the other, running
//! only the maps whose output is missing, then runs the consumer again.

use crate::block::ShuffleId;
use crate::driver::{Driver, MapInput};
use crate::error::Result;
use crate::strategy::{self, StrategyOptions};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::watch;

mod recover;
mod stage;

use crate::sync::lock;
pub(crate) use stage::{report, Stage};
pub use stage::{DecideInputs, Deferred, Refresh, StageReport, StageRun, MAX_RECOVERIES};

/// Run `stages` and the consumer concurrently under one health watch; returns the
/// consumer's output and a report per stage (in the order given). `consumer` makes the
/// consumer's future (again after a recovery); it reads the shuffles `consumer_reads`. The
/// caller drops the shuffles.
///
/// A worker lost while they run (the driver replacing lost workers) does not fail the run:
/// once its replacement is up, [`recover`] finishes the stages the consumer needs, running
/// only the missing maps, and the consumer runs again, at most [`MAX_RECOVERIES`] times.
pub async fn run_pipelined<T, F, Fut>(
    driver: &Arc<Driver>,
    stages: Vec<StageRun>,
    consumer_reads: &[ShuffleId],
    consumer: F,
    started: Instant,
    opts: StrategyOptions,
) -> Result<(T, Vec<StageReport>)>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    // A replacement from here on is a loss this run recovers from.
    let replacements = driver.replacements();
    let specs: Vec<_> = stages.iter().map(|s| s.spec.clone()).collect();
    driver.create_shuffles(&specs).await?;
    let opts = StrategyOptions {
        watch: false,
        ..opts
    };
    for s in &stages {
        if let Some(d) = &s.deferred {
            if !stages.iter().any(|p| p.spec.id == d.after) {
                return Err(crate::Error::invalid(format!(
                    "stage of shuffle {} waits for shuffle {}, which is not in the run",
                    s.spec.id, d.after
                )));
            }
        }
    }
    let mut given = Vec::new();
    let kept: Vec<Stage> = stages
        .into_iter()
        .map(|s| {
            let (after, decide) = match s.deferred {
                Some(d) => (Some(d.after), Some(d.decide)),
                None => (None, None),
            };
            let stage = Stage {
                spec: s.spec,
                strategy: s.strategy,
                reads: s.reads,
                refresh: s.refresh,
                after,
                decide: Mutex::new(decide),
                inputs: Mutex::new(None),
                note: Mutex::new(String::new()),
                sealed: AtomicBool::new(false),
                report: Mutex::new(None),
            };
            if after.is_none() {
                stage.keep(&s.inputs);
            }
            given.push(s.inputs);
            stage
        })
        .collect();
    let first = pipelined(driver, &kept, given, consumer(), started, opts).await;
    let mut err = match first {
        Ok(out) => return Ok((out, reports(&kept))),
        Err(e) => e,
    };
    for recoveries in 0..MAX_RECOVERIES {
        if !crate::job::worker_lost(driver, &err, replacements) {
            break;
        }
        tracing::warn!(error = %err, recoveries, "worker lost while stages ran: finishing the stages the query needs");
        let again = async {
            recover::finish(driver, &kept, consumer_reads, started, opts).await?;
            consumer().await
        };
        match driver.watch(again).await {
            Ok(out) => return Ok((out, reports(&kept))),
            Err(e) => err = e,
        }
    }
    Err(err)
}

fn reports(stages: &[Stage]) -> Vec<StageReport> {
    stages
        .iter()
        .map(|s| lock(&s.report).clone().unwrap_or_default())
        .collect()
}

/// The pipelined pass: every stage and the consumer at once.
async fn pipelined<T>(
    driver: &Arc<Driver>,
    stages: &[Stage],
    given: Vec<Vec<MapInput>>,
    consumer: impl Future<Output = Result<T>>,
    started: Instant,
    opts: StrategyOptions,
) -> Result<T> {
    // Each stage publishes its partition sizes once sealed, for the stages deferred on it.
    let sizes: HashMap<ShuffleId, watch::Sender<Option<Arc<Vec<u64>>>>> = stages
        .iter()
        .map(|s| (s.spec.id, watch::channel(None).0))
        .collect();
    let sizes = &sizes;
    let runs = stages.iter().zip(given).map(|(s, given)| async move {
        let inputs = match s.after {
            None => given,
            Some(after) => {
                let mut rx = sizes[&after].subscribe();
                let bytes = rx
                    .wait_for(|b| b.is_some())
                    .await
                    .map_err(|_| crate::Error::Cluster("a producing stage ended".into()))?
                    .clone()
                    .unwrap_or_default();
                let decide = lock(&s.decide).take().ok_or_else(|| {
                    crate::Error::Cluster(format!("stage of shuffle {} decided twice", s.spec.id))
                })?;
                let (inputs, note) = decide(&bytes)?;
                s.keep(&inputs);
                *lock(&s.note) = note;
                inputs
            }
        };
        // For the workers now: one may have been replaced since the inputs were made.
        let inputs: Vec<MapInput> = match &s.refresh {
            Some(f) => {
                let addresses = driver.addresses();
                inputs.into_iter().map(|i| f(i, &addresses)).collect()
            }
            None => inputs,
        };
        let start_s = started.elapsed().as_secs_f64();
        let opts = StrategyOptions {
            strategy: s.strategy,
            ..opts
        };
        let mapped =
            strategy::map_side(driver, &s.spec, futures::stream::iter(inputs), opts).await?;
        s.sealed.store(true, Ordering::SeqCst);
        if let Some(tx) = sizes.get(&s.spec.id) {
            tx.send_replace(Some(Arc::new(
                mapped.bytes_per_partition(s.spec.partitions),
            )));
        }
        let note = lock(&s.note).clone();
        *lock(&s.report) = Some(report(
            driver, &s.spec, s.strategy, &mapped, &note, start_s, started,
        ));
        Ok::<_, crate::Error>(())
    });
    let outcome = driver
        .watch(futures::future::try_join(
            consumer,
            futures::future::try_join_all(runs),
        ))
        .await;
    match outcome {
        Ok((out, _)) => Ok(out),
        Err(e) if !matches!(e, crate::Error::WorkerLost { .. }) => {
            // The consumer reads while stages run, so a lost worker may first show up as a
            // broken read there; name the lost worker as the cause when there is one.
            driver.check_health().await?;
            Err(e)
        }
        Err(e) => Err(e),
    }
}
