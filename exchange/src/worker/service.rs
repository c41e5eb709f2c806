//! The worker's Flight service: `do_get` serves blocks and partitions, `do_put` takes map
//! input and pushed blocks, `do_action` runs tasks and answers control messages. Every
//! message is validated on receipt; a bad one is `InvalidArgument`, never a panic.

use super::state::WorkerState;
use crate::block::{BlockId, ShuffleId, Slice};
use crate::error::{Error, Result};
use crate::proto;
use crate::transport::{actions, client::decode, ipc_to_flight};
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status, Streaming};

/// Blocks read ahead of the one being sent on a partition stream.
const PREFETCH: usize = 2;
/// Blocks read ahead when they may be in the tier below disk: each is one request to the
/// store, so a partition read keeps this many in flight.
const TIERED_PREFETCH: usize = 16;

/// The worker's Flight service, serving blocks, map input and actions over its state.
pub struct WorkerService {
    /// The worker's state every call works on.
    pub state: Arc<WorkerState>,
}

fn bad(msg: impl std::fmt::Display) -> Status {
    Status::invalid_argument(msg.to_string())
}

fn one<T: Send + 'static>(item: T) -> BoxStream<'static, Result<T, Status>> {
    futures::stream::once(async move { Ok(item) }).boxed()
}

impl WorkerService {
    fn serve_blocks(
        &self,
        shuffle: ShuffleId,
        ids: BoxStream<'static, Result<BlockId>>,
        partition: Option<u32>,
    ) -> Result<BoxStream<'static, Result<FlightData, Status>>> {
        let info = self.state.store.shuffle_info(shuffle)?;
        let schema = FlightData::from(SchemaAsIpc::new(&info.schema, &IpcWriteOptions::default()));
        let state = self.state.clone();
        let prefetch = match state.store.has_tier(shuffle) {
            true => TIERED_PREFETCH,
            false => PREFETCH,
        };
        let blocks = ids
            .map(move |id| {
                let state = state.clone();
                async move {
                    let id = id?;
                    tokio::task::spawn_blocking(move || state.store.get_part(&id, partition))
                        .await
                        .map_err(|e| Error::Cluster(format!("block read task failed: {e}")))?
                }
            })
            .buffered(prefetch)
            .map(|data| -> Result<Vec<Result<FlightData, Status>>, Status> {
                let msgs = ipc_to_flight(&data?)?;
                Ok(msgs
                    .into_iter()
                    .filter(|(is_schema, _)| !is_schema)
                    .map(|(_, m)| Ok(m))
                    .collect())
            })
            .flat_map(|r| match r {
                Ok(v) => futures::stream::iter(v).boxed(),
                Err(s) => one(()).map(move |_| Err(s.clone())).boxed(),
            });
        Ok(futures::stream::once(async move { Ok(schema) })
            .chain(blocks)
            .boxed())
    }

    async fn put_map(
        &self,
        task: proto::MapTask,
        first: FlightData,
        rest: Streaming<FlightData>,
    ) -> Result<proto::TaskResult> {
        // Compressed buffers are refused before arrow decodes them: a compressed buffer
        // names its decompressed length, which arrow would allocate as claimed. Drivers send
        // map input uncompressed (the loopback or LAN is faster than a codec).
        let data = futures::stream::once(async move { Ok(first) })
            .chain(rest.map_err(|s| arrow_flight::error::FlightError::Tonic(Box::new(s))))
            .and_then(|m| async move {
                uncompressed(&m)
                    .map_err(|e| arrow_flight::error::FlightError::ExternalError(Box::new(e)))?;
                Ok(m)
            });
        let input = FlightRecordBatchStream::new_from_flight_data(data).map_err(|e| match e {
            // Input refused here keeps its own error (and status).
            arrow_flight::error::FlightError::ExternalError(inner) => {
                match inner.downcast::<Error>() {
                    Ok(refused) => *refused,
                    Err(other) => Error::Cancelled(format!("map input stream broke: {other}")),
                }
            }
            e => Error::Cancelled(format!("map input stream broke before its end: {e}")),
        });
        // Arrow panics on some malformed messages (a buffer slice past the body's end, an
        // unknown type): that is bad input, not a failed task.
        let input = std::panic::AssertUnwindSafe(input)
            .catch_unwind()
            .map(|item| match item {
                Ok(r) => r,
                Err(panic) => Err(Error::invalid(format!(
                    "map input could not be decoded: {}",
                    panic_message(&panic)
                ))),
            });
        self.state
            .run_map(task, Box::pin(input), crate::source::TaskStop::default())
            .await
    }

    /// Store blocks another worker's map attempt pushed here (pending until the driver
    /// commits the attempt here). Each block's key must name this attempt, and its bytes must
    /// match the CRC32C the sender computed. If the stream breaks, the attempt is failing on
    /// the sender's side: the blocks it brought are dropped. Blocks of a finished stream whose
    /// attempt then loses are removed by the driver's cancel (or, at the latest, the seal).
    async fn put_pushed(
        &self,
        push: proto::PushBlocks,
        first: FlightData,
        mut rest: Streaming<FlightData>,
    ) -> Result<proto::TaskResult> {
        let shuffle = ShuffleId(push.shuffle_id);
        self.state.store.shuffle_info(shuffle)?;
        let mut out = proto::TaskResult::default();
        let mut next = Some(first);
        loop {
            let msg = match next.take() {
                Some(m) => m,
                None => match rest.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(s) => {
                        // The sender's attempt fails with its stream: drop what it brought.
                        self.state.store.abort(shuffle, push.map_id, push.attempt);
                        return Err(Error::Cancelled(format!(
                            "pushed blocks of map {} attempt {} broke off: {s}",
                            push.map_id, push.attempt
                        )));
                    }
                },
            };
            if msg.app_metadata.is_empty() && msg.data_body.is_empty() {
                continue; // the descriptor message
            }
            let sent = proto::BlockMeta::decode(msg.app_metadata.clone())
                .map_err(|e| Error::invalid(format!("malformed pushed block metadata: {e}")))?;
            let sent = crate::block::BlockMeta::try_from(&sent)?;
            let id = sent.id;
            if id.shuffle != shuffle || id.map != push.map_id || id.attempt != push.attempt {
                return Err(Error::invalid(format!(
                    "pushed block {id} does not belong to map {} attempt {} of shuffle {shuffle}",
                    push.map_id, push.attempt
                )));
            }
            let store = self.state.store.clone();
            let data = msg.data_body;
            let meta = tokio::task::spawn_blocking(move || store.put(id, sent.rows, data))
                .await
                .map_err(|e| Error::Cluster(format!("pushed block store failed: {e}")))??;
            if meta.crc32c != sent.crc32c || meta.bytes != sent.bytes {
                self.state.store.abort(shuffle, push.map_id, push.attempt);
                return Err(Error::Checksum {
                    block: id,
                    expected: sent.crc32c,
                    actual: meta.crc32c,
                });
            }
            out.blocks.push((&meta).into());
        }
        Ok(out)
    }
}

/// The message a panic carried, if it was a string.
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a decoder panicked".into())
}

/// Refuse a Flight message whose IPC header says its buffers are compressed (map input).
fn uncompressed(m: &FlightData) -> Result<()> {
    if m.data_header.is_empty() {
        return Ok(());
    }
    let msg = arrow::ipc::root_as_message(&m.data_header)
        .map_err(|e| Error::invalid(format!("malformed IPC message header: {e}")))?;
    let compressed = match msg.header_type() {
        arrow::ipc::MessageHeader::RecordBatch => msg
            .header_as_record_batch()
            .is_some_and(|b| b.compression().is_some()),
        arrow::ipc::MessageHeader::DictionaryBatch => msg
            .header_as_dictionary_batch()
            .and_then(|d| d.data())
            .is_some_and(|b| b.compression().is_some()),
        _ => false,
    };
    if compressed {
        return Err(Error::invalid(
            "compressed IPC buffers are not accepted as map input: send them uncompressed",
        ));
    }
    Ok(())
}

/// The largest raw block a worker takes (blocks are far smaller: a map flushes at a few MiB).
pub const RAW_BLOCK_LIMIT: u64 = 1 << 30;

fn raw_messages(meta: crate::block::BlockMeta, data: bytes::Bytes) -> Stream<FlightData> {
    futures::stream::iter(
        crate::transport::raw_pieces(&meta, &data)
            .into_iter()
            .map(Ok),
    )
    .boxed()
}

impl WorkerService {
    /// Store one raw block (a block rebuilt from parity), pending under its attempt: the
    /// bytes must add up to the size and CRC32C its metadata names. Putting a block this
    /// worker holds already, with the same size and CRC32C, is a no-op.
    async fn put_raw(
        &self,
        id: BlockId,
        first: FlightData,
        mut rest: Streaming<FlightData>,
    ) -> Result<proto::TaskResult> {
        let sent = proto::BlockMeta::decode(first.app_metadata.clone())
            .map_err(|e| Error::invalid(format!("malformed raw block metadata: {e}")))?;
        let sent = crate::block::BlockMeta::try_from(&sent)?;
        if sent.id != id {
            return Err(Error::invalid(format!(
                "raw block metadata names {} but the put command {id}",
                sent.id
            )));
        }
        self.state.store.shuffle_info(id.shuffle)?;
        let cap = RAW_BLOCK_LIMIT;
        if sent.bytes > cap || first.data_body.len() as u64 > sent.bytes {
            return Err(Error::invalid(format!(
                "raw block {id} claims {} bytes, over the {cap}-byte limit",
                sent.bytes
            )));
        }
        // Grown as the bytes arrive: a claimed size alone allocates nothing.
        let mut data = first.data_body.to_vec();
        while let Some(msg) = rest
            .message()
            .await
            .map_err(|s| Error::Cancelled(format!("raw block {id} broke off: {s}")))?
        {
            if data.len() + msg.data_body.len() > sent.bytes as usize {
                return Err(Error::invalid(format!(
                    "raw block {id} is longer than the {} bytes its metadata names",
                    sent.bytes
                )));
            }
            data.extend_from_slice(&msg.data_body);
        }
        // The same block put again (a rebuild that started over) is taken as it is.
        if let Ok((had, _)) = self.state.store.get_raw(&id) {
            if had.crc32c == sent.crc32c && had.bytes == sent.bytes {
                return Ok(proto::TaskResult {
                    blocks: vec![(&had).into()],
                    ..Default::default()
                });
            }
        }
        // Checked before it is stored: a bad put is refused alone (the attempt it names, maybe
        // a committed one being rebuilt, is left as it was).
        let actual = crc32c::crc32c(&data);
        if actual != sent.crc32c || data.len() as u64 != sent.bytes {
            return Err(Error::Checksum {
                block: id,
                expected: sent.crc32c,
                actual,
            });
        }
        let store = self.state.store.clone();
        let meta = tokio::task::spawn_blocking(move || store.put(id, sent.rows, data.into()))
            .await
            .map_err(|e| Error::Cluster(format!("raw block store failed: {e}")))??;
        Ok(proto::TaskResult {
            blocks: vec![(&meta).into()],
            ..Default::default()
        })
    }
}

type Stream<T> = BoxStream<'static, Result<T, Status>>;

#[tonic::async_trait]
impl FlightService for WorkerService {
    type HandshakeStream = Stream<HandshakeResponse>;
    type ListFlightsStream = Stream<FlightInfo>;
    type DoGetStream = Stream<FlightData>;
    type DoPutStream = Stream<PutResult>;
    type DoActionStream = Stream<arrow_flight::Result>;
    type ListActionsStream = Stream<ActionType>;
    type DoExchangeStream = Stream<FlightData>;

    async fn handshake(
        &self,
        _r: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        // The token is checked on every call; a handshake has nothing more to establish.
        Ok(Response::new(one(HandshakeResponse::default())))
    }

    async fn list_flights(
        &self,
        _r: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(Status::unimplemented(
            "list_flights is not offered by flightshuffle workers",
        ))
    }

    async fn get_flight_info(
        &self,
        _r: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(Status::unimplemented(
            "get_flight_info is not offered by flightshuffle workers",
        ))
    }

    async fn poll_flight_info(
        &self,
        _r: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented(
            "poll_flight_info is not offered by flightshuffle workers",
        ))
    }

    async fn get_schema(
        &self,
        _r: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Err(Status::unimplemented(
            "get_schema is not offered by flightshuffle workers",
        ))
    }

    async fn do_get(&self, r: Request<Ticket>) -> Result<Response<Self::DoGetStream>, Status> {
        let ticket = proto::Ticket::decode(r.into_inner().ticket)
            .map_err(|e| bad(format!("malformed ticket: {e}")))?;
        let stream = match ticket.kind {
            Some(proto::ticket::Kind::Block(key)) => {
                let id = BlockId::from(&key);
                self.state.store.meta(&id)?;
                let ids = futures::stream::once(async move { Ok(id) }).boxed();
                self.serve_blocks(id.shuffle, ids, None)?
            }
            Some(proto::ticket::Kind::Partition(p)) => {
                let shuffle = ShuffleId(p.shuffle_id);
                let info = self.state.store.shuffle_info(shuffle)?;
                if p.partition >= info.partitions {
                    return Err(bad(format!(
                        "partition {} out of range: shuffle {shuffle} has {}",
                        p.partition, info.partitions
                    )));
                }
                let timeout = match p.timeout_ms {
                    0 => self.state.read_timeout,
                    ms => Duration::from_millis(ms),
                };
                let slice = Slice::new(p.slice, p.slices)?;
                let ids = self
                    .state
                    .store
                    .clone()
                    .follow_partition(shuffle, p.partition, p.wait_sealed, timeout)
                    .try_filter(move |id| futures::future::ready(slice.contains(id)))
                    .boxed();
                self.serve_blocks(shuffle, ids, Some(p.partition))?
            }
            Some(proto::ticket::Kind::MapOutput(m)) => {
                let shuffle = ShuffleId(m.shuffle_id);
                let ids = self
                    .state
                    .store
                    .wait_map_output(shuffle, m.map_id, self.state.read_timeout)
                    .await?;
                let ids = futures::stream::iter(ids.into_iter().map(Ok)).boxed();
                self.serve_blocks(shuffle, ids, None)?
            }
            Some(proto::ticket::Kind::Raw(key)) => {
                let id = BlockId::from(&key);
                let store = self.state.store.clone();
                let (meta, data) = tokio::task::spawn_blocking(move || store.get_raw(&id))
                    .await
                    .map_err(|e| Error::Cluster(format!("block read task failed: {e}")))??;
                raw_messages(meta, data)
            }
            None => return Err(bad("ticket names no block, partition or map output")),
        };
        Ok(Response::new(stream))
    }

    async fn do_put(
        &self,
        r: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        let mut stream = r.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| bad("do_put stream is empty"))?;
        let cmd = first
            .flight_descriptor
            .as_ref()
            .ok_or_else(|| bad("do_put needs a flight descriptor with a PutCommand"))?
            .cmd
            .clone();
        let cmd = proto::PutCommand::decode(cmd)
            .map_err(|e| bad(format!("malformed put command: {e}")))?;
        let result = match cmd.kind {
            Some(proto::put_command::Kind::Map(task)) => self.put_map(task, first, stream).await?,
            Some(proto::put_command::Kind::Push(push)) => {
                self.put_pushed(push, first, stream).await?
            }
            Some(proto::put_command::Kind::Block(key)) => {
                self.put_raw(BlockId::from(&key), first, stream).await?
            }
            None => return Err(bad("put command has no kind")),
        };
        Ok(Response::new(one(PutResult {
            app_metadata: result.encode_to_vec().into(),
        })))
    }

    async fn do_action(
        &self,
        r: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let action = r.into_inner();
        let body = action.body;
        let s = &self.state;
        let reply: Vec<u8> = match action.r#type.as_str() {
            actions::CREATE_SHUFFLE => {
                s.create_shuffle(decode(&body)?)?;
                vec![]
            }
            actions::RUN_MAP => {
                let task: proto::MapTask = decode(&body)?;
                let source = task
                    .source
                    .clone()
                    .ok_or_else(|| bad("run_map needs a task source"))?;
                let info = s.store.shuffle_info(ShuffleId(task.shuffle_id))?;
                let ctx = s.task_context(&task);
                let input = s
                    .sources
                    .open(&source.kind, &ctx, &source.payload, info.schema)?;
                s.run_map(task, input, ctx.stop).await?.encode_to_vec()
            }
            actions::RUN_REDUCE => s.run_reduce(decode(&body)?).await?.encode_to_vec(),
            actions::FOLD => s.fold(decode(&body)?).await?.encode_to_vec(),
            actions::SEAL_SHUFFLE => {
                let m: proto::ShuffleRef = decode(&body)?;
                let rows = (!m.partition_rows.is_empty()).then(|| m.partition_rows.into());
                if !m.objects.is_empty() {
                    // Exchanged through the store: readers here read the map objects.
                    let storage = s.durable_storage(ShuffleId(m.shuffle_id)).ok_or_else(|| {
                        bad(format!(
                            "shuffle {} is read through a store it was not registered with",
                            m.shuffle_id
                        ))
                    })?;
                    s.store
                        .read_through(ShuffleId(m.shuffle_id), storage, m.objects.into())?;
                }
                // Blocking: sealing may move segments to the tier below disk.
                tokio::task::block_in_place(|| {
                    s.store.seal_counted(ShuffleId(m.shuffle_id), rows)
                })?;
                vec![]
            }
            actions::DROP_SHUFFLE => {
                let m: proto::ShuffleRef = decode(&body)?;
                s.cancel_shuffle(ShuffleId(m.shuffle_id));
                s.drop_fold_states(ShuffleId(m.shuffle_id));
                s.sources.shuffle_dropped(ShuffleId(m.shuffle_id));
                s.forget_durable(ShuffleId(m.shuffle_id));
                s.store.drop_shuffle(ShuffleId(m.shuffle_id))?;
                vec![]
            }
            actions::CANCEL => {
                let m: proto::CommitTask = decode(&body)?;
                s.cancel(ShuffleId(m.shuffle_id), m.map_id, m.attempt);
                vec![]
            }
            actions::COMMIT => {
                let m: proto::CommitTask = decode(&body)?;
                let (shuffle, expected) = (ShuffleId(m.shuffle_id), Some(m.blocks as usize));
                if m.merged_maps.is_empty() {
                    s.store.commit(shuffle, m.map_id, m.attempt, expected)?;
                } else {
                    s.store
                        .commit_merge(shuffle, m.map_id, m.attempt, expected, &m.merged_maps)?;
                }
                let lose = s.lose_commit_replies.fetch_update(
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                    |n| n.checked_sub(1),
                );
                if lose.is_ok() {
                    return Err(Status::unavailable(
                        "fault injected: the commit took effect, its reply is lost",
                    ));
                }
                vec![]
            }
            actions::MERGE => s.merge(decode(&body)?).await?.encode_to_vec(),
            actions::COMBINE => s.combine_objects(decode(&body)?).await?.encode_to_vec(),
            actions::STATS => s.stats().encode_to_vec(),
            actions::CALIBRATE => s.calibrate(decode(&body)?).await?.encode_to_vec(),
            actions::HEALTH => proto::Health {
                worker_id: s.id.clone(),
                pid: std::process::id(),
                instance: s.instance,
            }
            .encode_to_vec(),
            actions::EXIT => {
                super::fence::exit_soon()?;
                vec![]
            }
            actions::STAND_IN => super::stand_in::start().await?.into_bytes(),
            other => {
                return Err(bad(format!(
                    "unknown action {other:?} (known: {:?})",
                    actions::ALL
                )))
            }
        };
        Ok(Response::new(one(arrow_flight::Result {
            body: reply.into(),
        })))
    }

    async fn list_actions(
        &self,
        _r: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        let list = actions::ALL.iter().map(|a| {
            Ok(ActionType {
                r#type: a.to_string(),
                description: String::new(),
            })
        });
        Ok(Response::new(futures::stream::iter(list).boxed()))
    }

    async fn do_exchange(
        &self,
        _r: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented(
            "do_exchange is not offered by flightshuffle workers",
        ))
    }
}
