//! The worker: a block store, a Flight server and the tasks it runs. Hosted by the
//! `flightshuffle-worker` binary and by `python -m flightshuffle.worker`; both parse the same
//! command line ([`WorkerArgs`]) and print one ready line with the bound address.

mod args;

use crate::admission::Admission;
use crate::block::{decode_schema, Compression, ShuffleId};
use crate::checksum::Checksum;
use crate::error::{Error, Result};
use crate::partitioner::Partitioner;
use crate::proto;
use crate::store::{BlockStore, ShuffleInfo, StoreConfig};
use crate::task::{run_map, BatchStream, MapConfig, ReduceState, SourceRegistry};
use crate::task::{ShuffleReader, TaskContext, TaskStop};
use crate::transport::peers::PeerReader;
use crate::transport::server::WorkerService;
use crate::transport::{bearer, CONNECTION_WINDOW, MAX_MESSAGE_BYTES, STREAM_WINDOW, TOKEN_HEADER};
pub use args::WorkerArgs;
use arrow_flight::flight_service_server::FlightServiceServer;
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use tokio::task::AbortHandle;

/// Block reads a fold task keeps in flight.
const FOLD_READS: usize = 8;

/// Printed on stdout once the worker listens: `FLIGHTSHUFFLE_WORKER_READY <addr>`.
pub const READY_LINE: &str = "FLIGHTSHUFFLE_WORKER_READY";
/// Environment variable carrying the cluster token to a worker process.
pub const TOKEN_ENV: &str = "FLIGHTSHUFFLE_TOKEN";

/// A partition's fold state on this worker (None while a fold has it).
type FoldSlot = Option<ReduceState>;

/// Everything a worker's Flight service shares.
pub struct WorkerState {
    pub id: String,
    pub store: Arc<BlockStore>,
    /// The address this worker advertises (its peers' name for it).
    pub addr: String,
    /// Pooled clients to peers; reads of this worker's own blocks go to its store.
    pub reader: Arc<PeerReader>,
    pub sources: SourceRegistry,
    pub map_cfg: MapConfig,
    /// Grants of the worker's budget to the tasks it runs (see [`crate::admission`]).
    pub admission: Arc<Admission>,
    pub read_timeout: Duration,
    /// Flight calls served (counted when their token is checked).
    pub rpcs: std::sync::atomic::AtomicU64,
    /// Running map attempts by (shuffle, map, attempt).
    tasks: Mutex<HashMap<AttemptKey, (AbortHandle, TaskStop)>>,
    /// Running reduce states of the streaming strategy, per (shuffle, partition). `None` marks
    /// a state that is being folded or was lost by a failed fold: the next fold fails loudly
    /// instead of silently starting over.
    fold_states: Arc<Mutex<HashMap<(ShuffleId, u32), FoldSlot>>>,
    /// Rounds folded into each state so far (a fold of an earlier round is a retry).
    fold_rounds: Arc<Mutex<HashMap<(ShuffleId, u32), u32>>>,
    /// States being folded now. The fold finishes and puts its state back even when the
    /// call that asked for it is cancelled; a later fold of the same state waits for it.
    folding: FoldKeys,
    /// Commit replies still to lose (fault injection, `--fault-lose-commit-replies`).
    pub lose_commit_replies: std::sync::atomic::AtomicU32,
}

type FoldKeys = Arc<Mutex<std::collections::HashSet<(ShuffleId, u32)>>>;

/// A partition being folded, until dropped (also on a panic: its next fold fails at once).
struct Folding(FoldKeys, (ShuffleId, u32));

impl Folding {
    fn start(set: FoldKeys, key: (ShuffleId, u32)) -> Self {
        lock(&set).insert(key);
        Folding(set, key)
    }
}

impl Drop for Folding {
    fn drop(&mut self) {
        lock(&self.0).remove(&self.1);
    }
}

impl WorkerState {
    /// The context a map task of `task` runs with.
    pub fn task_context(&self, task: &proto::MapTask) -> TaskContext {
        TaskContext {
            shuffle: ShuffleId(task.shuffle_id),
            map: task.map_id,
            attempt: task.attempt,
            reader: self.reader.clone(),
            memory_budget: self.store.config().memory_budget,
            stop: TaskStop::default(),
        }
    }

    pub fn create_shuffle(&self, m: proto::CreateShuffle) -> Result<()> {
        let schema = decode_schema(&m.schema_ipc)?;
        let partitioner = m
            .partitioner
            .ok_or_else(|| Error::invalid("create_shuffle needs a partitioner"))?;
        // Validate the partitioner against the schema now rather than in every map task.
        Partitioner::from_proto(&partitioner, &schema, m.partitions, 0)?;
        let combiner = match &m.combine {
            Some(c) => Some(self.sources.combiner(c, &schema)?),
            None => None,
        };
        self.store.create_shuffle(ShuffleInfo {
            id: ShuffleId(m.shuffle_id),
            schema,
            partitions: m.partitions,
            partitioner,
            combiner,
            order: m.order,
            group: m.group,
        })
    }

    /// Run a map attempt as an abortable task. Its blocks stay pending until the driver
    /// commits the attempt. A failed attempt, or one whose caller went away (the RPC was
    /// cancelled or its connection dropped), is aborted and its blocks removed.
    pub async fn run_map(
        self: &Arc<Self>,
        task: proto::MapTask,
        input: BatchStream,
        stop: TaskStop,
    ) -> Result<proto::TaskResult> {
        let shuffle = ShuffleId(task.shuffle_id);
        let key = (shuffle, task.map_id, task.attempt);
        let info = self.store.shuffle_info(shuffle)?;
        let cfg = MapConfig {
            checksum: !task.skip_checksum,
            pack: task.pack,
            ..self.map_cfg
        };
        let push = crate::push::Pusher::for_task(&task, info.partitions, self.reader.clone())?;
        let hint = task
            .source
            .as_ref()
            .map_or(0, |s| self.sources.memory_hint(&s.kind, &s.payload));
        let me = self.clone();
        let granted = stop.clone();
        let handle = crate::compute::runtime().spawn(async move {
            // Waited for inside the task, so a cancel or a dropped shuffle also ends a task
            // still waiting; held until the task ends: its buffers come out of the budget
            // (and by its source's own threads until they stop, see `TaskStop::hold`).
            let grant = me
                .admission
                .admit(
                    info.rank(),
                    // A split's estimate can be anything: at most the whole budget.
                    cfg.task_grant()
                        .saturating_add(hint)
                        .min(me.admission.capacity()),
                )
                .await;
            let _grant = Arc::new(grant);
            granted.granted(&_grant);
            run_map(
                &me.store,
                &info,
                task.map_id,
                task.attempt,
                input,
                cfg,
                push,
            )
            .await
        });
        {
            let mut tasks = lock(&self.tasks);
            if tasks.contains_key(&key) {
                handle.abort();
                return Err(Error::invalid(format!(
                    "map {} attempt {} of shuffle {shuffle} is already running",
                    task.map_id, task.attempt
                )));
            }
            tasks.insert(key, (handle.abort_handle(), stop));
        }
        // Dropped with this future unless disarmed: aborts the task and removes its blocks.
        let mut guard = AttemptGuard {
            state: self.clone(),
            key,
            armed: true,
        };
        let joined = handle.await;
        lock(&self.tasks).remove(&key);
        let result = match joined {
            Ok(r) => r,
            Err(e) if e.is_cancelled() => Err(Error::Cancelled(format!(
                "map {} attempt {} of shuffle {shuffle}",
                task.map_id, task.attempt
            ))),
            Err(e) => Err(Error::Cluster(format!("map task panicked: {e}"))),
        };
        let out = result?;
        guard.armed = false;
        Ok(proto::TaskResult {
            blocks: out.blocks.iter().map(Into::into).collect(),
            input_rows: out.input.rows,
            input_checksum: out.input.sum,
            input_bytes: out.input_bytes,
            seconds: out.seconds,
            spilled_bytes: out.spilled_bytes,
            pushed: out.pushed,
            partition_rows: out.partition_rows,
        })
    }

    /// Merge task (merged strategy): merge the committed blocks of `m.maps` held here into few
    /// large blocks per partition, pending as attempt `m.attempt` of group `m.group` until the
    /// driver commits it. Aborted (its blocks removed) if the caller goes away first. With
    /// push placement, a forward instead ([`crate::forward`]).
    pub async fn merge(self: &Arc<Self>, m: proto::MergeTask) -> Result<proto::TaskResult> {
        let shuffle = ShuffleId(m.shuffle_id);
        if m.group < crate::store::MERGE_GROUP_BASE || m.maps.is_empty() {
            return Err(Error::invalid(format!(
                "merge task needs a group id >= {} and at least one map (got group {}, {} maps)",
                crate::store::MERGE_GROUP_BASE,
                m.group,
                m.maps.len()
            )));
        }
        let info = self.store.shuffle_info(shuffle)?;
        let mut guard = AttemptGuard {
            state: self.clone(),
            key: (shuffle, m.group, m.attempt),
            armed: true,
        };
        let (store, cfg) = (self.store.clone(), self.map_cfg);
        let out = if m.push_to.is_empty() {
            let ids = self.store.committed_blocks_of(shuffle, &m.maps)?;
            let grant = self.admission.admit(info.rank(), cfg.task_grant()).await;
            tokio::task::spawn_blocking(move || {
                let _grant = grant;
                crate::task::run_merge(&store, &info, ids, m.group, m.attempt, cfg)
            })
            .await
            .map_err(|e| Error::Cluster(format!("merge task failed to run: {e}")))??
        } else {
            // A forward holds a few blocks at a time (those queued for each holder): no
            // grant beyond the store's budget.
            crate::forward::run(&store, self.reader.clone(), &m).await?
        };
        guard.armed = false;
        Ok(proto::TaskResult {
            blocks: out.blocks.iter().map(Into::into).collect(),
            input_rows: out.input.rows,
            input_checksum: 0,
            input_bytes: out.input_bytes,
            seconds: out.seconds,
            spilled_bytes: out.spilled_bytes,
            pushed: out.pushed,
            partition_rows: vec![],
        })
    }

    /// Calibration for the `auto` strategy: measure this worker's rates
    /// ([`crate::calibrate`]); without `measure`, nothing.
    pub async fn calibrate(&self, m: proto::CalibrateTask) -> Result<proto::Calibration> {
        let dir = self.store.config().spill_dir.clone();
        crate::calibrate::on_worker(&self.admission, dir, m).await
    }

    /// Fold task (streaming strategy): read the listed blocks of one partition from their
    /// workers, fold them into this partition's running state and return its partial result.
    pub async fn fold(&self, m: proto::FoldTask) -> Result<proto::FoldResult> {
        let start = Instant::now();
        let shuffle = ShuffleId(m.shuffle_id);
        let info = self.store.shuffle_info(shuffle)?;
        if m.partition >= info.partitions {
            return Err(Error::invalid(format!(
                "partition {} out of range: shuffle {shuffle} has {}",
                m.partition, info.partitions
            )));
        }
        let reducer = self.sources.reducer(&m.reducer)?;
        let key = (shuffle, m.partition);
        // A fold of this state still running (its call was cancelled): wait for it.
        let deadline = Instant::now() + Duration::from_secs(120);
        while lock(&self.folding).contains(&key) {
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!("the running fold of {shuffle} partition {}", m.partition),
                    seconds: 120.0,
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A round folded here already (retried after another worker was lost): the partial
        // result of the state as it is, nothing folded twice.
        let folded = lock(&self.fold_rounds).get(&key).copied().unwrap_or(0);
        if m.round < folded {
            return self
                .emit_again(key, reducer, m.payload.clone(), start)
                .await;
        }
        let batches = self.read_blocks(shuffle, m.partition, &m.blocks).await?;
        let read_s = start.elapsed().as_secs_f64();
        let state = {
            let mut states = lock(&self.fold_states);
            match (m.first, states.get_mut(&key)) {
                (true, None) => {
                    states.insert(key, None);
                    None
                }
                (false, Some(slot)) => Some(slot.take().ok_or_else(|| {
                    Error::Precondition(format!(
                        "reduce state of {shuffle} partition {} is busy or was lost by a \
                         failed fold",
                        m.partition
                    ))
                })?),
                (true, Some(_)) => {
                    return Err(Error::invalid(format!(
                        "first fold of {shuffle} partition {} but a state exists",
                        m.partition
                    )))
                }
                (false, None) => {
                    return Err(Error::Cluster(format!(
                        "no reduce state for {shuffle} partition {} on this worker (was it \
                         restarted?)",
                        m.partition
                    )))
                }
            }
        };
        let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
        let payload = m.payload.clone();
        let schema = info.schema.clone();
        // The blocking task puts the folded state back and records the round itself, so a
        // cancelled call (the driver gave up on the round after another worker was lost)
        // leaves a consistent state that a retried round finds folded.
        let (states, rounds, folding) = (
            self.fold_states.clone(),
            self.fold_rounds.clone(),
            self.folding.clone(),
        );
        let busy = Folding::start(folding, key);
        let round = m.round;
        let folded = tokio::task::spawn_blocking(move || {
            let _busy = busy;
            (|| {
                let state = reducer.fold(&payload, state, batches, schema)?;
                let out = reducer.emit(&payload, &state);
                // Not if the shuffle was dropped meanwhile: nothing of it may come back.
                if let Some(slot) = lock(&states).get_mut(&key) {
                    *slot = Some(state);
                    lock(&rounds).insert(key, round + 1);
                }
                out
            })()
        })
        .await
        .map_err(|e| Error::Cluster(format!("fold task panicked: {e}")))?;
        let (schema, out) = folded?;
        let result_ipc = crate::block::encode_block(&schema, &out, Compression::None)?;
        tracing::debug!(
            %shuffle, partition = m.partition, round, read_s, rows,
            seconds = start.elapsed().as_secs_f64(), "fold task"
        );
        Ok(proto::FoldResult {
            result_ipc: result_ipc.to_vec(),
            rows_folded: rows,
            blocks_folded: m.blocks.len() as u64,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// The partial result of a fold state as it is (a retried round), the state kept.
    async fn emit_again(
        &self,
        key: (ShuffleId, u32),
        reducer: Arc<dyn crate::task::Reducer>,
        payload: Vec<u8>,
        start: Instant,
    ) -> Result<proto::FoldResult> {
        let state = lock(&self.fold_states)
            .get_mut(&key)
            .and_then(|s| s.take())
            .ok_or_else(|| {
                Error::Cluster(format!(
                    "reduce state of {} partition {} is busy or was lost",
                    key.0, key.1
                ))
            })?;
        // Put back by the blocking task itself (see `fold`).
        let (states, folding) = (self.fold_states.clone(), self.folding.clone());
        let busy = Folding::start(folding, key);
        let out = tokio::task::spawn_blocking(move || {
            let _busy = busy;
            let out = reducer.emit(&payload, &state);
            if let Some(slot) = lock(&states).get_mut(&key) {
                *slot = Some(state);
            }
            out
        })
        .await
        .map_err(|e| Error::Cluster(format!("fold task panicked: {e}")))?;
        let (schema, out) = out?;
        let result_ipc = crate::block::encode_block(&schema, &out, Compression::None)?;
        Ok(proto::FoldResult {
            result_ipc: result_ipc.to_vec(),
            rows_folded: 0,
            blocks_folded: 0,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// Read the listed blocks of one partition, in order: blocks this worker holds straight from
    /// its store, the others over Flight, several at a time.
    async fn read_blocks(
        &self,
        shuffle: ShuffleId,
        partition: u32,
        blocks: &[proto::BlockLocation],
    ) -> Result<Vec<arrow::array::RecordBatch>> {
        let mut reads = Vec::with_capacity(blocks.len());
        for loc in blocks {
            let id: crate::block::BlockId = loc
                .key
                .as_ref()
                .ok_or_else(|| Error::invalid("fold block without a key"))?
                .into();
            if id.shuffle != shuffle || id.partition != partition {
                return Err(Error::invalid(format!(
                    "fold of {shuffle} partition {partition} given block {id}"
                )));
            }
            let client = if self.store.meta(&id).is_ok() {
                None
            } else {
                Some(self.reader.client(0, &loc.peer)?)
            };
            reads.push(async move {
                match client {
                    None => tokio::task::block_in_place(|| self.store.read_batches(&id)),
                    Some(c) => c.read_block(id).await?.try_collect::<Vec<_>>().await,
                }
            });
        }
        let parts: Vec<Vec<_>> = futures::stream::iter(reads)
            .buffered(FOLD_READS)
            .try_collect()
            .await?;
        Ok(parts.into_iter().flatten().collect())
    }

    /// Forget the reduce states of a dropped shuffle.
    pub fn drop_fold_states(&self, shuffle: ShuffleId) {
        lock(&self.fold_states).retain(|(s, _), _| *s != shuffle);
        lock(&self.fold_rounds).retain(|(s, _), _| *s != shuffle);
    }

    /// Reduce task: pull one partition from every peer and fold it into a sink.
    pub async fn run_reduce(&self, m: proto::ReduceTask) -> Result<proto::TaskResult> {
        if m.sink != "checksum" {
            return Err(Error::invalid(format!(
                "unknown reduce sink {:?} (known: [\"checksum\"])",
                m.sink
            )));
        }
        let start = Instant::now();
        let mut total = Checksum::default();
        let mut bytes = 0u64;
        let mut stream = self
            .reader
            .read_partition(&m.peers, ShuffleId(m.shuffle_id), m.partition);
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            bytes += batch.get_array_memory_size() as u64;
            total.add(tokio::task::block_in_place(|| Checksum::of_batch(&batch))?);
        }
        Ok(proto::TaskResult {
            blocks: vec![],
            input_rows: total.rows,
            input_checksum: total.sum,
            input_bytes: bytes,
            seconds: start.elapsed().as_secs_f64(),
            spilled_bytes: 0,
            pushed: vec![],
            partition_rows: vec![],
        })
    }

    /// Abort one map attempt: stop it if it runs and remove its uncommitted blocks.
    pub fn cancel(&self, shuffle: ShuffleId, map: u32, attempt: u32) {
        if let Some((h, stop)) = lock(&self.tasks).remove(&(shuffle, map, attempt)) {
            stop.cancel();
            h.abort();
        }
        self.store.abort(shuffle, map, attempt);
    }

    pub fn cancel_shuffle(&self, shuffle: ShuffleId) {
        let mut tasks = lock(&self.tasks);
        tasks.retain(|(s, _, _), (h, stop)| {
            if *s == shuffle {
                stop.cancel();
                h.abort();
            }
            *s != shuffle
        });
    }

    pub fn stats(&self) -> proto::WorkerStats {
        let m = self.store.metrics();
        let a = self.admission.metrics();
        let (operators, unspillable) = self.sources.memory_peaks();
        proto::WorkerStats {
            blocks: m.blocks,
            memory_bytes: m.memory_bytes,
            memory_budget: m.memory_budget,
            spilled_bytes: m.spilled_bytes,
            spill_files: m.spill_files,
            restored_bytes: m.restored_bytes,
            peak_rss_bytes: crate::transport::peak_rss_bytes(),
            rss_bytes: crate::transport::rss_bytes(),
            admitted_tasks: a.admitted,
            waited_tasks: a.waited,
            overdraft_tasks: a.overdrafts,
            peak_granted_bytes: a.peak_reserved,
            peak_running_tasks: a.peak_running,
            granted_bytes: self.admission.reserved(),
            running_tasks: self.admission.running(),
            peak_operator_bytes: operators,
            peak_unspillable_bytes: unspillable,
            shuffles: m.shuffles,
            spilled_blocks: m.spilled_blocks,
            restored_blocks: m.restored_blocks,
            rpcs: self.rpcs.load(std::sync::atomic::Ordering::Relaxed),
        }
    }
}

/// Aborts a map attempt and removes its pending blocks when dropped armed (the attempt failed,
/// or the call that runs it was dropped).
/// A map attempt: (shuffle, map, attempt).
type AttemptKey = (ShuffleId, u32, u32);

struct AttemptGuard {
    state: Arc<WorkerState>,
    key: (ShuffleId, u32, u32),
    armed: bool,
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        if self.armed {
            let (shuffle, map, attempt) = self.key;
            self.state.cancel(shuffle, map, attempt);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Build the worker state from its arguments, the token and the address it advertises.
pub fn build_state(
    args: &WorkerArgs,
    creds: &crate::transport::Credentials,
    sources: SourceRegistry,
    addr: String,
) -> Result<WorkerState> {
    let compression: Compression = args.compression.parse()?;
    let store = BlockStore::new(StoreConfig {
        memory_budget: args.memory_budget,
        spill_dir: args.spill_dir.clone(),
        segment_bytes: args.segment_bytes.max(1),
    })?;
    let (admission, store) = if !crate::admission::enabled() {
        (Admission::new(u64::MAX), store)
    } else {
        // Map buffers are at least 4 MiB whatever the budget: under four tasks' grants (a
        // budget set tiny to make the store spill) the tasks would run one at a time.
        let grant = MapConfig::for_budget(args.memory_budget).task_grant();
        let a = Admission::new(args.memory_budget.max(4 * grant));
        (a.clone(), store.sharing(a))
    };
    let store = Arc::new(store);
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let reader = Arc::new(PeerReader::new(
        creds,
        timeout,
        Some((addr.clone(), store.clone())),
    ));
    Ok(WorkerState {
        id: args.id.clone(),
        store,
        addr,
        reader,
        sources,
        map_cfg: MapConfig {
            compression,
            ..MapConfig::for_budget(args.memory_budget)
        },
        admission,
        read_timeout: Duration::from_secs(args.timeout_secs.max(1)),
        rpcs: std::sync::atomic::AtomicU64::new(0),
        tasks: Mutex::new(HashMap::new()),
        fold_states: Default::default(),
        fold_rounds: Default::default(),
        folding: Default::default(),
        lose_commit_replies: args.fault_lose_commit_replies.into(),
    })
}

/// Serve Flight on `args.listen` until the process ends; `ready` gets the bound address.
pub async fn serve(
    args: WorkerArgs,
    token: String,
    sources: SourceRegistry,
    ready: impl FnOnce(SocketAddr, &Arc<WorkerState>),
) -> Result<()> {
    if token.is_empty() {
        return Err(Error::invalid(format!(
            "the worker needs a token: in ${TOKEN_ENV}, or on stdin with --token-stdin"
        )));
    }
    let tls = args.tls()?;
    if tls.is_none() && !args.listen.ip().is_loopback() && !args.insecure {
        return Err(Error::invalid(format!(
            "refusing to listen on {} without TLS: the token and every block would cross the \
             network in clear (pass --tls-cert, --tls-key and --tls-ca, or --insecure)",
            args.listen
        )));
    }
    let creds = crate::transport::Credentials {
        token: token.clone(),
        tls: tls.as_ref().map(|t| t.client()),
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::Cluster(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Cluster(format!("no local address: {e}")))?;
    let state = Arc::new(build_state(&args, &creds, sources, addr.to_string())?);
    tokio::spawn(crate::allocator::trim_when_idle(state.admission.clone()));
    let expected = bearer(&token);
    let counted = state.clone();
    let check = move |req: tonic::Request<()>| -> Result<tonic::Request<()>, tonic::Status> {
        counted
            .rpcs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match req
            .metadata()
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
        {
            // In constant time: how long a wrong token takes to refuse tells nothing of it.
            Some(v) if bool::from(v.as_bytes().ct_eq(expected.as_bytes())) => Ok(req),
            Some(_) => Err(tonic::Status::unauthenticated("wrong cluster token")),
            None => Err(tonic::Status::unauthenticated("missing cluster token")),
        }
    };
    let flight = FlightServiceServer::new(WorkerService {
        state: state.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let service = tonic::service::interceptor::InterceptedService::new(flight, check);
    ready(addr, &state);
    let incoming = crate::transport::listen::capped(listener, args.max_connections);
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = &tls {
        server = server
            .tls_config(tls.config())
            .map_err(|e| Error::invalid(format!("bad TLS certificate or key: {e}")))?;
    }
    server
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(Some(crate::transport::MAX_STREAMS_PER_CONNECTION))
        .http2_keepalive_interval(Some(crate::transport::KEEPALIVE))
        .http2_keepalive_timeout(Some(crate::transport::KEEPALIVE_TIMEOUT))
        .add_service(service)
        .serve_with_incoming(incoming)
        .await
        .map_err(|e| Error::Cluster(format!("worker server failed: {e}")))
}

/// Log to stderr, filtered by `$FLIGHTSHUFFLE_LOG` (e.g. `info`, `exchange=debug`); default
/// `warn`. Does nothing when a subscriber is already set.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FLIGHTSHUFFLE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// Entry point shared by the worker binary and the Python module: parse `argv`, start a
/// runtime, serve, and print the ready line. Returns when the server stops.
pub fn main_with_args(argv: Vec<String>, sources: SourceRegistry) -> Result<()> {
    use clap::Parser;
    let args = WorkerArgs::try_parse_from(argv).map_err(|e| Error::invalid(e.to_string()))?;
    crate::allocator::limit_malloc_arenas();
    init_logging();
    let token = if args.token_stdin {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| Error::Cluster(format!("cannot read the token from stdin: {e}")))?;
        line.trim().to_string()
    } else {
        std::env::var(TOKEN_ENV).unwrap_or_default()
    };
    // Out of the environment before any thread starts: user code running in this process
    // (Python map tasks) and every process it starts would otherwise see the token.
    std::env::remove_var(TOKEN_ENV);
    let store_files = Arc::new(std::sync::OnceLock::<Arc<BlockStore>>::new());
    if args.exit_with_stdin {
        let store_files = store_files.clone();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
            tracing::info!("standard input closed: the driver is gone, exiting");
            // Nobody will read these blocks again; a driver killed without cleaning up leaves
            // no spill files behind (its own directory is swept by the next local cluster).
            // Only what the store wrote goes: `--spill-dir` may name a directory with other
            // files in it.
            if let Some(store) = store_files.get() {
                store.remove_files();
            }
            std::process::exit(0);
        });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("flightshuffle-worker")
        .build()
        .map_err(|e| Error::Cluster(format!("cannot start runtime: {e}")))?;
    let id = args.id.clone();
    rt.block_on(serve(args, token, sources, |addr, state| {
        use std::io::Write;
        let _ = store_files.set(state.store.clone());
        let mut out = std::io::stdout();
        let _ = writeln!(out, "{READY_LINE} {addr}");
        let _ = out.flush();
        tracing::info!(worker = %id, %addr, "worker listening");
    }))
}
