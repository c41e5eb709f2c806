//! Typed Flight client for one worker, used by the driver and by reducers pulling from peers.
//! Every call carries the cluster token and has a deadline; streams have an idle timeout.

use super::{
    actions, bearer, CONNECTION_WINDOW, KEEPALIVE, KEEPALIVE_TIMEOUT, MAX_MESSAGE_BYTES,
    STREAM_WINDOW,
};
use crate::block::BlockId;
use crate::error::{Error, Result};
use crate::proto;
use crate::source::BatchStream;
use arrow::datatypes::SchemaRef;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, FlightData, FlightDescriptor, Ticket};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use std::time::Duration;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// Adds the cluster token to every request.
#[derive(Clone)]
pub struct TokenInterceptor {
    value: MetadataValue<Ascii>,
}

impl tonic::service::Interceptor for TokenInterceptor {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut()
            .insert(super::TOKEN_HEADER, self.value.clone());
        Ok(req)
    }
}

type Client = FlightServiceClient<InterceptedService<Channel, TokenInterceptor>>;

/// A connection to one worker.
#[derive(Clone)]
pub struct WorkerClient {
    /// The worker's slot in the cluster, named in errors.
    pub index: usize,
    /// The worker's address (`host:port`).
    pub addr: String,
    client: Client,
    timeout: Duration,
}

impl WorkerClient {
    /// Connects lazily: the first call opens the connection (bounded by a connect timeout).
    pub fn new(
        index: usize,
        addr: &str,
        creds: &super::Credentials,
        timeout: Duration,
    ) -> Result<Self> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Cluster(
                "a worker client must be created inside a tokio runtime".into(),
            ));
        }
        let scheme = if creds.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| Error::invalid(format!("bad worker address {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW);
        if let Some(tls) = &creds.tls {
            endpoint = endpoint
                .tls_config(tls.config())
                .map_err(|e| Error::invalid(format!("bad TLS settings for {addr}: {e}")))?;
        }
        let value = bearer(&creds.token)
            .parse()
            .map_err(|_| Error::invalid("the cluster token must be printable ASCII"))?;
        let client = FlightServiceClient::with_interceptor(
            endpoint.connect_lazy(),
            TokenInterceptor { value },
        )
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(WorkerClient {
            index,
            addr: addr.to_string(),
            client,
            timeout,
        })
    }

    /// The deadline of one call to this worker.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn remote(&self, s: tonic::Status) -> Error {
        Error::Remote {
            worker: self.index,
            addr: self.addr.clone(),
            code: s.code(),
            message: s.message().to_string(),
        }
    }

    fn timed_out(&self, what: &str, d: Duration) -> Error {
        Error::Timeout {
            what: format!("{what} on worker {} ({})", self.index, self.addr),
            seconds: d.as_secs_f64(),
        }
    }

    /// Run one action and return the body of its first result.
    pub async fn action(&self, kind: &str, body: Vec<u8>, timeout: Duration) -> Result<Bytes> {
        let mut client = self.client.clone();
        let call = async {
            let req = Action {
                r#type: kind.to_string(),
                body: body.into(),
            };
            let mut stream = client
                .do_action(req)
                .await
                .map_err(|s| self.remote(s))?
                .into_inner();
            let first = stream.message().await.map_err(|s| self.remote(s))?;
            // Read the stream to its end: dropping it early resets the HTTP/2 stream, and a
            // connection that resets many (thousands of task calls) is torn down by h2.
            while stream
                .message()
                .await
                .map_err(|s| self.remote(s))?
                .is_some()
            {}
            Ok(first.map(|r| r.body).unwrap_or_default())
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| self.timed_out(kind, timeout))?
    }

    /// Register a shuffle on the worker.
    pub async fn create_shuffle(&self, m: &proto::CreateShuffle) -> Result<()> {
        self.action(actions::CREATE_SHUFFLE, m.encode_to_vec(), self.timeout)
            .await
            .map(|_| ())
    }

    /// Run a map attempt from a worker-side task source; returns its result once done.
    pub async fn run_map(&self, m: &proto::MapTask) -> Result<proto::TaskResult> {
        let body = self
            .action(actions::RUN_MAP, m.encode_to_vec(), self.timeout)
            .await?;
        decode(&body)
    }

    /// Run a reduce task: the worker pulls one partition from every worker into a sink.
    pub async fn run_reduce(&self, m: &proto::ReduceTask) -> Result<proto::TaskResult> {
        let body = self
            .action(actions::RUN_REDUCE, m.encode_to_vec(), self.timeout)
            .await?;
        decode(&body)
    }

    /// Fold blocks of one partition into its running state on the worker (streaming strategy).
    pub async fn fold(&self, m: &proto::FoldTask) -> Result<proto::FoldResult> {
        let body = self
            .action(actions::FOLD, m.encode_to_vec(), self.timeout)
            .await?;
        decode(&body)
    }

    /// Run a merge task (merged strategy); its blocks stay pending until committed.
    pub async fn merge(&self, m: &proto::MergeTask) -> Result<proto::TaskResult> {
        let body = self
            .action(actions::MERGE, m.encode_to_vec(), self.timeout)
            .await?;
        decode(&body)
    }

    /// Run the second level of a two-level exchange through the store on the worker: it
    /// writes one combined object and returns its record ([`crate::direct::combine`]).
    pub async fn combine(&self, m: &proto::CombineTask) -> Result<proto::StoredObject> {
        let body = self
            .action(actions::COMBINE, m.encode_to_vec(), self.timeout)
            .await?;
        decode(&body)
    }

    /// Commit one map attempt (its blocks become visible to readers).
    pub async fn commit(&self, m: &proto::CommitTask) -> Result<()> {
        self.action(actions::COMMIT, m.encode_to_vec(), self.timeout)
            .await
            .map(|_| ())
    }

    /// Abort one map attempt: stop it if it runs and remove its uncommitted blocks.
    pub async fn cancel(&self, m: &proto::CommitTask) -> Result<()> {
        self.action(actions::CANCEL, m.encode_to_vec(), self.timeout)
            .await
            .map(|_| ())
    }

    /// Run action `kind` (e.g. drop) on `shuffle`, with no partition rows.
    pub async fn shuffle_action(&self, kind: &str, shuffle: u64) -> Result<()> {
        let m = proto::ShuffleRef {
            shuffle_id: shuffle,
            ..Default::default()
        };
        self.action(kind, m.encode_to_vec(), self.timeout)
            .await
            .map(|_| ())
    }

    /// Seal `shuffle` here, with the rows its manifest lists per partition (empty: unknown).
    pub async fn seal(
        &self,
        shuffle: u64,
        partition_rows: Vec<u64>,
        objects: Vec<proto::StoredObject>,
    ) -> Result<()> {
        let m = proto::ShuffleRef {
            shuffle_id: shuffle,
            partition_rows,
            objects,
        };
        self.action(actions::SEAL_SHUFFLE, m.encode_to_vec(), self.timeout)
            .await
            .map(|_| ())
    }

    /// The worker's counters: block store, memory, task admission and calls served.
    pub async fn stats(&self) -> Result<proto::WorkerStats> {
        decode(&self.action(actions::STATS, vec![], self.timeout).await?)
    }

    /// Check the worker is up (its id and process id), within `timeout`.
    pub async fn health(&self, timeout: Duration) -> Result<proto::Health> {
        decode(&self.action(actions::HEALTH, vec![], timeout).await?)
    }

    /// Measure the worker's rates for the `auto` strategy.
    pub async fn calibrate(&self, m: &proto::CalibrateTask) -> Result<proto::Calibration> {
        decode(
            &self
                .action(actions::CALIBRATE, m.encode_to_vec(), self.timeout)
                .await?,
        )
    }

    /// Push `input` to the worker as the input of a map task (`do_put`). If the input fails,
    /// the call is abandoned so the worker sees a broken stream, never a short input.
    pub async fn put_map(
        &self,
        task: &proto::MapTask,
        schema: SchemaRef,
        input: BatchStream,
    ) -> Result<proto::TaskResult> {
        let cmd = proto::PutCommand {
            kind: Some(proto::put_command::Kind::Map(task.clone())),
        };
        let encoder = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .with_flight_descriptor(Some(FlightDescriptor::new_cmd(cmd.encode_to_vec())))
            .build(input.map_err(|e| FlightError::ExternalError(Box::new(e))));
        let (err_tx, err_rx) = tokio::sync::oneshot::channel::<FlightError>();
        let data =
            futures::stream::unfold((encoder, Some(err_tx)), |(mut enc, mut tx)| async move {
                match enc.next().await {
                    // The encoder cut batches into small messages; one row it could not cut
                    // would be refused by the transport with no reason given.
                    Some(Ok(d)) if d.data_body.len() + d.data_header.len() > MAX_MESSAGE_BYTES => {
                        if let Some(t) = tx.take() {
                            let _ = t.send(FlightError::ExternalError(Box::new(Error::invalid(
                                format!(
                                    "a single row of the map input takes {} bytes: over the \
                                     {} MiB a message may carry",
                                    d.data_body.len(),
                                    MAX_MESSAGE_BYTES >> 20
                                ),
                            ))));
                        }
                        futures::future::pending().await
                    }
                    Some(Ok(d)) => Some((d, (enc, tx))),
                    None => None,
                    Some(Err(e)) => {
                        if let Some(t) = tx.take() {
                            let _ = t.send(e);
                        }
                        futures::future::pending().await
                    }
                }
            });
        let mut client = self.client.clone();
        let call = async move {
            let mut results = client.do_put(data).await?.into_inner();
            let first = results.message().await?;
            // To the end, so the stream is not reset (see `action`).
            while results.message().await?.is_some() {}
            Ok::<_, tonic::Status>(first)
        };
        tokio::pin!(call);
        let outcome = tokio::time::timeout(self.timeout, async {
            tokio::select! {
                r = &mut call => r.map_err(|s| self.remote(s)),
                e = err_rx => match e {
                    Ok(e) => Err(match e {
                        FlightError::ExternalError(inner) => match inner.downcast::<Error>() {
                            Ok(err) => *err,
                            Err(other) => Error::Cluster(format!("map input failed: {other}")),
                        },
                        other => Error::Cluster(format!("map input failed: {other}")),
                    }),
                    Err(_) => call.await.map_err(|s| self.remote(s)),
                },
            }
        })
        .await
        .map_err(|_| self.timed_out("map task input", self.timeout))??;
        let put = outcome.ok_or_else(|| Error::Cluster("map task returned no result".into()))?;
        decode(&put.app_metadata)
    }

    /// Push the blocks `blocks` delivers (one map attempt's blocks for partitions this worker
    /// holds) in one `do_put` stream; the bounded channel is the backpressure. Returns the
    /// metadata the worker stored them under (pending until the driver commits the attempt).
    pub async fn push_blocks(
        &self,
        push: proto::PushBlocks,
        blocks: tokio::sync::mpsc::Receiver<(proto::BlockMeta, Bytes)>,
    ) -> Result<proto::TaskResult> {
        let cmd = proto::PutCommand {
            kind: Some(proto::put_command::Kind::Push(push)),
        };
        let head = FlightData {
            flight_descriptor: Some(FlightDescriptor::new_cmd(cmd.encode_to_vec())),
            ..Default::default()
        };
        let body =
            tokio_stream::wrappers::ReceiverStream::new(blocks).map(|(meta, data)| FlightData {
                app_metadata: meta.encode_to_vec().into(),
                data_body: data,
                ..Default::default()
            });
        let data = futures::stream::once(async move { head }).chain(body);
        let mut client = self.client.clone();
        let call = async move {
            let mut results = client.do_put(data).await?.into_inner();
            let first = results.message().await?;
            // To the end, so the stream is not reset (see `action`).
            while results.message().await?.is_some() {}
            Ok::<_, tonic::Status>(first)
        };
        let put = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| self.timed_out("pushed blocks", self.timeout))?
            .map_err(|s| self.remote(s))?
            .ok_or_else(|| Error::Cluster("block push returned no result".into()))?;
        decode(&put.app_metadata)
    }

    async fn get(&self, ticket: proto::Ticket, what: String) -> Result<BatchStream> {
        let mut client = self.client.clone();
        let stream = tokio::time::timeout(
            self.timeout,
            client.do_get(Ticket {
                ticket: ticket.encode_to_vec().into(),
            }),
        )
        .await
        .map_err(|_| self.timed_out(&what, self.timeout))?
        .map_err(|s| self.remote(s))?
        .into_inner();
        let me = self.clone();
        let idle = self.timeout;
        let data = tokio_stream::StreamExt::timeout(stream, idle).map(move |item| match item {
            Ok(Ok(d)) => Ok(d),
            Ok(Err(s)) => Err(FlightError::Tonic(Box::new(s))),
            Err(_) => Err(FlightError::ExternalError(Box::new(
                me.timed_out(&what, idle),
            ))),
        });
        let me = self.clone();
        let batches =
            FlightRecordBatchStream::new_from_flight_data(data).map_err(move |e| match e {
                FlightError::Tonic(s) => me.remote(*s),
                FlightError::ExternalError(inner) => match inner.downcast::<Error>() {
                    Ok(err) => *err,
                    Err(other) => Error::Cluster(other.to_string()),
                },
                FlightError::Arrow(a) => Error::Arrow(a),
                other => Error::Cluster(format!("worker {} ({}): {other}", me.index, me.addr)),
            });
        Ok(Box::pin(batches))
    }

    /// Stream every block of one reduce partition this worker holds (of one slice of it).
    pub async fn read_partition(
        &self,
        shuffle: u64,
        partition: u32,
        wait_sealed: bool,
        slice: crate::block::Slice,
    ) -> Result<BatchStream> {
        let ticket = proto::Ticket {
            kind: Some(proto::ticket::Kind::Partition(proto::PartitionTicket {
                shuffle_id: shuffle,
                partition,
                wait_sealed,
                timeout_ms: self.timeout.as_millis() as u64,
                slice: slice.index,
                slices: slice.count,
            })),
        };
        self.get(ticket, format!("partition {partition}")).await
    }

    /// Stream every block one map task wrote (sealed shuffles only), in partition order.
    pub async fn read_map_output(&self, shuffle: u64, map: u32) -> Result<BatchStream> {
        let ticket = proto::Ticket {
            kind: Some(proto::ticket::Kind::MapOutput(proto::MapOutputTicket {
                shuffle_id: shuffle,
                map_id: map,
            })),
        };
        self.get(ticket, format!("output of map {map}")).await
    }

    /// One block's metadata and stored bytes (committed or pending), not decoded; the bytes
    /// are checked against the metadata's size and CRC32C.
    pub async fn get_raw(&self, id: BlockId) -> Result<(crate::block::BlockMeta, Bytes)> {
        let ticket = proto::Ticket {
            kind: Some(proto::ticket::Kind::Raw(id.into())),
        };
        let mut client = self.client.clone();
        let call = async move {
            let mut stream = client
                .do_get(Ticket {
                    ticket: ticket.encode_to_vec().into(),
                })
                .await?
                .into_inner();
            let mut meta = None;
            let mut data = Vec::new();
            while let Some(msg) = stream.message().await? {
                if meta.is_none() {
                    meta = Some(msg.app_metadata.clone());
                }
                data.extend_from_slice(&msg.data_body);
            }
            Ok::<_, tonic::Status>((meta, data))
        };
        let (meta, data) = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| self.timed_out(&format!("raw block {id}"), self.timeout))?
            .map_err(|s| self.remote(s))?;
        let meta: proto::BlockMeta = decode(&meta.unwrap_or_default())?;
        let meta = crate::block::BlockMeta::try_from(&meta)?;
        let actual = crc32c::crc32c(&data);
        if meta.id != id || meta.bytes != data.len() as u64 || meta.crc32c != actual {
            return Err(Error::Checksum {
                block: id,
                expected: meta.crc32c,
                actual,
            });
        }
        Ok((meta, data.into()))
    }

    /// Store one block as given, pending under its attempt (a block rebuilt from parity);
    /// the worker checks its size and CRC32C against `meta`.
    pub async fn put_raw(&self, meta: crate::block::BlockMeta, data: Bytes) -> Result<()> {
        let cmd = proto::PutCommand {
            kind: Some(proto::put_command::Kind::Block(meta.id.into())),
        };
        let mut messages = super::raw_pieces(&meta, &data);
        messages[0].flight_descriptor = Some(FlightDescriptor::new_cmd(cmd.encode_to_vec()));
        let mut client = self.client.clone();
        let call = async move {
            let mut results = client
                .do_put(futures::stream::iter(messages))
                .await?
                .into_inner();
            while results.message().await?.is_some() {}
            Ok::<_, tonic::Status>(())
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| self.timed_out(&format!("raw block {}", meta.id), self.timeout))?
            .map_err(|s| self.remote(s))
    }

    /// Stream one block.
    pub async fn read_block(&self, id: BlockId) -> Result<BatchStream> {
        let ticket = proto::Ticket {
            kind: Some(proto::ticket::Kind::Block(id.into())),
        };
        self.get(ticket, format!("block {id}")).await
    }
}

/// Decode a protocol message; malformed bytes are an `InvalidArgument` error.
pub fn decode<M: Message + Default>(body: &[u8]) -> Result<M> {
    M::decode(body).map_err(|e| Error::invalid(format!("malformed protocol message: {e}")))
}
