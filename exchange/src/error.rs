//! The crate's error type and its mapping to and from Flight (gRPC) statuses.

use crate::ids::{BlockId, ShuffleId};
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("arrow error: {0}")]
    Arrow(#[from] arrow::error::ArrowError),

    #[error("i/o error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "checksum mismatch for block {block}: stored crc32c {expected:#010x}, read {actual:#010x}"
    )]
    Checksum {
        block: BlockId,
        expected: u32,
        actual: u32,
    },

    #[error("unknown shuffle {0}")]
    UnknownShuffle(ShuffleId),

    #[error("block {0} not found")]
    BlockNotFound(BlockId),

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("schema mismatch for shuffle {shuffle}: expected {expected}, got {found}")]
    SchemaMismatch {
        shuffle: ShuffleId,
        expected: String,
        found: String,
    },

    #[error("worker {worker} ({addr}) lost: {reason}; {lost_blocks} block(s) held there are lost")]
    WorkerLost {
        worker: usize,
        addr: String,
        reason: String,
        lost_blocks: usize,
    },

    #[error("worker {worker} ({addr}) failed: {code:?}: {message}")]
    Remote {
        worker: usize,
        addr: String,
        code: tonic::Code,
        message: String,
    },

    #[error("timed out after {seconds:.1}s waiting for {what}")]
    Timeout { what: String, seconds: f64 },

    /// A partition read whole did not hold the rows the shuffle's manifest lists for it (a
    /// block lost, or read twice): recovered like a lost worker, never returned short.
    #[error(
        "shuffle {shuffle} partition {partition}: read {received} rows, its manifest lists \
         {expected}"
    )]
    RowCount {
        shuffle: ShuffleId,
        partition: u32,
        expected: u64,
        received: u64,
    },

    #[error("cluster error: {0}")]
    Cluster(String),

    #[error("task failed: {0}")]
    Task(String),

    #[error("task cancelled: {0}")]
    Cancelled(String),

    /// A speculative or retried attempt finished after another attempt of the same map had
    /// committed; it was aborted and its blocks removed (not a failure of the shuffle).
    #[error("attempt {attempt} of map {map} was superseded by an attempt that committed first")]
    Superseded {
        map: u32,
        attempt: u32,
        worker: usize,
    },

    /// An attempt committed on some of the workers holding its blocks but not on all of them
    /// (push, two-level). No other attempt of the map may commit any more (it could duplicate
    /// rows), so the shuffle fails.
    #[error("map {map} attempt {attempt} committed on only some of its holders: {reason}")]
    PartialCommit {
        map: u32,
        attempt: u32,
        reason: String,
    },

    /// The request conflicts with the shuffle's state (sealed, already committed).
    #[error("refused: {0}")]
    Precondition(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

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
