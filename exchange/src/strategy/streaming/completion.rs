//! Rounds by completion (see the module doc of [`super`]): a first wave of one map per worker,
//! then, once the first round is folded, every other map; the maps folded in rounds as they
//! commit.

use super::round::{
    fold_round, input_units, input_weights, round_ranges, FoldSpec, Partial, RoundInfo,
    StreamingJob, Units,
};
use crate::driver::{Driver, MapDone};
use crate::error::{Error, Result};
use crate::strategy::options::StrategyOptions;
use crate::strategy::pull;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// Rounds by completion (see the module doc). Every map runs once under the map runner; its
/// commits reach the fold loop as they happen. A lost worker fails the job (its fold states
/// and map outputs are not rebuilt on this path).
pub(super) async fn completion_rounds(
    driver: &Arc<Driver>,
    job: StreamingJob,
    opts: StrategyOptions,
    out: mpsc::Sender<Result<Partial>>,
) -> Result<()> {
    let start = Instant::now();
    let total_maps = job.inputs.len();
    if total_maps == 0 {
        return Err(Error::invalid("a streaming job needs at least one input"));
    }
    let sizes = round_sizes(total_maps, driver.num_workers(), job.rounds);
    let (weights, total_weight) = input_weights(&job.weights, total_maps);
    let units = input_units(&job, &weights);
    let fold = FoldSpec {
        spec: job.spec.clone(),
        reducer: job.reducer,
        payload: job.payload,
        total_maps,
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<MapDone>();
    let opts = StrategyOptions {
        recover: false,
        watch: false,
        ..opts
    };
    // A first wave of one map per worker; the maps after it start once the first round (the
    // first of them to commit, at most one per worker) is folded: it then commits in the time
    // of one map alone, and its fold reads the blocks from every worker while they are idle,
    // not sharing their cores with the next maps.
    let (folded_first, first_folded) = tokio::sync::watch::channel(false);
    let first_wave = driver.num_workers().clamp(1, total_maps);
    let inputs = Box::pin(crate::strategy::maps::held_after(
        futures::stream::iter(job.inputs),
        first_wave,
        first_folded,
    ));
    let maps = async {
        pull::run_maps_observed(driver, &fold.spec, inputs, 0, opts, |d| {
            let _ = tx.send(d.clone());
        })
        .await
        .map(|_| ())
    };
    let folds = async {
        let mut seen = std::collections::HashSet::new();
        let (mut round, mut folded_weight, mut folded_units) = (0usize, 0u64, Units::default());
        let rounds = sizes.len();
        for size in sizes.iter().copied() {
            // The next `size` maps to commit.
            let mut arrived: Vec<MapDone> = Vec::new();
            while arrived.len() < size {
                match rx.recv().await {
                    Some(d) if seen.insert(d.map) => arrived.push(d),
                    Some(_) => {}
                    None => return Err(Error::Cluster("the map side ended early".into())),
                }
            }
            folded_weight += arrived
                .iter()
                .map(|d| weights.get(d.map as usize).copied().unwrap_or(0))
                .sum::<u64>();
            for d in &arrived {
                folded_units.add(units.get(d.map as usize).copied().unwrap_or_default());
            }
            let info = RoundInfo {
                round,
                rounds,
                is_final: seen.len() == total_maps,
                maps_done: seen.len(),
                progress: folded_weight as f64 / total_weight,
                units: folded_units,
                start,
            };
            let partial = fold_round(driver, &fold, &info, arrived).await?;
            let _ = folded_first.send(true);
            out.send(Ok(partial))
                .await
                .map_err(|_| Error::Cancelled("streaming result receiver closed".into()))?;
            round += 1;
        }
        Ok(())
    };
    futures::future::try_join(maps, folds).await.map(|_| ())
}

/// How many committed maps each round folds: first an early round of one map per worker (at
/// most a round's share), then the other maps cut evenly into `rounds` rounds (fewer when
/// there are fewer maps).
fn round_sizes(maps: usize, workers: usize, rounds: usize) -> Vec<usize> {
    let rounds = rounds.max(1);
    let first = maps.div_ceil(rounds).min(workers.max(1)).min(maps);
    let mut sizes = vec![first];
    sizes.extend(round_ranges(maps - first, rounds).iter().map(|r| r.len()));
    sizes.retain(|&s| s > 0);
    sizes
}

#[cfg(test)]
mod tests {
    use super::round_sizes;

    #[test]
    fn rounds_fold_every_map_once_early_first_then_even() {
        assert_eq!(round_sizes(12, 2, 2), vec![2, 5, 5]);
        // 24 splits in 10 rounds: the first early, the other 22 in 10 rounds of 2 or 3.
        let s = round_sizes(24, 2, 10);
        assert_eq!((s.len(), s[0]), (11, 2));
        assert!(s[1..].iter().all(|&n| n == 2 || n == 3), "{s:?}");
        for maps in 0..30 {
            for workers in 1..5 {
                for rounds in 0..12 {
                    let s = round_sizes(maps, workers, rounds);
                    assert_eq!(s.iter().sum::<usize>(), maps);
                    assert!(s.iter().all(|&n| n > 0));
                    assert!(s.len() <= rounds.max(1) + 1);
                    if maps > 0 {
                        assert!(s[0] <= workers);
                    }
                }
            }
        }
    }
}
