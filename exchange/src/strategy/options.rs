//! What a caller asks of a strategy: which one ([`Strategy`], parsed from the user's string)
//! and its knobs ([`StrategyOptions`]). Shared by every strategy and the cost model.

use crate::error::{Error, Result};

/// How an exchange's map side moves its blocks (see [`crate::strategy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Maps keep their blocks; each reducer pulls its partition from every worker.
    Pull,
    /// As pull, with each worker merging the map outputs it holds into few large blocks.
    Merged,
    /// Maps push each partition's blocks to its owner, which merges them; reducers read locally.
    Push,
    /// Maps push to a worker in their grid row and the owner's column; reducers read that column.
    TwoLevel,
    /// Chosen per exchange by a calibrated cost model ([`auto`]).
    Auto,
    /// Through the object store (Seer's direct exchange, [`crate::direct`]): maps write one
    /// object each, reducers read their partition from every object by range.
    Store,
    /// Through the object store in two levels (Seer §3.2): maps write one object each, combine
    /// tasks gather each column of partitions of a group of maps into one object, reducers
    /// read their partition from the combined objects; about 2·p·√p requests, not p².
    StoreTwoLevel,
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Strategy::Pull => "pull",
            Strategy::Merged => "merged",
            Strategy::Push => "push",
            Strategy::TwoLevel => "two-level",
            Strategy::Auto => "auto",
            Strategy::Store => "store",
            Strategy::StoreTwoLevel => "store-two-level",
        })
    }
}

/// Strategies a user can ask for by name.
pub const AVAILABLE: &[&str] = &[
    "pull",
    "merged",
    "push",
    "two-level",
    "auto",
    "store",
    "store-two-level",
];

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "pull" => Ok(Strategy::Pull),
            "merged" => Ok(Strategy::Merged),
            "push" => Ok(Strategy::Push),
            "two-level" => Ok(Strategy::TwoLevel),
            "auto" => Ok(Strategy::Auto),
            "store" => Ok(Strategy::Store),
            "store-two-level" => Ok(Strategy::StoreTwoLevel),
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
    /// The strategy that runs the exchange.
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
