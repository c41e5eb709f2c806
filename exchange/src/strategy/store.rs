//! Exchanges through the object store (Seer §3): `store` (direct: readers read every map's
//! object by range, [`crate::direct`]) and `store-two-level` (maps' objects combined column
//! by column first, [`crate::driver::Driver::combine_in_store`]). Maps run as under
//! [`super::pull`], unpacked (a packed block holds several partitions and is not read by
//! range), and write their objects as every durable shuffle's maps do; the seal hands readers
//! the objects to read.

use super::options::{Strategy, StrategyOptions};
use super::pull;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::Result;
use futures::Stream;
use std::sync::Arc;

/// The map side of `spec` through the store (durable, checked by the caller): readers are
/// told to wait for the objects, the maps run, the second level runs for two-level, then the
/// seal.
pub async fn map_side(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<pull::Mapped> {
    driver.exchange_via_store(spec.id).await?;
    let opts = StrategyOptions {
        pack: false,
        ..opts
    };
    let mapped = pull::run_maps(driver, spec, inputs, 0, opts).await?;
    finish(driver, spec, opts.strategy, "", opts).await?;
    Ok(mapped)
}

/// Once every map committed: the second level when `strategy` is two-level, the choice noted
/// (after `why`, what led to it), and the seal.
pub async fn finish(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    strategy: Strategy,
    why: &str,
    opts: StrategyOptions,
) -> Result<()> {
    let note = match strategy {
        Strategy::StoreTwoLevel => {
            let grid = driver.combine_in_store(spec.id, &opts).await?;
            format!("{why}store-two-level: {grid}; readers read the combined objects by range")
        }
        _ => format!("{why}store: readers read every map's object by range"),
    };
    driver.note_choice(spec.id, note);
    pull::seal(driver, spec, opts).await
}
