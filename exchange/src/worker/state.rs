//! A worker's state ([`WorkerState`]): its block store, peers, sources, admission, and the
//! map, merge and fold tasks it runs. It is built from a [`super::config::WorkerConfig`]; its Flight
//! service ([`super::service`]) serves calls over it.

use crate::admission::Admission;
use crate::block::{decode_schema, Compression, ShuffleId};
use crate::checksum::Checksum;
use crate::error::{Error, Result};
use crate::partitioner::Partitioner;
use crate::proto;
use crate::source::{
    BatchStream, ReduceState, ShuffleReader, SourceRegistry, TaskContext, TaskStop,
};
use crate::store::{BlockStore, ShuffleInfo, StoreConfig};
use crate::sync::lock;
use crate::task::{run_map, MapConfig};
use crate::transport::peers::PeerReader;
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::AbortHandle;

/// Block reads a fold task keeps in flight.
const FOLD_READS: usize = 8;

/// Printed on stdout once the worker listens: `FLIGHTSHUFFLE_WORKER_READY <addr>`.
pub const READY_LINE: &str = "FLIGHTSHUFFLE_WORKER_READY";
/// Environment variable carrying the cluster token to a worker process.
pub const TOKEN_ENV: &str = "FLIGHTSHUFFLE_TOKEN";

/// A partition's fold state on this worker (None while a fold has it).
pub(crate) type FoldSlot = Option<ReduceState>;

/// Everything a worker's Flight service shares.
pub struct WorkerState {
    /// The worker's name, used in logs and errors.
    pub id: String,
    /// Drawn at random when the state is made: tells a restarted process at the same address
    /// from the one before (see [`crate::proto::Health`]).
    pub instance: u64,
    /// The worker's block store.
    pub store: Arc<BlockStore>,
    /// The address this worker advertises (its peers' name for it).
    pub addr: String,
    /// Pooled clients to peers; reads of this worker's own blocks go to its store.
    pub reader: Arc<PeerReader>,
    /// The task sources, reducers and combiners tasks and shuffles name, by kind.
    pub sources: SourceRegistry,
    /// How the worker's map tasks are tuned (buffer and block sizes, compression).
    pub map_cfg: MapConfig,
    /// Grants of the worker's budget to the tasks it runs (see [`crate::admission`]).
    pub admission: Arc<Admission>,
    /// How long a read may wait for blocks that are not there yet.
    pub read_timeout: Duration,
    /// Flight calls served (counted when their token is checked).
    pub rpcs: std::sync::atomic::AtomicU64,
    /// Running map attempts by (shuffle, map, attempt).
    pub(crate) tasks: Mutex<HashMap<AttemptKey, (AbortHandle, TaskStop)>>,
    /// Running reduce states of the streaming strategy, per (shuffle, partition). `None` marks
    /// a state that is being folded or was lost by a failed fold: the next fold fails loudly
    /// instead of silently starting over.
    pub(crate) fold_states: Arc<Mutex<HashMap<(ShuffleId, u32), FoldSlot>>>,
    /// Rounds folded into each state so far (a fold of an earlier round is a retry).
    pub(crate) fold_rounds: Arc<Mutex<HashMap<(ShuffleId, u32), u32>>>,
    /// States being folded now. The fold finishes and puts its state back even when the
    /// call that asked for it is cancelled; a later fold of the same state waits for it.
    pub(crate) folding: FoldKeys,
    /// Commit replies still to lose (fault injection, `--fault-lose-commit-replies`).
    pub lose_commit_replies: std::sync::atomic::AtomicU32,
    /// Durable shuffles: the store client each writes its map outputs to, and the prefix of
    /// its objects there ([`crate::storage`]).
    pub(crate) durable: Mutex<HashMap<ShuffleId, (Arc<crate::storage::Storage>, String)>>,
    /// One client per object store in use.
    pub(crate) storages: Mutex<Vec<(crate::storage::StorageConfig, Arc<crate::storage::Storage>)>>,
    /// One client per store spill segments move to (used on the tier's own runtime only).
    pub(crate) tier_storages:
        Mutex<Vec<(crate::storage::StorageConfig, Arc<crate::storage::Storage>)>>,
}

pub(crate) type FoldKeys = Arc<Mutex<std::collections::HashSet<(ShuffleId, u32)>>>;

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
    /// A worker made from `cfg`: its block store (spilling into `cfg.spill_dir`), its share of
    /// the budget for tasks, and its reader of peers (with `creds`), advertised as `addr`.
    pub fn new(
        cfg: &super::config::WorkerConfig,
        creds: &crate::transport::Credentials,
        sources: SourceRegistry,
        addr: String,
    ) -> Result<WorkerState> {
        let store = BlockStore::new(StoreConfig {
            memory_budget: cfg.memory_budget,
            spill_dir: cfg.spill_dir.clone(),
            segment_bytes: cfg.segment_bytes.max(1),
            disk_budget: cfg.disk_budget,
        })?;
        let (admission, store) = if !crate::admission::enabled() {
            (Admission::new(u64::MAX), store)
        } else {
            // Map buffers are at least 4 MiB whatever the budget: under four tasks' grants (a
            // budget set tiny to make the store spill) the tasks would run one at a time.
            let grant = MapConfig::for_budget(cfg.memory_budget).task_grant();
            let a = Admission::new(cfg.memory_budget.max(4 * grant));
            (a.clone(), store.sharing(a))
        };
        let store = Arc::new(store);
        let reader = Arc::new(PeerReader::new(
            creds,
            cfg.timeout,
            Some((addr.clone(), store.clone())),
        ));
        Ok(WorkerState {
            id: cfg.id.clone(),
            instance: rand::random::<u64>(),
            store,
            addr,
            reader,
            sources,
            map_cfg: MapConfig {
                compression: cfg.compression,
                ..MapConfig::for_budget(cfg.memory_budget)
            },
            admission,
            read_timeout: cfg.timeout,
            rpcs: std::sync::atomic::AtomicU64::new(0),
            tasks: Mutex::new(HashMap::new()),
            fold_states: Default::default(),
            fold_rounds: Default::default(),
            folding: Default::default(),
            lose_commit_replies: cfg.lose_commit_replies.into(),
            durable: Default::default(),
            storages: Default::default(),
            tier_storages: Default::default(),
        })
    }

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

    /// Register a shuffle in the block store, after checking its partitioner and combiner.
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
        if let Some(storage) = &m.storage {
            self.set_durable(ShuffleId(m.shuffle_id), storage)?;
        }
        self.store.create_shuffle(ShuffleInfo {
            id: ShuffleId(m.shuffle_id),
            schema,
            partitions: m.partitions,
            partitioner,
            combiner,
            order: m.order,
            group: m.group,
        })?;
        match &m.storage {
            Some(storage) => {
                if storage.read_through {
                    self.store.expect_read_through(ShuffleId(m.shuffle_id))?;
                }
                self.use_tier(ShuffleId(m.shuffle_id), storage)
            }
            None => Ok(()),
        }
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
        let mut push = crate::push::Pusher::for_task(&task, info.partitions, self.reader.clone())?;
        // (A parity shuffle's lost blocks are rebuilt from parity: it writes no object.)
        let durable = task.parity == 0 && self.is_durable(shuffle);
        if let Some(p) = push.as_mut().filter(|_| durable) {
            // Its pushed blocks go into the map's object too.
            p.keep_sent();
        }
        let hint = task
            .source
            .as_ref()
            .map_or(0, |s| self.sources.memory_hint(&s.kind, &s.payload));
        let me = self.clone();
        let granted = stop.clone();
        let handle = crate::compute::runtime().spawn(async move {
            let queued = std::time::Instant::now();
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
            let waited = queued.elapsed().as_secs_f64();
            let _grant = Arc::new(grant);
            granted.granted(&_grant);
            let out = run_map(
                &me.store,
                &info,
                task.map_id,
                task.attempt,
                input,
                cfg,
                push,
            )
            .await;
            out.map(|o| (o, waited))
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
        let (out, admission_wait_seconds) = result?;
        // A durable shuffle's output is in its store before the attempt reports done (a
        // failed write fails the attempt, the guard removing its blocks).
        let object = match durable {
            true => {
                self.write_object(
                    shuffle,
                    task.map_id,
                    task.attempt,
                    task.worker_index,
                    &out.blocks,
                    &out.sent,
                )
                .await?
            }
            false => None,
        };
        guard.armed = false;
        Ok(proto::TaskResult {
            object,
            blocks: out.blocks.iter().map(Into::into).collect(),
            input_rows: out.input.rows,
            input_checksum: out.input.sum,
            input_bytes: out.input_bytes,
            seconds: out.seconds,
            spilled_bytes: out.spilled_bytes,
            pushed: out.pushed,
            partition_rows: out.partition_rows,
            admission_wait_seconds,
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
        let mut waited = 0.0;
        let out = if m.push_to.is_empty() {
            let ids = self.store.committed_blocks_of(shuffle, &m.maps)?;
            let queued = std::time::Instant::now();
            let grant = self.admission.admit(info.rank(), cfg.task_grant()).await;
            waited = queued.elapsed().as_secs_f64();
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
            object: None,
            admission_wait_seconds: waited,
        })
    }

    /// Calibration for the `auto` strategy: measure this worker's rates
    /// ([`crate::calibrate`]); without `measure`, nothing.
    pub async fn calibrate(&self, m: proto::CalibrateTask) -> Result<proto::Calibration> {
        let dir = self.store.config().spill_dir.clone();
        super::probe::on_worker(&self.admission, dir, m).await
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
        reducer: Arc<dyn crate::source::Reducer>,
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
            object: None,
            admission_wait_seconds: 0.0,
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

    /// Abort every running map attempt of `shuffle`.
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

    /// The worker's counters: block store, memory, task admission and calls served.
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
            storage: Some(self.storage_stats()),
            disk_bytes: m.disk_bytes,
            tiered_segments: m.tiered_segments,
            tiered_bytes: m.tiered_bytes,
        }
    }
}

/// Aborts a map attempt and removes its pending blocks when dropped armed (the attempt failed,
/// or the call that runs it was dropped).
/// A map attempt: (shuffle, map, attempt).
pub(crate) type AttemptKey = (ShuffleId, u32, u32);

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
