//! Strategies: small control-plane programs over the [`crate::driver`] API that decide which
//! task runs where and when. `pull` serves one-shot exchanges and `streaming` serves online
//! aggregation (it is driven through its own API, not chosen per exchange); the others are
//! named so a user asking for them gets a clear error rather than a silent fallback.
//!
//! A caller chooses a strategy and its knobs with one [`StrategyOptions`] value (parsed from the
//! user's string by [`StrategyOptions::named`]) and runs an exchange's map side through
//! [`map_side`], the one place that dispatches on the strategy.

pub mod auto;
pub mod maps;
pub mod merged;
pub mod options;
pub mod pull;
pub mod push;
pub mod speculation;
pub mod store;
pub mod streaming;
pub mod two_level;

pub use crate::driver::Placement;
use crate::error::Result;
pub use options::{Strategy, StrategyOptions, AVAILABLE};

/// Run the map side of `spec` with the strategy `opts` names: every input becomes a map task,
/// and the shuffle is sealed once all are committed.
pub async fn map_side(
    driver: &std::sync::Arc<crate::driver::Driver>,
    spec: &crate::driver::ShuffleSpec,
    inputs: impl futures::Stream<Item = crate::driver::MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<pull::Mapped> {
    if matches!(opts.strategy, Strategy::Store | Strategy::StoreTwoLevel) {
        if opts.parity > 0 || !driver.is_durable(spec.id) {
            return Err(crate::error::Error::invalid(format!(
                "strategy \"{}\" exchanges through the object store: it needs the \
                 cluster's storage= (durable, the default) or SET flightshuffle.storage, and \
                 no parity",
                opts.strategy
            )));
        }
        return store::map_side(driver, spec, inputs, opts).await;
    }
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
        Strategy::Store | Strategy::StoreTwoLevel => unreachable!("handled above"),
    }
}
