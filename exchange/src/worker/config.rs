//! What a worker is made of ([`WorkerConfig`]): its name, budget, spill directory, segment size,
//! compression and timeout. A host builds one in code, or from a command line
//! ([`super::WorkerArgs::config`]); [`super::WorkerState::new`] makes the worker from it.

use crate::block::Compression;
use crate::store::DEFAULT_SEGMENT_BYTES;
use std::path::PathBuf;
use std::time::Duration;

/// The settings a worker's state is built from.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Worker name used in logs and errors.
    pub id: String,
    /// Memory budget in bytes: task grants and blocks held in memory share it; beyond it
    /// blocks spill to disk and tasks wait.
    pub memory_budget: u64,
    /// Directory for spill segment files.
    pub spill_dir: PathBuf,
    /// Size at which a spill segment file is closed.
    pub segment_bytes: u64,
    /// Bytes of spill files past which the closed segments of shuffles registered with a
    /// store move to it ([`crate::store::tier`]); None: no limit.
    pub disk_budget: Option<u64>,
    /// IPC compression of the blocks this worker's maps write.
    pub compression: Compression,
    /// How long a call or a wait for new blocks may take.
    pub timeout: Duration,
    /// Fault injection for tests: the replies of this many commits are lost after the commit
    /// took effect.
    pub lose_commit_replies: u32,
}

impl WorkerConfig {
    /// A worker named `id` spilling into `spill_dir`, with the defaults of the command line:
    /// a 2 GiB budget, 64 MiB segments, no compression, 600 s calls.
    pub fn new(id: impl Into<String>, spill_dir: impl Into<PathBuf>) -> Self {
        WorkerConfig {
            id: id.into(),
            memory_budget: 2 << 30,
            spill_dir: spill_dir.into(),
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            disk_budget: None,
            compression: Compression::None,
            timeout: Duration::from_secs(600),
            lose_commit_replies: 0,
        }
    }
}
