//! Strategies: small control-plane programs over the [`crate::driver`] API that decide which
//! task runs where and when. `pull` serves one-shot exchanges and `streaming` serves online
//! aggregation (it is driven through its own API, not chosen per exchange); the others are
//! named so a user asking for them gets a clear error rather than a silent fallback.
//!
//! A caller chooses a strategy and its knobs with one [`StrategyOptions`] value (parsed from the
//! user's string by [`StrategyOptions::named`]) and runs an exchange's map side through
//! [`map_side`], the one place that dispatches on the strategy.

pub mod merged;
pub mod pull;
pub mod speculation;
pub mod streaming;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Pull,
    Merged,
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Strategy::Pull => "pull",
            Strategy::Merged => "merged",
        })
    }
}

/// Strategies of the design that are not built yet.
pub const PLANNED: &[&str] = &["push", "two-level", "auto"];

/// Strategies a user can ask for by name.
pub const AVAILABLE: &[&str] = &["pull", "merged"];

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "pull" => Ok(Strategy::Pull),
            "merged" => Ok(Strategy::Merged),
            "streaming" => Err(Error::invalid(format!(
                "the streaming strategy runs online aggregation (Cluster.online / \
                 strategy::streaming::run), not single exchanges; available: {AVAILABLE:?}"
            ))),
            other if PLANNED.contains(&other) => Err(Error::invalid(format!(
                "strategy {other:?} is not implemented yet; available: {AVAILABLE:?}"
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
}

impl Default for StrategyOptions {
    fn default() -> Self {
        StrategyOptions {
            strategy: Strategy::Pull,
            maps_per_worker: 2,
            reduces_per_worker: 2,
            watch: true,
            merge_timeout: std::time::Duration::from_secs(10),
            speculation: None,
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
    match opts.strategy {
        Strategy::Pull => pull::map_side(driver, spec, inputs, opts).await,
        Strategy::Merged => merged::map_side(driver, spec, inputs, opts).await,
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
