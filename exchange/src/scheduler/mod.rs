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
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::Result;
use crate::strategy::{self, pull::Mapped, Strategy, StrategyOptions};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::watch;

mod recover;

/// Times a run recovers from lost workers before it gives up.
pub const MAX_RECOVERIES: usize = 2;

/// One stage to run: the shuffle it writes, one input per map task, and the strategy of its
/// exchange.
pub struct StageRun {
    pub spec: ShuffleSpec,
    pub inputs: Vec<MapInput>,
    pub strategy: Strategy,
    /// Inputs decided late, from what an earlier stage wrote (see [`Deferred`]); replaces
    /// `inputs`.
    pub deferred: Option<Deferred>,
    /// The shuffles (stages of the same run) its maps read: recovery finishes them first.
    pub reads: Vec<ShuffleId>,
    /// Rewrites a map input for the workers' addresses now (a lost worker's replacement has
    /// another); `None`: the inputs name no workers.
    pub refresh: Option<Refresh>,
}

/// A map input made anew for the given worker addresses.
pub type Refresh = Arc<dyn Fn(MapInput, &[String]) -> MapInput + Send + Sync>;

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

/// A stage as the run keeps it: what recovery needs to finish it after the pipelined pass.
struct Stage {
    spec: ShuffleSpec,
    strategy: Strategy,
    reads: Vec<ShuffleId>,
    refresh: Option<Refresh>,
    after: Option<ShuffleId>,
    /// Taken by whichever pass decides the deferred inputs first.
    decide: Mutex<Option<DecideInputs>>,
    /// Copies of its map inputs once known (`None` until decided, or if one cannot be
    /// read twice), and the note its decision left.
    inputs: Mutex<Option<Vec<MapInput>>>,
    note: Mutex<String>,
    /// Sealed by its map side (all its maps committed).
    sealed: AtomicBool,
    report: Mutex<Option<StageReport>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Stage {
    /// Keep copies of `inputs` for running maps again.
    fn keep(&self, inputs: &[MapInput]) {
        let copies: Option<Vec<MapInput>> = inputs.iter().map(MapInput::again).collect();
        *lock(&self.inputs) = copies;
    }

    /// Copies of its map inputs for the workers now.
    fn inputs_now(&self, addresses: &[String]) -> Option<Vec<MapInput>> {
        let kept = lock(&self.inputs);
        let copies = kept.as_ref()?.iter().filter_map(MapInput::again);
        Some(match &self.refresh {
            Some(f) => copies.map(|i| f(i, addresses)).collect(),
            None => copies.collect(),
        })
    }
}

/// A stage's report from what its map side returned.
fn report(
    driver: &Driver,
    spec: &ShuffleSpec,
    strategy: Strategy,
    mapped: &Mapped,
    note: &str,
    start_s: f64,
    started: Instant,
) -> StageReport {
    let secs = |t: Option<Instant>| t.map_or(0.0, |t| t.duration_since(started).as_secs_f64());
    let (max_partition_bytes, median_partition_bytes) = mapped.partition_bytes(spec.partitions);
    let mut strategy = driver
        .choice(spec.id)
        .unwrap_or_else(|| strategy.to_string());
    if !note.is_empty() {
        strategy = format!("{strategy}; {note}");
    }
    StageReport {
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
    }
}

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
