//! One round of a streaming shuffle: what a job is ([`StreamingJob`]), what a round folds and
//! returns ([`Partial`]), and the fold itself, partition by partition on their owners. Shared
//! by fixed rounds, rounds by completion and their recovery.

use crate::driver::{Driver, MapDone, MapInput, ShuffleSpec};
use crate::error::{Error, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use std::sync::Arc;
use std::time::Instant;

/// A streaming shuffle to run.
pub struct StreamingJob {
    /// The shuffle the map tasks write.
    pub spec: ShuffleSpec,
    /// Map inputs in the order they are read (callers randomise it for online aggregation).
    pub inputs: Vec<MapInput>,
    /// Size of each input (e.g. rows), for progress; empty = every input weighs 1.
    pub weights: Vec<u64>,
    /// The sizes of the sampling units each input reads (online aggregation; see
    /// [`Partial::units_done`]); empty = each input is one unit of its weight.
    pub unit_sizes: Vec<Vec<u64>>,
    /// Number of rounds (clamped to 1..=inputs; by completion, after the early first one).
    pub rounds: usize,
    /// Rounds by completion rather than fixed rounds (see the module doc).
    pub by_completion: bool,
    /// Reducer kind registered on the workers and its description.
    pub reducer: String,
    /// The reducer's description, sent with every fold.
    pub payload: Vec<u8>,
}

/// The partial result after one round.
#[derive(Debug, Clone)]
pub struct Partial {
    /// 0-based round whose blocks were folded last.
    pub round: usize,
    /// Rounds of the job.
    pub rounds: usize,
    /// Share of the input weight folded into the states (0..=1).
    pub progress: f64,
    /// Map tasks finished when this partial was sent, of `maps_total`.
    pub maps_done: usize,
    /// Map tasks of the job.
    pub maps_total: usize,
    /// Sampling units folded so far (one per input unless the job says otherwise).
    pub units_done: u64,
    /// Sum of the squared sizes of the units folded so far (with `progress` and
    /// `units_done`, what a variance between units of unequal size needs).
    pub weight_squares: f64,
    /// Whether this is the last partial (every input folded).
    pub is_final: bool,
    /// The schema of the partial results.
    pub schema: SchemaRef,
    /// Each reduce partition's partial result, in partition order.
    pub partitions: Vec<Vec<RecordBatch>>,
    /// Rows folded in this round, over all partitions.
    pub rows_folded: u64,
    /// Seconds since the job started.
    pub elapsed: f64,
}

/// Split `n` inputs into `rounds` consecutive, nearly equal ranges.
pub fn round_ranges(n: usize, rounds: usize) -> Vec<std::ops::Range<usize>> {
    let k = rounds.clamp(1, n.max(1));
    (0..k).map(|r| r * n / k..(r + 1) * n / k).collect()
}

/// Each input's weight (1 each when the job gives none, or not one per input) and their sum.
pub(super) fn input_weights(given: &[u64], inputs: usize) -> (Vec<u64>, f64) {
    let weights = if given.len() == inputs {
        given.to_vec()
    } else {
        vec![1; inputs]
    };
    let total = weights.iter().sum::<u64>().max(1) as f64;
    (weights, total)
}

/// Sampling units: how many, and the sum of their squared sizes.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Units {
    pub(super) count: u64,
    pub(super) squares: f64,
}

impl Units {
    pub(super) fn add(&mut self, other: Units) {
        self.count += other.count;
        self.squares += other.squares;
    }
}

/// Each input's units: as the job gives them, else one unit of the input's weight.
pub(super) fn input_units(job: &StreamingJob, weights: &[u64]) -> Vec<Units> {
    let squares =
        |sizes: &mut dyn Iterator<Item = u64>| sizes.map(|w| (w as f64) * (w as f64)).sum();
    if job.unit_sizes.len() == weights.len() {
        job.unit_sizes
            .iter()
            .map(|u| Units {
                count: u.len() as u64,
                squares: squares(&mut u.iter().copied()),
            })
            .collect()
    } else {
        weights
            .iter()
            .map(|&w| Units {
                count: 1,
                squares: squares(&mut std::iter::once(w)),
            })
            .collect()
    }
}

pub(super) async fn join(h: tokio::task::JoinHandle<Result<()>>) -> Result<()> {
    h.await
        .map_err(|e| Error::Cluster(format!("fold round panicked: {e}")))?
}

pub(super) struct FoldSpec {
    pub(super) spec: ShuffleSpec,
    pub(super) reducer: String,
    pub(super) payload: Vec<u8>,
    pub(super) total_maps: usize,
}

pub(super) struct RoundInfo {
    pub(super) round: usize,
    /// Rounds in all (by completion: as expected when this round was cut).
    pub(super) rounds: usize,
    pub(super) is_final: bool,
    pub(super) maps_done: usize,
    pub(super) progress: f64,
    pub(super) units: Units,
    pub(super) start: Instant,
}

/// Fold one round's blocks: partition p on worker p mod N, all partitions at once.
pub(super) async fn fold_round(
    driver: &Arc<Driver>,
    f: &FoldSpec,
    round: &RoundInfo,
    maps: Vec<MapDone>,
) -> Result<Partial> {
    let folds = (0..f.spec.partitions)
        .map(|p| driver.fold_partition(f.spec.id, p, round.round, &maps, &f.reducer, &f.payload));
    let results = futures::future::try_join_all(folds).await?;
    let mut schema = None;
    let mut partitions = Vec::with_capacity(results.len());
    let mut rows_folded = 0;
    for (s, batches, r) in results {
        schema.get_or_insert(s);
        partitions.push(batches);
        rows_folded += r.rows_folded;
    }
    Ok(Partial {
        round: round.round,
        rounds: round.rounds,
        progress: round.progress,
        maps_done: round.maps_done,
        maps_total: f.total_maps,
        units_done: round.units.count,
        weight_squares: round.units.squares,
        is_final: round.is_final,
        schema: schema.unwrap_or_else(|| f.spec.schema.clone()),
        partitions,
        rows_folded,
        elapsed: round.start.elapsed().as_secs_f64(),
    })
}
