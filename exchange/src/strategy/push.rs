//! Push shuffle (Magnet; Exoshuffle §3.2.2, ES-push): every map task pushes each partition's
//! blocks, while it runs, to the worker that owns the partition (the one that reduces it,
//! [`super::Placement::Owner`]); the owner stores them (spilling past its budget) and merges
//! what has arrived into few large blocks per partition in rounds, as in [`super::merged`]. A
//! map gets ahead of a slow owner by at most [`crate::push::IN_FLIGHT`] blocks per owner (the
//! backpressure). Reducers then read their own store only: one local read per partition
//! instead of one request per worker, and the transfer overlaps the map side.

use super::options::StrategyOptions;
use super::{merged, pull};
use crate::driver::Placement;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::Result;
use futures::Stream;
use std::sync::Arc;

/// The map side of a push shuffle: maps push to owners, owners merge in rounds, then the seal.
pub async fn map_side(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<pull::Mapped> {
    driver.place(spec.id, Placement::Owner);
    merged::map_side(driver, spec, inputs, opts).await
}
