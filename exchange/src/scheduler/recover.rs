//! Finishing a pipelined run after a lost worker, without starting it over.
//!
//! The pipelined pass stopped with some stages sealed, some half done, and committed map
//! outputs lost with the worker that held them. Working back from what the consumer reads, a
//! stage needs work if it is not sealed or lost outputs; a stage that needs none is left as
//! it is (its own producers are not needed at all: a stage whose maps all committed on live
//! workers never reads them again). The stages that need work are finished in dependency
//! order, each once the stages it reads are whole again:
//!
//! - blocks left where their maps ran (pull, merged, `auto` when it picked them): only the
//!   maps without a committed output run, the lost ones on their slot's replacement (the
//!   shuffle may be sealed on the others) and the unfinished ones spread over the workers;
//!   each map output that survived is kept;
//! - blocks pushed to every worker (push, two-level, or an `auto` stage that had not chosen
//!   yet): a lost worker held a piece of every map, so the stage runs again whole.
//!
//! Map outputs are committed once per map ([`Driver::uncommitted`] after
//! [`Driver::settle`]), so no row is read twice; the consumer then runs again from the start
//! of its (now whole, sealed) input. A stage with a map whose commit outcome is unknown runs
//! again whole. A round-robin stage ([`Driver::deals_by_position`]) that ran maps again may
//! deal its rows otherwise than the first time, so every stage reading it that needs work
//! runs again whole too (its surviving maps read the old deal), and so on downstream; a
//! hash-partitioned stage puts every row where it was, which stops the spread.

use super::stage::{report, Stage, StageReport};
use crate::block::ShuffleId;
use crate::driver::{Driver, REPLACE_TIMEOUT};
use crate::error::{Error, Result};
use crate::strategy::{self, pull::Mapped, Strategy, StrategyOptions};
use crate::sync::lock;
use futures::StreamExt;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Finish the stages `consumer_reads` needs (see the module doc).
pub(super) async fn finish(
    driver: &Arc<Driver>,
    stages: &[Stage],
    consumer_reads: &[ShuffleId],
    started: Instant,
    opts: StrategyOptions,
) -> Result<()> {
    driver.wait_all_live(REPLACE_TIMEOUT).await?;
    driver.settle().await;
    // Durable stages get their lost outputs back from the store: no map of theirs runs again.
    for s in stages {
        driver.restore_stored(s.spec.id).await?;
    }
    let work: HashMap<ShuffleId, bool> = stages
        .iter()
        .map(|s| {
            let id = s.spec.id;
            let todo = !s.sealed.load(Ordering::SeqCst)
                || !driver.lost_outputs(id).is_empty()
                || !driver.coded_losses(id).is_empty();
            (id, todo)
        })
        .collect();
    // Stages are in dependency order: walking back, a needed stage with work needs its inputs.
    let mut needed: HashSet<ShuffleId> = consumer_reads.iter().copied().collect();
    for s in stages.iter().rev() {
        if needed.contains(&s.spec.id) && work[&s.spec.id] {
            needed.extend(s.reads.iter().copied());
        }
    }
    // Round-robin stages that ran maps again: their readers cannot keep what they read.
    let mut redealt: HashSet<ShuffleId> = HashSet::new();
    for s in stages.iter().filter(|s| needed.contains(&s.spec.id)) {
        if !work[&s.spec.id] {
            // Whole: sealed on a replacement too (it holds nothing of it), for its readers.
            driver.seal(s.spec.id).await?;
            continue;
        }
        let start_s = started.elapsed().as_secs_f64();
        let stale = s.reads.iter().any(|r| redealt.contains(r));
        let (note, report, ran) =
            finish_stage(driver, stages, s, stale, start_s, started, opts).await?;
        if ran && driver.deals_by_position(s.spec.id) {
            redealt.insert(s.spec.id);
        }
        tracing::warn!(shuffle = %s.spec.id, "{note}");
        let mut r = report;
        r.strategy = format!("{}; {note}", r.strategy);
        *lock(&s.report) = Some(r);
        s.sealed.store(true, Ordering::SeqCst);
    }
    Ok(())
}

/// Run the maps `s` lacks and seal it (all of them again when `stale`: a stage it reads
/// dealt its rows anew); returns a note for its report, the report, and whether any map ran.
async fn finish_stage(
    driver: &Arc<Driver>,
    stages: &[Stage],
    s: &Stage,
    stale: bool,
    start_s: f64,
    started: Instant,
    opts: StrategyOptions,
) -> Result<(String, StageReport, bool)> {
    let id = s.spec.id;
    let addresses = driver.addresses();
    if lock(&s.inputs).is_none() {
        decide_now(driver, stages, s)?;
    }
    let inputs = s.inputs_now(&addresses).ok_or_else(|| {
        Error::Cluster(format!(
            "stage of shuffle {id} lost map outputs whose inputs cannot be read again"
        ))
    })?;
    let total = inputs.len();
    let in_place = !stale
        && !driver.has_uncertain_commits(id)
        && (driver.parity_of(id) > 0
            || (driver.places_locally(id)
                && (s.strategy != Strategy::Auto || s.sealed.load(Ordering::SeqCst))));
    if !in_place {
        // Every map left blocks on every worker: the stage runs again whole.
        driver.restart_shuffle(&s.spec).await?;
        let opts = StrategyOptions {
            strategy: s.strategy,
            ..opts
        };
        let mapped =
            strategy::map_side(driver, &s.spec, futures::stream::iter(inputs), opts).await?;
        let note = format!("after a lost worker all {total} maps ran again");
        let r = report(driver, &s.spec, s.strategy, &mapped, "", start_s, started);
        return Ok((note, r, true));
    }
    if driver.parity_of(id) > 0 {
        driver.rebuild(id).await?;
    }
    driver.register_replaced(id).await?;
    let lost = driver.lost_outputs(id);
    let maps: Vec<u32> = (0..total as u32).collect();
    driver.forget_outputs(id, &maps)?;
    let n = driver.num_workers();
    let runs: Vec<_> = driver
        .uncommitted(id, total as u32)?
        .into_iter()
        .filter_map(|m| {
            let input = inputs.get(m as usize)?.again()?;
            // A lost output on its slot's replacement: the shuffle may be sealed elsewhere.
            let slot = lost
                .iter()
                .find(|(l, _, _)| *l == m)
                .map_or(m as usize % n, |l| l.1);
            Some((m, slot, input))
        })
        .collect();
    let (recomputed, unfinished) = (
        runs.iter()
            .filter(|(m, _, _)| lost.iter().any(|l| l.0 == *m))
            .count(),
        runs.iter()
            .filter(|(m, _, _)| !lost.iter().any(|l| l.0 == *m))
            .count(),
    );
    let submits = runs
        .into_iter()
        .map(|(m, slot, input)| driver.submit_map(id, m, slot, input));
    let limit = 2 * n * opts.maps_per_worker.max(1);
    let results: Vec<_> = futures::stream::iter(submits)
        .buffer_unordered(limit)
        .collect()
        .await;
    let mut mapped = Mapped {
        maps: Vec::new(),
        input: Default::default(),
        input_bytes: 0,
        first_commit: None,
        merges: Vec::new(),
    };
    for r in results {
        let done = r.map_err(|e| Error::Cluster(format!("map task failed to run: {e}")))??;
        mapped.first_commit.get_or_insert(done.committed_at);
        mapped.maps.push(done);
    }
    driver.seal(id).await?;
    let note = format!(
        "after a lost worker {recomputed} lost map outputs ran again, {unfinished} unfinished \
         maps ran, {} of {total} kept",
        total - recomputed - unfinished
    );
    let (blocks, bytes, rows, per) = driver.recorded(id, s.spec.partitions);
    let mut r = lock(&s.report)
        .clone()
        .unwrap_or_else(|| report(driver, &s.spec, s.strategy, &mapped, "", start_s, started));
    let mut sorted = per.clone();
    sorted.sort_unstable();
    r.tasks = total;
    r.blocks = blocks;
    r.bytes = bytes;
    r.rows = rows;
    r.max_partition_bytes = sorted.last().copied().unwrap_or(0);
    r.median_partition_bytes = sorted.get(sorted.len() / 2).copied().unwrap_or(0);
    r.end_s = started.elapsed().as_secs_f64();
    Ok((note, r, recomputed + unfinished > 0))
}

/// Decide a deferred stage's inputs now, from the recorded sizes of the stage it waits for
/// (whole again by now: it comes first in dependency order).
fn decide_now(driver: &Driver, stages: &[Stage], s: &Stage) -> Result<()> {
    let Some(after) = s.after else {
        return Ok(());
    };
    let Some(decide) = lock(&s.decide).take() else {
        return Ok(());
    };
    let partitions = stages
        .iter()
        .find(|p| p.spec.id == after)
        .map_or(0, |p| p.spec.partitions);
    let (_, _, _, sizes) = driver.recorded(after, partitions);
    let (inputs, note) = decide(&sizes)?;
    s.keep(&inputs);
    *lock(&s.note) = note;
    Ok(())
}
