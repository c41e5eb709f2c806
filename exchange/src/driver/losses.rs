//! How many times a map side lets one map be lost (its output or a running attempt) before
//! it gives up.

use crate::block::ShuffleId;
use crate::error::{Error, Result};

/// Times one map side runs maps again after lost workers before it gives up.
pub(crate) const MAX_RERUNS: usize = 3;

/// Count one more loss of `map` (its output or a running attempt); an error once it has been
/// lost more than [`MAX_RERUNS`] times.
pub(crate) fn count_loss(
    lost: &mut std::collections::HashMap<u32, usize>,
    shuffle: ShuffleId,
    map: u32,
) -> Result<()> {
    let n = lost.entry(map).or_default();
    *n += 1;
    if *n > MAX_RERUNS {
        return Err(Error::Cluster(format!(
            "map {map} of shuffle {shuffle} lost its worker {n} times"
        )));
    }
    Ok(())
}
