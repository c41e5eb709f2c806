//! Two-level shuffle (Seer §3.2): the N workers sit on a grid of ⌈√N⌉ columns. The first
//! level is horizontal: a map task pushes each partition's blocks to the worker in its own row
//! and in the column of the partition's owner ([`super::Placement::Grid`]), which merges what
//! arrives in rounds as in [`super::merged`]. The second level is vertical: the reducer of a
//! partition reads from the workers of its column only. A map sends to at most ⌈√N⌉ workers
//! and a reducer reads from about √N, so requests grow as N√N rather than N² — the saving that
//! matters at hundreds of workers; on a few it costs a second hop for nothing (see `auto`).

use super::options::StrategyOptions;
use super::{merged, pull};
use crate::driver::Placement;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::Result;
use futures::Stream;
use std::sync::Arc;

/// The map side of a two-level shuffle: maps push within their row, holders merge in rounds,
/// then the seal; reducers read their column.
pub async fn map_side(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<pull::Mapped> {
    driver.place(spec.id, Placement::Grid);
    merged::map_side(driver, spec, inputs, opts).await
}

#[cfg(test)]
mod tests {
    use crate::driver::Placement;

    #[test]
    fn grid_holders_are_in_the_mappers_row_and_the_owners_column() {
        for n in 1..=17usize {
            let cols = (n as f64).sqrt().ceil() as usize;
            for mapper in 0..n {
                let mut targets = std::collections::BTreeSet::new();
                for p in 0..(3 * n as u32) {
                    let h = Placement::Grid.holder(mapper, p, n);
                    let owner = Placement::owner(p, n);
                    assert!(h < n);
                    // The reducer reads the holder.
                    assert!(Placement::Grid.readers(p, n).contains(&h), "n={n} p={p}");
                    assert!(
                        h / cols == mapper / cols
                            || h + cols == mapper / cols * cols + owner % cols
                    );
                    targets.insert(h);
                }
                // A map sends to at most one worker per column.
                assert!(targets.len() <= cols, "n={n} mapper={mapper}: {targets:?}");
            }
            for p in 0..(n as u32) {
                let readers = Placement::Grid.readers(p, n);
                assert!(readers.len() <= cols, "n={n}: {readers:?}");
                assert!(readers.contains(&Placement::owner(p, n)));
            }
        }
        assert_eq!(Placement::Owner.readers(5, 4), vec![1]);
        assert_eq!(Placement::Local.readers(5, 3), vec![0, 1, 2]);
    }
}
