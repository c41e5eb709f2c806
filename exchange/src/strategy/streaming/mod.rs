//! Streaming shuffle (Exoshuffle §3.3.1): map tasks run in rounds; after each round every
//! reducer folds the round's new blocks into its running state (on the worker that owns the
//! partition) and returns a partial result, which the caller receives while the next round's
//! map tasks run. The last round's partial result is the exact, final result.
//!
//! Two ways to cut rounds:
//! * fixed rounds: the inputs are cut into `rounds` consecutive ranges; a round's maps all
//!   finish before the next round's start (its fold runs meanwhile);
//! * rounds by completion (`by_completion`): a first wave of one map per worker runs alone;
//!   the first round folds the first of them to commit (one per worker, at most a round's
//!   share), and then every other map is submitted (at most `maps_per_worker` running per
//!   worker). Maps are folded in commit order, so a slow map holds back no other map, only
//!   the fold that waits for it: the first estimate comes as early as it can; the maps after
//!   the first round are cut evenly into `rounds` more rounds.
//!
//! Only the driver API is used: `run_maps` per round, one `fold` per partition per round.

mod completion;
mod recover;
mod round;

use super::options::StrategyOptions;
use super::pull;
use crate::compute::AbortOnDrop;
use crate::driver::{Driver, MapDone, MapInput};
use crate::error::{Error, Result};
use completion::completion_rounds;
use recover::fold_round_recovering;
use round::{input_units, input_weights, join, FoldSpec, RoundInfo, Units};
pub use round::{round_ranges, Partial, StreamingJob};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// Run the job, sending one [`Partial`] per round to `out` (the last has `is_final`), or the
/// error that stopped it. The shuffle is dropped on every worker when the job ends.
pub async fn run(
    driver: &Arc<Driver>,
    job: StreamingJob,
    opts: StrategyOptions,
    out: mpsc::Sender<Result<Partial>>,
) {
    let id = job.spec.id;
    let by_completion = job.by_completion;
    let result = match driver.create_shuffle(&job.spec).await {
        Ok(()) if by_completion => {
            driver
                .watch(completion_rounds(driver, job, opts, out.clone()))
                .await
        }
        // With replacements, a lost worker is recovered from round by round (see `rounds`).
        Ok(()) if driver.replaces_workers() => rounds(driver, job, opts, out.clone()).await,
        Ok(()) => driver.watch(rounds(driver, job, opts, out.clone())).await,
        Err(e) => Err(e),
    };
    let _ = driver.drop_shuffle(id).await;
    if let Err(e) = result {
        let _ = out.send(Err(e)).await;
    }
}

async fn rounds(
    driver: &Arc<Driver>,
    job: StreamingJob,
    opts: StrategyOptions,
    out: mpsc::Sender<Result<Partial>>,
) -> Result<()> {
    let start = Instant::now();
    let total_maps = job.inputs.len();
    let (weights, total_weight) = input_weights(&job.weights, total_maps);
    let units = input_units(&job, &weights);
    let ranges = round_ranges(total_maps, job.rounds);
    let rounds = ranges.len();
    let fold = Arc::new(FoldSpec {
        spec: job.spec.clone(),
        reducer: job.reducer,
        payload: job.payload,
        total_maps,
    });
    let mut inputs = job.inputs.into_iter();
    let mut pending: Option<tokio::task::JoinHandle<Result<()>>> = None;
    // The round being folded stops with the job (a dropped job must not keep calling workers).
    let mut guard = AbortOnDrop(Vec::new());
    let mut maps_done = 0usize;
    let mut folded_weight = 0u64;
    let mut folded_units = Units::default();
    // Every round's committed maps (to fold again after a lost worker), and the generation
    // of each worker slot whose fold states are intact.
    let done = Arc::new(tokio::sync::Mutex::new(Vec::<Vec<MapDone>>::new()));
    let n = driver.num_workers();
    let states = Arc::new(std::sync::Mutex::new(
        (0..n).map(|w| driver.generation(w)).collect::<Vec<u64>>(),
    ));
    let opts = StrategyOptions {
        recover: driver.replaces_workers(),
        ..opts
    };
    for (r, range) in ranges.into_iter().enumerate() {
        let round_inputs: Vec<MapInput> = inputs.by_ref().take(range.len()).collect();
        let mapped = pull::run_maps(
            driver,
            &fold.spec,
            futures::stream::iter(round_inputs),
            range.start as u32,
            opts,
        )
        .await?;
        maps_done += mapped.maps.len();
        folded_weight += weights[range.clone()].iter().sum::<u64>();
        for u in &units[range.clone()] {
            folded_units.add(*u);
        }
        // One fold of a partition at a time: the previous round's folds finish first.
        if let Some(prev) = pending.take() {
            join(prev).await?;
        }
        done.lock().await.push(mapped.maps);
        let round = RoundInfo {
            round: r,
            rounds,
            is_final: r + 1 == rounds,
            maps_done,
            progress: folded_weight as f64 / total_weight,
            units: folded_units,
            start,
        };
        let (driver, fold, out) = (driver.clone(), fold.clone(), out.clone());
        let (done, states) = (done.clone(), states.clone());
        let task = tokio::spawn(async move {
            let partial = fold_round_recovering(&driver, &fold, round, &done, &states).await?;
            // A caller that stopped listening ends the job at the next round.
            out.send(Ok(partial))
                .await
                .map_err(|_| Error::Cancelled("streaming result receiver closed".into()))
        });
        guard.0 = vec![task.abort_handle()];
        pending = Some(task);
    }
    if let Some(prev) = pending.take() {
        join(prev).await?;
    }
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::round_ranges;

    #[test]
    fn rounds_cover_every_input_once() {
        for n in 0..40 {
            for k in 0..12 {
                let r = round_ranges(n, k);
                assert_eq!(r.len(), k.clamp(1, n.max(1)));
                let covered: Vec<usize> = r.into_iter().flatten().collect();
                assert_eq!(covered, (0..n).collect::<Vec<_>>());
            }
        }
    }
}
