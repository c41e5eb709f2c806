//! Fixed rounds after a lost worker: map outputs run again and fold states rebuilt on the
//! replacement by folding the earlier rounds again.

use super::round::{fold_round, FoldSpec, Partial, RoundInfo};
use crate::driver::{Driver, MapDone};
use crate::error::{Error, Result};
use std::sync::Arc;

/// Fold round `round.round` under the health watch. When a worker is lost (and replaced),
/// its map outputs of every round run again, the fold states it held are rebuilt on its
/// replacement by folding every earlier round again in order, and the round is folded again:
/// workers that folded it already return their state's partial as it is (folds carry their
/// round), so nothing is folded twice and the stream goes on.
pub(super) async fn fold_round_recovering(
    driver: &Arc<Driver>,
    f: &FoldSpec,
    round: RoundInfo,
    done: &tokio::sync::Mutex<Vec<Vec<MapDone>>>,
    states: &std::sync::Mutex<Vec<u64>>,
) -> Result<Partial> {
    let mut recoveries = 0;
    loop {
        if !needs_rebuild(driver, f, done, states).await {
            let maps = done
                .lock()
                .await
                .get(round.round)
                .cloned()
                .unwrap_or_default();
            match driver.watch(fold_round(driver, f, &round, maps)).await {
                Ok(p) => return Ok(p),
                Err(e)
                    if driver.replaces_workers()
                        && recoveries < crate::job::MAX_RECOVERIES
                        && (matches!(e, Error::WorkerLost { .. })
                            || needs_rebuild(driver, f, done, states).await) =>
                {
                    tracing::warn!(shuffle = %f.spec.id, round = round.round, error = %e, "worker lost while folding: recovering");
                }
                Err(e) => return Err(e),
            }
        }
        recoveries += 1;
        if recoveries > crate::job::MAX_RECOVERIES {
            return Err(Error::Cluster(format!(
                "streaming shuffle {} lost workers {recoveries} times",
                f.spec.id
            )));
        }
        rebuild(driver, f, round.round, done, states).await?;
    }
}

/// Whether a worker holding fold states, or map outputs of the rounds mapped so far, was lost
/// since (a round's outputs can be lost after its map side returned, before anyone noticed).
async fn needs_rebuild(
    driver: &Driver,
    f: &FoldSpec,
    done: &tokio::sync::Mutex<Vec<Vec<MapDone>>>,
    states: &std::sync::Mutex<Vec<u64>>,
) -> bool {
    let maps: Vec<u32> = done.lock().await.iter().flatten().map(|d| d.map).collect();
    !lost_slots(driver, states).is_empty() || driver.any_lost(f.spec.id, &maps)
}

/// Worker slots replaced since their fold states were built.
fn lost_slots(driver: &Driver, states: &std::sync::Mutex<Vec<u64>>) -> Vec<usize> {
    driver.replaced_since(&states.lock().unwrap_or_else(|p| p.into_inner()))
}

/// After a lost worker: rerun the map outputs it held (every round's) and rebuild the fold
/// states of its partitions on its replacement from rounds `0..upto`.
async fn rebuild(
    driver: &Arc<Driver>,
    f: &FoldSpec,
    upto: usize,
    done: &tokio::sync::Mutex<Vec<Vec<MapDone>>>,
    states: &std::sync::Mutex<Vec<u64>>,
) -> Result<()> {
    let mut done = done.lock().await;
    for round in done.iter_mut() {
        driver.rerun_lost(f.spec.id, round).await?;
    }
    let n = driver.num_workers();
    let lost = lost_slots(driver, states);
    let partitions: Vec<u32> = (0..f.spec.partitions)
        .filter(|p| lost.contains(&(*p as usize % n)))
        .collect();
    tracing::warn!(shuffle = %f.spec.id, ?lost, partitions = partitions.len(), rounds = upto, "rebuilding fold states lost with their worker");
    let refolds = partitions.into_iter().map(|p| {
        let done = &done;
        async move {
            for r in 0..upto {
                let maps = done.get(r).map_or(&[][..], |m| &m[..]);
                driver
                    .fold_partition(f.spec.id, p, r, maps, &f.reducer, &f.payload)
                    .await?;
            }
            Ok::<_, Error>(())
        }
    });
    futures::future::try_join_all(refolds).await?;
    let mut states = states.lock().unwrap_or_else(|p| p.into_inner());
    for w in lost {
        states[w] = driver.generation(w);
    }
    Ok(())
}
