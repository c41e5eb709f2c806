//! Rounds by completion (see the module doc of [`super`]): every map submitted at once, the
//! next k to commit folded as a round.

use super::{fold_round, input_weights, FoldSpec, Partial, RoundInfo, StreamingJob};
use crate::driver::{Driver, MapDone};
use crate::error::{Error, Result};
use crate::strategy::{pull, StrategyOptions};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// Rounds by completion (see the module doc). Every map runs once under the map runner,
/// which submits them all; its commits reach the fold loop as they happen. A lost worker fails
/// the job (its fold states and map outputs are not rebuilt on this path).
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
    let every = job.fold_every.clamp(1, total_maps);
    let (weights, total_weight) = input_weights(&job.weights, total_maps);
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
    let inputs = futures::stream::iter(job.inputs);
    let maps = async {
        pull::run_maps_observed(driver, &fold.spec, inputs, 0, opts, |d| {
            let _ = tx.send(d.clone());
        })
        .await
        .map(|_| ())
    };
    let folds = async {
        let mut seen = std::collections::HashSet::new();
        let (mut round, mut folded_weight) = (0usize, 0u64);
        // The first round is early: one map per worker (an estimate as soon as one can be made).
        let first = every.min(driver.num_workers().max(1));
        let rounds = 1 + (total_maps - first).div_ceil(every);
        while seen.len() < total_maps {
            // The next `every` maps to commit (the rest for the last round).
            let size = if round == 0 { first } else { every };
            let mut arrived: Vec<MapDone> = Vec::new();
            while arrived.len() < size.min(total_maps - seen.len() + arrived.len()) {
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
            let info = RoundInfo {
                round,
                rounds,
                is_final: seen.len() == total_maps,
                maps_done: seen.len(),
                progress: folded_weight as f64 / total_weight,
                start,
            };
            let partial = fold_round(driver, &fold, &info, arrived).await?;
            out.send(Ok(partial))
                .await
                .map_err(|_| Error::Cancelled("streaming result receiver closed".into()))?;
            round += 1;
        }
        Ok(())
    };
    futures::future::try_join(maps, folds).await.map(|_| ())
}
