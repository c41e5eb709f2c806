//! The driver: the cluster view, task submission, block refs, lineage and failure detection.
//!
//! Strategies call only this API. Submitting a task returns at once with a handle (a future of
//! its block refs); lineage records how each map output was produced. A worker is declared
//! lost when a call to it fails and a health check with a short timeout confirms it; the error
//! then names the worker and counts the blocks it held, and the worker's slot is given a
//! replacement where the cluster can start one ([`live`]). The commit side (merge groups,
//! commits on every holder, cancels) is in [`commit`].

mod commit;
mod create;
mod direct;
mod durable;
mod live;
mod losses;
mod manifest;
mod parity;
mod placement;
mod recover;
mod retire;
mod spec;
mod submit;

pub(crate) use manifest::{Made, ShuffleEntry};

use crate::block::{BlockId, ShuffleId, Slice};
use crate::error::{Error, Result};
use crate::proto;
use crate::source::BatchStream;
use crate::sync::lock;
use crate::transport::actions;
use crate::transport::client::WorkerClient;
use arrow::datatypes::SchemaRef;
use futures::StreamExt;
pub(crate) use losses::{count_loss, MAX_RERUNS};
pub use placement::Placement;
pub use spec::{BlockRef, Lineage, MapDone, MapInput, Progress, Retired, ShuffleSpec};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The driver's call deadlines and health checks.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// Deadline of one call (a task, an action) and idle timeout of a stream.
    pub rpc_timeout: Duration,
    /// How often running work checks that every worker is alive.
    pub health_interval: Duration,
    /// Deadline of one health check.
    pub health_timeout: Duration,
    /// Durable shuffles: the object store every shuffle's map outputs are also written to
    /// ([`crate::storage`]); None keeps shuffle data on the workers only.
    pub storage: Option<crate::storage::StorageConfig>,
    /// Whether shuffles with a store write their map outputs to it (durable); false keeps the
    /// store as the tier below the workers' local disk only (past their disk budget).
    pub durable: bool,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            rpc_timeout: Duration::from_secs(600),
            health_interval: Duration::from_secs(1),
            health_timeout: Duration::from_secs(10),
            storage: None,
            durable: true,
        }
    }
}

/// Starts a new worker process in place of lost worker `i` and returns its address (blocking;
/// the local cluster provides one, see [`Driver::set_replacer`]).
pub type Replacer = Arc<dyn Fn(usize) -> Result<String> + Send + Sync>;

/// How long a call that needs every worker waits for a lost one's replacement.
pub const REPLACE_TIMEOUT: Duration = Duration::from_secs(60);

/// The driver of one cluster: its workers, task submission and commits, block refs,
/// lineage and failure detection.
pub struct Driver {
    /// One client per worker slot; a lost worker's slot gets its replacement's client.
    workers: std::sync::RwLock<Vec<WorkerClient>>,
    /// Replacements started per slot (the slot's generation).
    generations: Vec<std::sync::atomic::AtomicU64>,
    replacer: Mutex<Option<Replacer>>,
    /// Why the last replacement of a slot failed, until one succeeds (see
    /// [`Driver::wait_all_live`]).
    replace_failures: Mutex<std::collections::HashMap<usize, String>>,
    /// The cluster is stopping: workers going away are not news ([`Driver::stop_replacing`]).
    stopping: AtomicBool,
    /// Changes whenever a slot becomes live again (or its replacement failed).
    live: tokio::sync::watch::Sender<u64>,
    me: std::sync::Weak<Driver>,
    creds: crate::transport::Credentials,
    alive: Vec<AtomicBool>,
    /// Worker slots in use: `0..active` (fewer than the slots above once workers were
    /// retired, see [`retire`]).
    active: std::sync::atomic::AtomicUsize,
    /// Replacements started so far, over all slots.
    replaced: std::sync::atomic::AtomicU64,
    /// Work done so far ([`Driver::progress`]).
    progress: Progress,
    cfg: DriverConfig,
    /// One entry per shuffle: its registration, placement, attempts, claims and manifest
    /// ([`manifest`]).
    shuffles: Mutex<HashMap<ShuffleId, ShuffleEntry>>,
    /// Map outputs recomputed after their worker was lost (lineage recovery).
    recomputed: std::sync::atomic::AtomicU64,
    /// Pooled reader over the same connections (for engines reading on the driver).
    reader: Arc<crate::transport::peers::PeerReader>,
    /// This machine's calibration, measured on first use (`auto`).
    calibration: tokio::sync::OnceCell<proto::Calibration>,
    /// The event log open now ([`Driver::log_events`]).
    events: Mutex<Option<Arc<crate::events::EventLog>>>,
    /// Parity shuffles and their committed maps ([`parity`]).
    parity: Mutex<manifest::ParityState>,
    /// Held (read) by each commit in progress; [`Driver::settle`] waits for them to end.
    committing: Arc<tokio::sync::RwLock<()>>,
    /// Jobs (queries) run again whole after a lost worker, their partial results dropped.
    reruns: std::sync::atomic::AtomicU64,
    /// Shuffles created so far: the next one's `CreateShuffle.order`.
    shuffle_order: std::sync::atomic::AtomicU64,
    /// The store durable shuffles write to ([`durable`]).
    storage: Option<Arc<crate::storage::RunStore>>,
    /// Stores that queries chose besides the cluster's ([`Driver::use_storage`]), kept open.
    stores: Mutex<Vec<Arc<crate::storage::RunStore>>>,
    /// Blocks restored from the store after their worker was lost.
    restored: std::sync::atomic::AtomicU64,
    /// Map outputs a restore gave up on (left to lineage).
    restore_failures: std::sync::atomic::AtomicU64,
}

impl Driver {
    /// Read `shuffle`'s entry (None: not registered, or dropped).
    pub(crate) fn with_shuffle<R>(
        &self,
        shuffle: ShuffleId,
        f: impl FnOnce(&ShuffleEntry) -> R,
    ) -> Option<R> {
        lock(&self.shuffles).get(&shuffle).map(f)
    }

    /// Change `shuffle`'s entry if it has one.
    pub(crate) fn with_shuffle_mut<R>(
        &self,
        shuffle: ShuffleId,
        f: impl FnOnce(&mut ShuffleEntry) -> R,
    ) -> Option<R> {
        lock(&self.shuffles).get_mut(&shuffle).map(f)
    }

    /// Change `shuffle`'s entry, made empty if there is none yet.
    pub(crate) fn update_shuffle<R>(
        &self,
        shuffle: ShuffleId,
        f: impl FnOnce(&mut ShuffleEntry) -> R,
    ) -> R {
        f(lock(&self.shuffles).entry(shuffle).or_default())
    }

    /// A driver of the workers at `addrs` (slot i at `addrs[i]`), dialing with `creds`; connects
    /// lazily.
    pub fn connect(
        addrs: &[String],
        creds: &crate::transport::Credentials,
        cfg: DriverConfig,
    ) -> Result<Arc<Self>> {
        if addrs.is_empty() {
            return Err(Error::invalid("a cluster needs at least one worker"));
        }
        let workers = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| WorkerClient::new(i, a, creds, cfg.rpc_timeout))
            .collect::<Result<Vec<_>>>()?;
        let reader = Arc::new(crate::transport::peers::PeerReader::with_clients(
            creds,
            cfg.rpc_timeout,
            &workers,
        ));
        let storage = cfg
            .storage
            .as_ref()
            .map(crate::storage::RunStore::open)
            .transpose()?
            .map(Arc::new);
        Ok(Arc::new_cyclic(|me| Driver {
            storage,
            stores: Default::default(),
            restored: Default::default(),
            restore_failures: Default::default(),
            reader,
            creds: creds.clone(),
            alive: workers.iter().map(|_| AtomicBool::new(true)).collect(),
            active: std::sync::atomic::AtomicUsize::new(workers.len()),
            replaced: Default::default(),
            progress: Default::default(),
            generations: workers.iter().map(|_| Default::default()).collect(),
            replacer: Mutex::new(None),
            replace_failures: Mutex::new(Default::default()),
            stopping: AtomicBool::new(false),
            live: tokio::sync::watch::channel(0).0,
            me: me.clone(),
            workers: std::sync::RwLock::new(workers),
            cfg,
            shuffles: Mutex::new(HashMap::new()),
            recomputed: Default::default(),
            calibration: tokio::sync::OnceCell::new(),
            events: Mutex::new(None),
            parity: Mutex::new(Default::default()),
            committing: Default::default(),
            reruns: Default::default(),
            shuffle_order: Default::default(),
        }))
    }

    /// Work done on this cluster so far (for progress bars).
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The driver's settings.
    pub fn config(&self) -> &DriverConfig {
        &self.cfg
    }

    /// The cluster token (engines hand it to in-process readers).
    pub fn token(&self) -> &str {
        &self.creds.token
    }

    /// How this driver dials workers (token, TLS).
    pub fn credentials(&self) -> &crate::transport::Credentials {
        &self.creds
    }

    /// Reads shuffle output on the driver over the driver's own connections.
    pub fn reader(&self) -> Arc<crate::transport::peers::PeerReader> {
        self.reader.clone()
    }

    /// Worker slots in the cluster.
    pub fn num_workers(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// The client of worker slot `i` (its replacement's, once a lost worker was replaced).
    pub fn worker(&self, i: usize) -> Result<WorkerClient> {
        self.clients().get(i).cloned().ok_or_else(|| {
            Error::invalid(format!(
                "no worker {i} in a cluster of {}",
                self.num_workers()
            ))
        })
    }

    fn clients(&self) -> Vec<WorkerClient> {
        self.workers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The workers' addresses now (a replaced worker's slot has its replacement's).
    pub fn addresses(&self) -> Vec<String> {
        self.clients().into_iter().map(|w| w.addr).collect()
    }

    /// Whether worker slot `i` is live (not found lost).
    pub fn is_alive(&self, i: usize) -> bool {
        self.alive[i].load(Ordering::SeqCst)
    }

    /// Blocks held by a worker, across all shuffles.
    pub fn blocks_on(&self, worker: usize) -> Vec<BlockId> {
        lock(&self.shuffles)
            .values()
            .flat_map(|e| &e.blocks)
            .filter(|b| b.worker == worker)
            .map(|b| b.meta.id)
            .collect()
    }

    /// The committed blocks readers of `shuffle` see now.
    pub fn blocks_of(&self, shuffle: ShuffleId) -> Vec<BlockRef> {
        self.with_shuffle(shuffle, |e| e.blocks.clone())
            .unwrap_or_default()
    }

    /// The worker holding the committed output of map (or merge group) `map` of `shuffle`, and
    /// how it was made.
    pub fn lineage(&self, shuffle: ShuffleId, map: u32) -> Option<(usize, Lineage)> {
        self.with_shuffle(shuffle, |e| {
            e.outputs.get(&map).map(|m| (m.worker, m.lineage.clone()))
        })
        .flatten()
    }

    /// Run `fut` while checking worker health every `health_interval` (first after one).
    pub async fn watch<T>(&self, fut: impl Future<Output = Result<T>>) -> Result<T> {
        tokio::pin!(fut);
        let mut tick = ticker(self.cfg.health_interval);
        loop {
            tokio::select! {
                r = &mut fut => return r,
                _ = tick.tick() => self.check_health().await?,
            }
        }
    }

    async fn on_all<F, Fut>(&self, f: F) -> Result<()>
    where
        F: Fn(WorkerClient) -> Fut,
        Fut: Future<Output = Result<()>>,
    {
        let calls = self.clients().into_iter().map(f);
        // Under the health watch: a paused worker would otherwise hold the call until the
        // RPC timeout.
        let all = async {
            for r in futures::future::join_all(calls).await {
                r?;
            }
            Ok(())
        };
        match self.watch(all).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.classify(e).await),
        }
    }

    /// Make the map tasks of `shuffle` submitted from now on leave their blocks as `placement`
    /// says (push and two-level strategies), and its reducers read accordingly.
    pub fn place(&self, shuffle: ShuffleId, placement: Placement) {
        self.update_shuffle(shuffle, |e| e.placement = Some(placement));
    }

    /// Make only the map tasks submitted from now on use `placement`; readers keep reading as
    /// before (every worker, when earlier maps left their blocks in place).
    pub fn place_maps(&self, shuffle: ShuffleId, placement: Placement) {
        self.update_shuffle(shuffle, |e| e.map_placement = Some(placement));
    }

    /// Make the map tasks of `shuffle` submitted from now on write packed blocks
    /// ([`crate::packed`]): for strategies that merge every map's blocks before any reader.
    pub fn pack_maps(&self, shuffle: ShuffleId) {
        self.update_shuffle(shuffle, |e| e.packing = true);
    }

    /// Record how `shuffle`'s strategy was chosen (shown by `EXPLAIN ANALYZE`).
    pub fn note_choice(&self, shuffle: ShuffleId, note: String) {
        self.event(
            "exchange_choice",
            || serde_json::json!({"shuffle": shuffle.to_string(), "choice": note}),
        );
        self.update_shuffle(shuffle, |e| e.choice = Some(note));
    }

    /// Write what this driver does to `log` from now on ([`crate::events`]; None: stop);
    /// returns the log open before. Every job of the cluster writes to the one log open.
    pub fn log_events(
        &self,
        log: Option<Arc<crate::events::EventLog>>,
    ) -> Option<Arc<crate::events::EventLog>> {
        std::mem::replace(&mut *lock(&self.events), log)
    }

    /// Append an event to the open log, if any (`fields`, an object, made only then).
    pub fn event(&self, kind: &str, fields: impl FnOnce() -> serde_json::Value) {
        let log = lock(&self.events).clone();
        if let Some(log) = log {
            log.write(kind, fields());
        }
    }

    /// How `shuffle`'s strategy was chosen, if noted ([`Self::note_choice`]).
    pub fn choice(&self, shuffle: ShuffleId) -> Option<String> {
        self.with_shuffle(shuffle, |e| e.choice.clone()).flatten()
    }

    /// Where the calibration is kept once measured ([`Self::calibration`], in
    /// [`crate::calibrate`]).
    pub(crate) fn calibration_cell(&self) -> &tokio::sync::OnceCell<proto::Calibration> {
        &self.calibration
    }

    /// Use `calibration` (measured earlier, e.g. on a machine of the same kind) instead of
    /// measuring on first use. Refused once the cluster has one.
    pub fn use_calibration(&self, calibration: proto::Calibration) -> Result<()> {
        self.calibration.set(calibration).map_err(|_| {
            Error::invalid("the cluster is calibrated already: a calibration is set only once")
        })
    }

    /// Where `shuffle`'s map tasks leave their blocks ([`Placement::Local`] unless set).
    pub fn placement(&self, shuffle: ShuffleId) -> Placement {
        self.with_shuffle(shuffle, |e| e.placement)
            .flatten()
            .unwrap_or_default()
    }

    /// The addresses of the workers that can hold blocks of `partition` of `shuffle`.
    pub fn partition_peers(&self, shuffle: ShuffleId, partition: u32) -> Vec<String> {
        self.placement(shuffle)
            .readers(partition, self.num_workers())
            .into_iter()
            .filter_map(|w| self.worker(w).ok().map(|c| c.addr))
            .collect()
    }

    /// A new attempt number for `map` of `shuffle` (0, 1, 2, ...).
    pub fn next_attempt(&self, shuffle: ShuffleId, map: u32) -> u32 {
        self.update_shuffle(shuffle, |e| {
            let next = e.attempts.entry(map).or_insert(0);
            let attempt = *next;
            *next += 1;
            attempt
        })
    }

    /// Tell every worker the map side of `shuffle` is complete.
    ///
    /// A map output lost with its worker fails the seal (readers would miss its rows): the
    /// caller recovers ([`Driver::repair`], a rerun) or fails.
    pub async fn seal(&self, shuffle: ShuffleId) -> Result<()> {
        if let Some((map, worker, _)) = self.lost_outputs(shuffle).into_iter().next() {
            return Err(Error::WorkerLost {
                worker,
                addr: self.worker(worker).map(|w| w.addr).unwrap_or_default(),
                reason: format!("it held the output of map {map} of shuffle {shuffle}"),
                lost_blocks: self.lost_outputs(shuffle).len(),
            });
        }
        if let Some((map, _, slots)) = self.coded_losses(shuffle).into_iter().next() {
            let worker = slots.first().copied().unwrap_or(0);
            return Err(Error::WorkerLost {
                worker,
                addr: self.worker(worker).map(|w| w.addr).unwrap_or_default(),
                reason: format!("it held blocks of map {map} of shuffle {shuffle}"),
                lost_blocks: self.coded_losses(shuffle).len(),
            });
        }
        self.register_replaced(shuffle).await?;
        // Readers on the workers (stage inputs, folds) check partitions against these.
        let rows = self.expected_rows_all(shuffle).unwrap_or_default();
        let rows = &rows;
        let objects = &self.objects_to_read(shuffle)?;
        self.on_all(|w| async move { w.seal(shuffle.0, rows.clone(), objects.clone()).await })
            .await?;
        self.update_shuffle(shuffle, |e| e.sealed = true);
        self.progress.sealed.fetch_add(1, Ordering::Relaxed);
        self.event(
            "shuffle_sealed",
            || serde_json::json!({"shuffle": shuffle.to_string()}),
        );
        Ok(())
    }

    /// Stream one reduce partition from every worker, blocks in arrival order.
    pub async fn read_partition(
        self: &Arc<Self>,
        shuffle: ShuffleId,
        partition: u32,
        wait_sealed: bool,
    ) -> Result<BatchStream> {
        if let Some(read) = self.read_from_store(shuffle, partition, wait_sealed)? {
            return Ok(read);
        }
        let readers = self
            .placement(shuffle)
            .readers(partition, self.num_workers());
        let opens = readers.iter().map(|&w| {
            let client = self.worker(w);
            async move {
                client?
                    .read_partition(shuffle.0, partition, wait_sealed, Slice::WHOLE)
                    .await
            }
        });
        let mut streams = Vec::new();
        for r in futures::future::join_all(opens).await {
            match r {
                Ok(s) => streams.push(s),
                Err(e) => return Err(self.classify(e).await),
            }
        }
        let me = self.clone();
        let merged = futures::stream::select_all(streams).then(move |item| {
            let me = me.clone();
            async move {
                match item {
                    Ok(b) => Ok(b),
                    Err(e) => Err(me.classify(e).await),
                }
            }
        });
        Ok(Box::pin(merged))
    }

    /// Run a reduce task on `worker` pulling `partition` from every worker.
    pub async fn run_reduce(
        &self,
        shuffle: ShuffleId,
        partition: u32,
        worker: usize,
        sink: &str,
    ) -> Result<proto::TaskResult> {
        let task = proto::ReduceTask {
            shuffle_id: shuffle.0,
            partition,
            peers: self.partition_peers(shuffle, partition),
            sink: sink.to_string(),
        };
        match self.worker(worker)?.run_reduce(&task).await {
            Ok(r) => Ok(r),
            Err(e) => Err(self.classify(e).await),
        }
    }

    /// Fold round `round` of `partition` of `shuffle` (streaming strategy) on the partition's
    /// owner (worker p mod N): the round's blocks of that partition, read from where `maps`
    /// left them, into the partition's running state there; returns the partial result, and
    /// the worker's report (its `result_ipc` taken: decoded into the result).
    pub async fn fold_partition(
        &self,
        shuffle: ShuffleId,
        partition: u32,
        round: usize,
        maps: &[MapDone],
        reducer: &str,
        payload: &[u8],
    ) -> Result<(SchemaRef, Vec<arrow::array::RecordBatch>, proto::FoldResult)> {
        let addrs = self.addresses();
        let blocks = maps
            .iter()
            .flat_map(|m| &m.blocks)
            .filter(|b| b.meta.id.partition == partition)
            .map(|b| proto::BlockLocation {
                key: Some(b.meta.id.into()),
                peer: addrs.get(b.worker).cloned().unwrap_or_default(),
            })
            .collect();
        let task = proto::FoldTask {
            shuffle_id: shuffle.0,
            partition,
            blocks,
            reducer: reducer.to_string(),
            payload: payload.to_vec(),
            first: round == 0,
            round: round as u32,
        };
        let owner = Placement::owner(partition, self.num_workers());
        match self.worker(owner)?.fold(&task).await {
            Ok(mut r) => {
                tracing::debug!(
                    %shuffle, partition, round, seconds = r.seconds, rows = r.rows_folded,
                    result_bytes = r.result_ipc.len(), "folded"
                );
                // Decoded from the response's own bytes (the result leaves `result_ipc` empty).
                let ipc = bytes::Bytes::from(std::mem::take(&mut r.result_ipc));
                let (schema, batches) = crate::block::decode_block(&ipc)?;
                Ok((schema, batches, r))
            }
            Err(e) => Err(self.classify(e).await),
        }
    }

    /// Free a shuffle's memory and files on every live worker.
    ///
    /// A worker found gone meanwhile is no error: its share of the shuffle went with it (and
    /// the worker is replaced as usual).
    pub async fn drop_shuffle(&self, shuffle: ShuffleId) -> Result<()> {
        let (store, objects): (_, Vec<String>) = lock(&self.shuffles)
            .remove(&shuffle)
            .map(|e| {
                let objects = e
                    .outputs
                    .into_values()
                    .filter_map(|m| m.object.map(|o| o.path))
                    .filter(|p| !p.is_empty())
                    .collect();
                (e.store.flatten(), objects)
            })
            .unwrap_or_default();
        self.forget_coded(shuffle);
        let clients = self.clients();
        let calls = clients
            .iter()
            .filter(|w| self.is_alive(w.index))
            .map(|w| w.shuffle_action(actions::DROP_SHUFFLE, shuffle.0));
        let mut result = Ok(());
        for r in futures::future::join_all(calls).await {
            if let Err(e) = r {
                match self.classify(e).await {
                    Error::WorkerLost { worker, .. } => {
                        tracing::debug!(%shuffle, worker, "dropped a shuffle; a worker holding it is gone");
                    }
                    e => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        // Its objects go once its attempts are stopped everywhere (none writes one after).
        if let Some(store) = store {
            self.delete_objects(&store, shuffle, objects).await;
        }
        result
    }

    /// Every worker's counters, by slot (block store, memory, task admission, calls served).
    pub async fn stats(&self) -> Result<Vec<proto::WorkerStats>> {
        let clients = self.clients();
        let calls = clients.iter().map(|w| w.stats());
        // Under the health watch, like every call to all workers (a paused one answers never).
        let all = async {
            let mut out = Vec::new();
            for r in futures::future::join_all(calls).await {
                out.push(r?);
            }
            Ok(out)
        };
        match self.watch(all).await {
            Ok(out) => Ok(out),
            Err(e) => Err(self.classify(e).await),
        }
    }
}

/// An interval whose first tick is one `period` from now. `tokio::time::interval` ticks at
/// once, but awaiting that tick takes up to a timer-wheel slot (~1 ms): every call under
/// [`Driver::watch`] (each RPC to all workers) and every map side waited up to that long
/// before starting, several times before an online query's first estimate.
pub fn ticker(period: std::time::Duration) -> tokio::time::Interval {
    let period = period.max(std::time::Duration::from_millis(1));
    tokio::time::interval_at(tokio::time::Instant::now() + period, period)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// A health watch starts with nothing to wait for: the first tick is a period away (an
    /// immediate first tick, awaited, held every watched call up to a timer slot).
    #[tokio::test]
    async fn a_ticker_first_ticks_one_period_from_now() {
        let mut tick = super::ticker(Duration::from_secs(10));
        let early = tokio::time::timeout(Duration::from_millis(50), tick.tick()).await;
        assert!(early.is_err(), "no tick before one period");
        let mut fast = super::ticker(Duration::from_millis(20));
        let ticked = tokio::time::timeout(Duration::from_secs(5), fast.tick()).await;
        assert!(ticked.is_ok(), "then it ticks");
    }
}
