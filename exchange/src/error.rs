//! The crate's error type and its mapping to and from Flight (gRPC) statuses.

use crate::ids::{BlockId, ShuffleId};
use std::path::PathBuf;

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the exchange: data plane, driver, workers and transport.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An Arrow error (building, encoding or decoding batches).
    #[error("arrow error: {0}")]
    Arrow(#[from] arrow::error::ArrowError),

    /// An I/O error on a file or directory (a spill file, a certificate, a spill dir).
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file or directory the operation was on.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A block's bytes do not match the CRC32C taken when it was stored.
    #[error(
        "checksum mismatch for block {block}: stored crc32c {expected:#010x}, read {actual:#010x}"
    )]
    Checksum {
        /// The block that was read.
        block: BlockId,
        /// The CRC32C stored with the block.
        expected: u32,
        /// The CRC32C of the bytes read.
        actual: u32,
    },

    /// No shuffle of this id is registered here (never created, or dropped).
    #[error("unknown shuffle {0}")]
    UnknownShuffle(ShuffleId),

    /// No block of this id is held here.
    #[error("block {0} not found")]
    BlockNotFound(BlockId),

    /// A malformed or out-of-range request, message or setting.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Batches whose columns are not the shuffle's schema.
    #[error("schema mismatch for shuffle {shuffle}: expected {expected}, got {found}")]
    SchemaMismatch {
        /// The shuffle the batches were for.
        shuffle: ShuffleId,
        /// The shuffle's columns, as `[name: type, ...]`.
        expected: String,
        /// The batches' columns, as `[name: type, ...]`.
        found: String,
    },

    /// A worker is gone (failed health checks, or a call could not reach it).
    #[error("worker {worker} ({addr}) lost: {reason}; {lost_blocks} block(s) held there are lost")]
    WorkerLost {
        /// The lost worker's slot.
        worker: usize,
        /// The lost worker's address.
        addr: String,
        /// Why it was found lost.
        reason: String,
        /// Blocks held there and lost with it.
        lost_blocks: usize,
    },

    /// A worker answered a call with an error status.
    #[error("worker {worker} ({addr}) failed: {code:?}: {message}")]
    Remote {
        /// The worker's slot.
        worker: usize,
        /// The worker's address.
        addr: String,
        /// The gRPC status code it answered with.
        code: tonic::Code,
        /// The status message.
        message: String,
    },

    /// A call or a wait took longer than its deadline (`seconds`).
    #[error("timed out after {seconds:.1}s waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The deadline, in seconds.
        seconds: f64,
    },

    /// A partition read whole did not hold the rows the shuffle's manifest lists for it (a
    /// block lost, or read twice): recovered like a lost worker, never returned short.
    #[error(
        "shuffle {shuffle} partition {partition}: read {received} rows, its manifest lists \
         {expected}"
    )]
    RowCount {
        /// The shuffle read.
        shuffle: ShuffleId,
        /// The reduce partition read.
        partition: u32,
        /// Rows the manifest lists for the partition.
        expected: u64,
        /// Rows read.
        received: u64,
    },

    /// A failure of the cluster's machinery: starting workers, running or committing tasks.
    #[error("cluster error: {0}")]
    Cluster(String),

    /// A task's own work failed (its source, reducer or engine returned an error).
    #[error("task failed: {0}")]
    Task(String),

    /// A task or stream was cancelled, or its input broke off before its end.
    #[error("task cancelled: {0}")]
    Cancelled(String),

    /// A speculative or retried attempt finished after another attempt of the same map had
    /// committed; it was aborted and its blocks removed (not a failure of the shuffle).
    #[error("attempt {attempt} of map {map} was superseded by an attempt that committed first")]
    Superseded {
        /// The map task.
        map: u32,
        /// The superseded attempt.
        attempt: u32,
        /// The worker the superseded attempt ran on.
        worker: usize,
    },

    /// An attempt committed on some of the workers holding its blocks but not on all of them
    /// (push, two-level). No other attempt of the map may commit any more (it could duplicate
    /// rows), so the shuffle fails.
    #[error("map {map} attempt {attempt} committed on only some of its holders: {reason}")]
    PartialCommit {
        /// The map task (or merge group).
        map: u32,
        /// The attempt that committed on only some holders.
        attempt: u32,
        /// What went wrong with the commit.
        reason: String,
    },

    /// The object store (a durable shuffle's storage) failed or returned bad bytes.
    #[error("object store: {object}: {reason}")]
    Storage {
        /// The object (or the store's URL, without credentials) the request was about.
        object: String,
        /// What went wrong.
        reason: String,
    },

    /// The request conflicts with the shuffle's state (sealed, already committed).
    #[error("refused: {0}")]
    Precondition(String),
}

impl Error {
    /// An [`Error::Io`] on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// An [`Error::InvalidArgument`] with message `msg`.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// The gRPC status a worker answers with for this error.
    pub fn to_status(&self) -> tonic::Status {
        let msg = self.to_string();
        match self {
            Error::InvalidArgument(_) | Error::SchemaMismatch { .. } => {
                tonic::Status::invalid_argument(msg)
            }
            Error::UnknownShuffle(_) | Error::BlockNotFound(_) => tonic::Status::not_found(msg),
            Error::Checksum { .. } | Error::RowCount { .. } => tonic::Status::data_loss(msg),
            Error::Timeout { .. } => tonic::Status::deadline_exceeded(msg),
            Error::Cancelled(_) => tonic::Status::cancelled(msg),
            Error::Precondition(_) => tonic::Status::failed_precondition(msg),
            // A full disk or a spent quota (ENOSPC, EDQUOT): resources, not a bug.
            Error::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                ) =>
            {
                tonic::Status::resource_exhausted(msg)
            }
            Error::Remote { code, .. } => tonic::Status::new(*code, msg),
            _ => tonic::Status::internal(msg),
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        e.to_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk (ENOSPC) or a spent quota (EDQUOT) is `ResourceExhausted` for the caller, any
    /// other I/O failure `Internal`.
    #[test]
    fn a_full_disk_or_quota_is_resource_exhausted() {
        let io = |errno| Error::Io {
            path: "/spill/segment".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        assert_eq!(io(28).to_status().code(), tonic::Code::ResourceExhausted);
        assert_eq!(io(122).to_status().code(), tonic::Code::ResourceExhausted);
        assert_eq!(io(5).to_status().code(), tonic::Code::Internal);
    }
}
