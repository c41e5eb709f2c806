//! Strategies: small control-plane programs over the [`crate::driver`] API that decide which
//! task runs where and when. `pull` serves one-shot exchanges and `streaming` serves online
//! aggregation (it is driven through its own API, not chosen per exchange); the others are
//! named so a user asking for them gets a clear error rather than a silent fallback.
//!
//! A caller chooses a strategy and its knobs with one [`StrategyOptions`] value (parsed from the
//! user's string by [`StrategyOptions::named`]) and runs an exchange's map side through
//! [`map_side`], the one place that dispatches on the strategy.

pub mod auto;
pub mod merged;
pub mod pull;
pub mod push;
pub mod speculation;
pub mod streaming;
pub mod two_level;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Pull,
    Merged,
    Push,
    TwoLevel,
    /// Chosen per exchange by a calibrated cost model ([`auto`]).
    Auto,
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Strategy::Pull => "pull",
            Strategy::Merged => "merged",
            Strategy::Push => "push",
            Strategy::TwoLevel => "two-level",
            Strategy::Auto => "auto",
        })
    }
}

/// Strategies a user can ask for by name.
pub const AVAILABLE: &[&str] = &["pull", "merged", "push", "two-level", "auto"];

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "pull" => Ok(Strategy::Pull),
            "merged" => Ok(Strategy::Merged),
            "push" => Ok(Strategy::Push),
            "two-level" => Ok(Strategy::TwoLevel),
            "auto" => Ok(Strategy::Auto),
            "streaming" => Err(Error::invalid(format!(
                "the streaming strategy runs online aggregation (Cluster.online / \
                 strategy::streaming::run), not single exchanges; available: {AVAILABLE:?}"
            ))),
            other => Err(Error::invalid(format!(
                "unknown strategy {other:?}; available: {AVAILABLE:?}"
            ))),
        }
    }
}

/// Which strategy runs an exchange, and the knobs strategies share.
#[derive(Debug, Clone, Copy)]
pub struct StrategyOptions {
    pub strategy: Strategy,
    /// Map tasks running at once on one worker.
    pub maps_per_worker: usize,
    /// Each worker runs one map at a time until one map per worker has committed: the first
    /// commits come as soon as a map alone takes, not at the pace of `maps_per_worker` maps
    /// sharing the worker's cores (`auto`'s first wave, which its choice waits for).
    pub first_wave_alone: bool,
    /// Reduce tasks running at once on one worker.
    pub reduces_per_worker: usize,
    /// Check worker health while waiting (off when the caller watches already).
    pub watch: bool,
    /// Merged strategy: how long merges may still run after the last map before readers read
    /// the unmerged blocks instead.
    pub merge_timeout: std::time::Duration,
    /// Speculative execution ([`speculation`]): copy a map slower than this many times the
    /// median of its finished peers to another worker. Off by default (as in Spark): on a
    /// busy machine a copy competes with the work it should speed up.
    pub speculation: Option<f64>,
    /// Readers start only after the seal (one-shot shuffles, datasets, benchmarks): strategies
    /// that merge (merged, push, two-level, and `auto` when it picks one of them) then have
    /// their maps write packed blocks ([`crate::packed`]), which every merge cuts by
    /// partition. Off where readers stream during the map side (pipelined SQL stages): merges
    /// are refused there, and readers would slice every packed block.
    pub pack: bool,
    /// The number of map tasks, where the caller can estimate it and its input stream
    /// cannot tell (a Python shuffle of a table: its bytes over the map size); `auto` uses it
    /// for M.
    pub expected_maps: Option<usize>,
    /// Readers start only after the seal, so a map whose worker was lost can run again in
    /// place while the map side runs ([`pull::run_maps`]): an attempt that failed with its
    /// worker, and a committed output lost with it, run again elsewhere. Off where readers
    /// stream during the map side (they may have read the lost output already).
    pub recover: bool,
    /// Parity shards per stripe (0-2, [`crate::parity`]): the map side runs with blocks at
    /// their partitions' owners and no merging, whatever `strategy` says (a stripe's shards
    /// must sit on distinct workers), and the maps encode parity so a lost worker's blocks
    /// are rebuilt rather than recomputed.
    pub parity: u32,
}

impl Default for StrategyOptions {
    fn default() -> Self {
        StrategyOptions {
            strategy: Strategy::Pull,
            maps_per_worker: 2,
            first_wave_alone: false,
            reduces_per_worker: 2,
            watch: true,
            merge_timeout: std::time::Duration::from_secs(10),
            speculation: None,
            pack: false,
            expected_maps: None,
            recover: false,
            parity: 0,
        }
    }
}

impl StrategyOptions {
    /// The default knobs with the strategy named `name` (an unknown or unbuilt one is an
    /// error that lists what is available).
    pub fn named(name: &str) -> Result<Self> {
        Ok(StrategyOptions {
            strategy: name.parse()?,
            ..Default::default()
        })
    }
}

/// Run the map side of `spec` with the strategy `opts` names: every input becomes a map task,
/// and the shuffle is sealed once all are committed.
pub async fn map_side(
    driver: &std::sync::Arc<crate::driver::Driver>,
    spec: &crate::driver::ShuffleSpec,
    inputs: impl futures::Stream<Item = crate::driver::MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<pull::Mapped> {
    if opts.parity > 0 {
        driver.protect(spec.id, opts.parity)?;
        driver.place(spec.id, Placement::Owner);
        driver.note_choice(
            spec.id,
            format!(
                "parity {}: blocks at their partitions' owners, not merged (forward coding), \
                 in place of {}",
                opts.parity, opts.strategy
            ),
        );
        return pull::map_side(driver, spec, inputs, opts).await;
    }
    match opts.strategy {
        Strategy::Pull => pull::map_side(driver, spec, inputs, opts).await,
        Strategy::Merged => merged::map_side(driver, spec, inputs, opts).await,
        Strategy::Push => push::map_side(driver, spec, inputs, opts).await,
        Strategy::TwoLevel => two_level::map_side(driver, spec, inputs, opts).await,
        Strategy::Auto => auto::map_side(driver, spec, inputs, opts).await,
    }
}

/// Where map tasks leave their blocks and, so, which workers a reducer reads. Partition p is
/// reduced on its owner, worker p mod N (where reducers run: [`pull::reduce_on_workers`],
/// and SQL stage partitions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Every block stays on the worker that ran its map (pull, merged): reducers read all N.
    #[default]
    Local,
    /// Blocks are pushed to their partition's owner (push): a reducer reads its own store.
    Owner,
    /// Workers on a ⌈√N⌉-column grid (two-level): a block goes to the worker in its map's
    /// row and its owner's column, so a map sends to at most √N workers and a reducer reads
    /// from the √N workers of its column.
    Grid,
}

impl Placement {
    pub fn owner(partition: u32, workers: usize) -> usize {
        partition as usize % workers.max(1)
    }

    fn columns(workers: usize) -> usize {
        (workers as f64).sqrt().ceil().max(1.0) as usize
    }

    /// The worker that holds `partition`'s blocks of a map that ran on `mapper`.
    pub fn holder(self, mapper: usize, partition: u32, workers: usize) -> usize {
        let owner = Self::owner(partition, workers);
        match self {
            Placement::Local => mapper,
            Placement::Owner => owner,
            Placement::Grid => {
                let cols = Self::columns(workers);
                let cell = mapper / cols * cols + owner % cols;
                // The last grid row may be short: past its end, use the same column of the
                // row above (row 0 is always full, as N >= ⌈√N⌉).
                if cell < workers {
                    cell
                } else {
                    cell - cols
                }
            }
        }
    }

    /// The workers that can hold blocks of `partition` (what its reducer reads).
    pub fn readers(self, partition: u32, workers: usize) -> Vec<usize> {
        let owner = Self::owner(partition, workers);
        match self {
            Placement::Local => (0..workers).collect(),
            Placement::Owner => vec![owner],
            Placement::Grid => {
                let cols = Self::columns(workers);
                (0..workers).filter(|w| w % cols == owner % cols).collect()
            }
        }
    }
}

/// Tasks spawned by a strategy that must not outlive it: aborted when this is dropped (the
/// strategy failed or its caller went away).
pub(crate) struct AbortOnDrop(pub Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

/// `inputs` in order, those from the `first`-th on only once `gate` reads true (or its sender
/// is gone). `auto` holds the maps after its first wave until it has chosen; online rounds by
/// completion hold the maps after their first wave until the first round is folded.
pub(crate) fn held_after<S>(
    inputs: S,
    first: usize,
    gate: tokio::sync::watch::Receiver<bool>,
) -> impl futures::Stream<Item = S::Item>
where
    S: futures::Stream,
{
    use futures::StreamExt;
    inputs.enumerate().then(move |(i, input)| {
        let mut gate = gate.clone();
        async move {
            if i >= first {
                // A closed gate (its sender dropped) lets every input through.
                let _ = gate.wait_for(|open| *open).await;
            }
            input
        }
    })
}

#[cfg(test)]
mod tests {
    use super::held_after;
    use futures::{FutureExt, StreamExt};

    #[tokio::test]
    async fn the_inputs_after_the_first_wait_for_the_gate() {
        let (open, gate) = tokio::sync::watch::channel(false);
        let mut held = Box::pin(held_after(futures::stream::iter(0..5u8), 2, gate));
        for want in 0..2 {
            assert_eq!(held.next().now_or_never(), Some(Some(want)));
        }
        assert!(held.next().now_or_never().is_none(), "the third waits");
        open.send(true).unwrap();
        assert_eq!(held.collect::<Vec<_>>().await, vec![2, 3, 4]);
        // A gate whose sender is gone holds nothing back.
        let (open, gate) = tokio::sync::watch::channel(false);
        drop(open);
        let all = held_after(futures::stream::iter(0..3u8), 1, gate);
        assert_eq!(all.collect::<Vec<_>>().now_or_never(), Some(vec![0, 1, 2]));
    }
}
