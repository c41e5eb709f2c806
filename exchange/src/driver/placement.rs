//! Where a shuffle's map tasks leave their blocks ([`Placement`]): the driver records it per
//! shuffle and strategies choose it.

/// Where map tasks leave their blocks and, so, which workers a reducer reads. Partition p is
/// reduced on its owner, worker p mod N (where reducers run: [`crate::strategy::pull::reduce_on_workers`],
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
    /// The worker that owns (reduces) `partition`: `partition` mod `workers`.
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
