//! Arrow Flight transport: the worker's Flight service ([`server`]), the driver's and
//! workers' client pool ([`client`]), the cluster token, and the zero-decode path that turns
//! a stored block (an IPC stream) into Flight messages.

pub mod client;
pub mod listen;
pub mod peers;
pub mod tls;

use crate::error::{Error, Result};
use arrow::ipc::{root_as_message, MessageHeader};
use arrow_flight::FlightData;
use bytes::Bytes;
use std::time::Duration;

/// gRPC metadata key carrying the cluster token.
pub const TOKEN_HEADER: &str = "authorization";
/// Largest gRPC message sent or accepted. A Flight message holds one record batch, and blocks
/// hold batches of at most [`crate::block::MAX_BATCH_BYTES`]; the driver's map input is cut
/// into 2 MiB messages. So this leaves room for a batch whose size was underestimated, and a
/// peer cannot make a worker buffer a gigabyte for one message.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// HTTP/2 streams one connection may have open at once on a worker (a reader of many
/// partitions opens one per partition; beyond this a client's new streams wait).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 4096;
/// HTTP/2 flow-control windows: large, so one stream can fill loopback.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// HTTP/2 flow-control window of a whole connection, in bytes.
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// HTTP/2 keepalive: a ping this often on every connection ...
pub const KEEPALIVE: Duration = Duration::from_secs(10);
/// ... and the connection is closed when its answer takes longer than this. Generous: on a
/// saturated machine (hundreds of reducers per worker, M = R = 1000 on 2 cores) answers were
/// seen to take over 10 s, and the closed connection failed every stream on it; a worker that
/// is really gone is found by the driver's health checks.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// What a client shows the workers: the cluster token and, on a TLS cluster, how to verify
/// them (and its own certificate, under mutual TLS).
#[derive(Clone, Default)]
pub struct Credentials {
    /// The cluster token, sent with every call.
    pub token: String,
    /// How to verify TLS workers (and the client's own certificate); `None`: plaintext.
    pub tls: Option<tls::ClientTls>,
}

impl Credentials {
    /// Plaintext, with `token`.
    pub fn plain(token: &str) -> Self {
        Credentials {
            token: token.to_string(),
            tls: None,
        }
    }
}

/// The `authorization` header value for `token`: `Bearer <token>`.
pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// Action type names of `do_action`.
pub mod actions {
    /// Register a shuffle (schema, partitions, partitioner) on a worker.
    pub const CREATE_SHUFFLE: &str = "create_shuffle";
    /// Run a map attempt from a worker-side task source.
    pub const RUN_MAP: &str = "run_map";
    /// Run a reduce task: pull one partition from every worker into a sink.
    pub const RUN_REDUCE: &str = "run_reduce";
    /// Fold blocks of one partition into its running state (streaming strategy).
    pub const FOLD: &str = "fold";
    /// Seal a shuffle: its map side is complete.
    pub const SEAL_SHUFFLE: &str = "seal_shuffle";
    /// Drop a shuffle: cancel its tasks and free its blocks and states.
    pub const DROP_SHUFFLE: &str = "drop_shuffle";
    /// Abort one map attempt and remove its uncommitted blocks.
    pub const CANCEL: &str = "cancel";
    /// Commit a map attempt or merge group: its blocks become readable.
    pub const COMMIT: &str = "commit";
    /// Run a merge task (or a forward) over committed map outputs.
    pub const MERGE: &str = "merge";
    /// Combine a column of a group of map objects into one object (two-level through the
    /// store).
    pub const COMBINE: &str = "combine_objects";
    /// Report the worker's block store and task counters.
    pub const STATS: &str = "stats";
    /// Answer with the worker's id and process id.
    pub const HEALTH: &str = "health";
    /// Measure the worker's rates for the `auto` strategy.
    pub const CALIBRATE: &str = "calibrate";
    /// Stop the worker process: a driver that gave it up for lost fences it this way when it
    /// answers again, so that its supervisor starts a fresh process in its place.
    pub const EXIT: &str = "exit";
    /// Start a second worker process on this host to take over a lost worker's slot (a
    /// static cluster's stand-in); the reply is its address.
    pub const STAND_IN: &str = "start_stand_in";
    /// Every action type, as `list_actions` reports them.
    pub const ALL: &[&str] = &[
        CREATE_SHUFFLE,
        RUN_MAP,
        RUN_REDUCE,
        FOLD,
        SEAL_SHUFFLE,
        DROP_SHUFFLE,
        CANCEL,
        COMMIT,
        MERGE,
        COMBINE,
        STATS,
        HEALTH,
        CALIBRATE,
        EXIT,
        STAND_IN,
    ];
}

/// Split an IPC stream into its messages as Flight data, without decoding any buffer.
/// Returns (is_schema_message, flight data) pairs in stream order.
pub fn ipc_to_flight(block: &Bytes) -> Result<Vec<(bool, FlightData)>> {
    let bad = |what: &str| Error::invalid(format!("malformed IPC block: {what}"));
    let u32_at = |pos: usize| -> Result<u32> {
        let b = block.get(pos..pos + 4).ok_or_else(|| bad("truncated"))?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < block.len() {
        let mut len = u32_at(pos)?;
        pos += 4;
        if len == 0xFFFF_FFFF {
            len = u32_at(pos)?;
            pos += 4;
        }
        if len == 0 {
            break;
        }
        let end = pos + len as usize;
        let meta = block.get(pos..end).ok_or_else(|| bad("truncated header"))?;
        let msg = root_as_message(meta).map_err(|e| bad(&e.to_string()))?;
        let is_schema = msg.header_type() == MessageHeader::Schema;
        let body_len = usize::try_from(msg.bodyLength()).map_err(|_| bad("negative body"))?;
        let body_end = end + body_len;
        if body_end > block.len() {
            return Err(bad("truncated body"));
        }
        out.push((
            is_schema,
            FlightData {
                data_header: block.slice(pos..end),
                data_body: block.slice(end..body_end),
                ..Default::default()
            },
        ));
        pos = body_end;
    }
    Ok(out)
}

/// /proc/self/status VmHWM: this process's peak resident set, in bytes.
pub fn peak_rss_bytes() -> u64 {
    proc_status_bytes("VmHWM:")
}

/// /proc/self/status VmRSS: this process's resident set now, in bytes.
pub fn rss_bytes() -> u64 {
    proc_status_bytes("VmRSS:")
}

/// A `kB` line of /proc/self/status in bytes (0 where there is none).
fn proc_status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Pieces a raw block is sent in (well under the message size limit).
pub const RAW_PIECE: usize = 1 << 20;

/// A raw block as Flight messages: its metadata with the first piece, then the other pieces.
pub(crate) fn raw_pieces(meta: &crate::block::BlockMeta, data: &bytes::Bytes) -> Vec<FlightData> {
    let head: crate::proto::BlockMeta = meta.into();
    (0..data.len().div_ceil(RAW_PIECE).max(1))
        .map(|i| FlightData {
            app_metadata: if i == 0 {
                prost::Message::encode_to_vec(&head).into()
            } else {
                Default::default()
            },
            data_body: data.slice(i * RAW_PIECE..((i + 1) * RAW_PIECE).min(data.len())),
            ..Default::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{encode_block, Compression};
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow_flight::decode::FlightRecordBatchStream;
    use futures::TryStreamExt;
    use std::sync::Arc;

    #[tokio::test]
    async fn block_messages_decode_as_flight() {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from_iter_values(0..100))],
        )
        .unwrap();
        for c in [Compression::None, Compression::Lz4, Compression::Zstd] {
            let bytes = encode_block(&schema, &[b.clone(), b.clone()], c).unwrap();
            let msgs = ipc_to_flight(&bytes).unwrap();
            assert_eq!(msgs.len(), 3);
            assert!(msgs[0].0 && !msgs[1].0);
            let stream = futures::stream::iter(msgs.into_iter().map(|(_, m)| Ok(m)));
            let out: Vec<RecordBatch> = FlightRecordBatchStream::new_from_flight_data(stream)
                .try_collect()
                .await
                .unwrap();
            assert_eq!(out, vec![b.clone(), b.clone()]);
        }
        assert!(ipc_to_flight(&Bytes::from_static(&[
            0xff, 0xff, 0xff, 0xff, 9, 0, 0, 0, 1
        ]))
        .is_err());
    }
}
