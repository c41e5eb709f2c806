//! Shuffle jobs over the driver API, as bindings run them: a user's batch stream shuffled into
//! R partitions that come back in order, and stages of worker-side map tasks read back whole.
//!
//! Everything here used to live in the Python bindings; it is engine- and language-neutral, so
//! it lives here and is tested from Rust. A [`ShuffleJob`] chooses the partitioner by name
//! (sampling the input for range boundaries), cuts the input into map tasks of about
//! `map_bytes`, runs the map side with the chosen strategy, and reads the partitions back one
//! at a time (the next one read while the caller holds the current one).
//!
//! A lost worker does not fail a job (when the cluster replaces workers): the driver keeps the
//! map inputs ([`crate::kept`]); maps lost while mapping run again in place
//! ([`crate::strategy::pull::run_maps`]); outputs lost after the seal are recomputed on the
//! replacement ([`Driver::repair`]) and the partition being read is read again; a shuffle
//! whose maps pushed blocks everywhere runs again whole, skipping the partitions handed out.

use crate::block::{cast_to, ShuffleId};
use crate::checksum::Checksum;
use crate::driver::{Driver, MapInput, ShuffleSpec};
use crate::error::{Error, Result};
use crate::strategy::{self, pull::Mapped, StrategyOptions};
use crate::sync::lock;
use crate::{partitioner, proto};
use arrow::array::{RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use futures::{Stream, StreamExt, TryStreamExt};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::sync::{mpsc, watch};

/// Rows sampled for range boundaries.
pub const RANGE_SAMPLE_ROWS: usize = 100_000;

/// How rows are spread over partitions, by name: `hash`, `range`, `round_robin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionerKind {
    /// By a hash of the key columns.
    Hash,
    /// By ranges of the key columns, with boundaries sampled from the input.
    Range,
    /// Dealt in turn, whatever the rows hold.
    RoundRobin,
}

impl std::str::FromStr for PartitionerKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "hash" => Ok(PartitionerKind::Hash),
            "range" => Ok(PartitionerKind::Range),
            "round_robin" | "round-robin" => Ok(PartitionerKind::RoundRobin),
            other => Err(Error::invalid(format!(
                "unknown partitioner {other:?}: expected hash, range or round_robin"
            ))),
        }
    }
}

/// What a user shuffle does.
#[derive(Debug, Clone)]
pub struct ShuffleOptions {
    /// Key columns (hash and range partitioners).
    pub by: Vec<String>,
    /// Reduce partitions to shuffle into.
    pub partitions: u32,
    /// How rows are spread over the partitions.
    pub partitioner: PartitionerKind,
    /// Input bytes per map task.
    pub map_bytes: usize,
    /// The strategy and its knobs the map side runs with.
    pub strategy: StrategyOptions,
}

/// The input of a shuffle job: batches in the order the caller produces them.
pub type Input = Box<dyn Iterator<Item = Result<RecordBatch>> + Send>;
/// One reduce partition read back: its index and its batches.
pub type Partition = Result<(u32, Vec<RecordBatch>)>;

/// The map side of a finished shuffle.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MapSummary {
    /// Map tasks that committed.
    pub maps: usize,
    /// Blocks readers read (after merges and forwards; parity excluded).
    pub blocks: usize,
    /// Merge groups committed (merging strategies).
    pub merges: usize,
    /// Rows of the input.
    pub rows: u64,
    /// The input's content checksum, as hex.
    pub checksum: String,
    /// In-memory bytes of the input.
    pub bytes: u64,
    /// How `auto` chose, with its predictions (None for a fixed strategy).
    pub strategy_choice: Option<String>,
}

impl MapSummary {
    fn of(mapped: &Mapped, blocks: usize, choice: Option<String>) -> Self {
        MapSummary {
            maps: mapped.maps.len(),
            blocks,
            merges: mapped.merges.len(),
            rows: mapped.input.rows,
            checksum: format!("{:#018x}", mapped.input.sum),
            bytes: mapped.input_bytes,
            strategy_choice: choice,
        }
    }
}

/// The schema a shuffle of `schema` carries: dictionary columns travel as their value type
/// (Flight hydrates them anyway).
pub fn hydrated(schema: &Schema) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::Dictionary(_, v) => f.as_ref().clone().with_data_type(v.as_ref().clone()),
            _ => f.as_ref().clone(),
        })
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// Every `step`-th row of `batches`, about [`RANGE_SAMPLE_ROWS`] in all.
pub fn sample(batches: &[RecordBatch]) -> Result<Vec<RecordBatch>> {
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let step = rows.div_ceil(RANGE_SAMPLE_ROWS).max(1);
    batches
        .iter()
        .map(|b| {
            let idx: UInt32Array = (0..b.num_rows() as u32).step_by(step).collect();
            Ok(arrow::compute::take_record_batch(b, &idx)?)
        })
        .collect()
}

/// The shuffle spec of a user shuffle over `schema` (already [`hydrated`]), and the input to
/// map. A range partitioner needs a sample of the whole input, so it reads the input first
/// (and hands it back buffered); the others leave it as a stream. Blocking: run it off the
/// async runtime when the input is.
pub fn prepare(
    schema: &SchemaRef,
    input: Input,
    opts: &ShuffleOptions,
) -> Result<(ShuffleSpec, Input)> {
    if opts.partitions == 0 {
        return Err(Error::invalid("partitions must be at least 1"));
    }
    let keys: Vec<&str> = opts.by.iter().map(|s| s.as_str()).collect();
    let conformed = {
        let schema = schema.clone();
        move |b: Result<RecordBatch>| cast_to(b?, &schema)
    };
    let (partitioner, input): (proto::Partitioner, Input) = match opts.partitioner {
        PartitionerKind::Hash => (partitioner::hash(&keys), Box::new(input.map(conformed))),
        PartitionerKind::RoundRobin => (partitioner::round_robin(), Box::new(input.map(conformed))),
        PartitionerKind::Range => {
            let all = input.map(conformed).collect::<Result<Vec<_>>>()?;
            let partitioner = if all.iter().all(|b| b.num_rows() == 0) {
                // No rows: every partition is empty whatever the boundaries.
                partitioner::round_robin()
            } else {
                let spec = partitioner::range_boundaries(
                    &sample(&all)?,
                    schema,
                    &opts.by,
                    &[],
                    opts.partitions,
                )?;
                proto::Partitioner {
                    kind: Some(proto::partitioner::Kind::Range(spec)),
                }
            };
            (partitioner, Box::new(all.into_iter().map(Ok)))
        }
    };
    let spec = ShuffleSpec {
        id: ShuffleId::random(),
        schema: schema.clone(),
        partitions: opts.partitions,
        partitioner,
        checksum_inputs: true,
        combine: None,
    };
    Ok((spec, input))
}

/// A running user shuffle: partitions come back in order from [`ShuffleJob::next_partition`].
/// Dropping it stops the job; [`ShuffleJob::close`] also frees its blocks on the workers.
pub struct ShuffleJob {
    /// The shuffle's id.
    pub id: ShuffleId,
    /// The schema of the shuffled rows (dictionary columns as their value type).
    pub schema: SchemaRef,
    driver: Arc<Driver>,
    partitions: tokio::sync::Mutex<mpsc::Receiver<Partition>>,
    mapped: watch::Receiver<Option<std::result::Result<MapSummary, String>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The runtime the job runs on (a drop outside it still frees the shuffle there).
    runtime: tokio::runtime::Handle,
}

impl ShuffleJob {
    /// Register `spec` on the workers and start mapping `input` (from [`prepare`]) and reading
    /// the partitions back. Call it inside the tokio runtime.
    pub async fn start(
        driver: Arc<Driver>,
        spec: ShuffleSpec,
        input: Input,
        opts: &ShuffleOptions,
    ) -> Result<Self> {
        // `auto` calibrates before any map of this job runs (not under its load).
        if opts.strategy.strategy == strategy::Strategy::Auto {
            driver.calibration().await?;
        }
        driver.create_shuffle(&spec).await?;
        let (part_tx, part_rx) = mpsc::channel::<Partition>(1);
        let (mapped_tx, mapped_rx) = watch::channel(None);
        let (id, schema) = (spec.id, spec.schema.clone());
        let maps = split_input(spec.schema.clone(), input, opts.map_bytes.max(1));
        let task = tokio::spawn(run(
            driver.clone(),
            spec,
            opts.strategy,
            maps,
            part_tx,
            mapped_tx,
        ));
        Ok(ShuffleJob {
            id,
            schema,
            driver,
            partitions: tokio::sync::Mutex::new(part_rx),
            mapped: mapped_rx,
            task: Mutex::new(Some(task)),
            runtime: tokio::runtime::Handle::current(),
        })
    }

    /// The next partition in order, or None when all were read.
    pub async fn next_partition(&self) -> Option<Partition> {
        self.partitions.lock().await.recv().await
    }

    /// Wait until the map side is complete.
    pub async fn mapped(&self) -> Result<MapSummary> {
        let mut rx = self.mapped.clone();
        let got = rx
            .wait_for(|v| v.is_some())
            .await
            .map(|v| v.clone())
            .ok()
            .flatten();
        match got {
            Some(Ok(s)) => Ok(s),
            Some(Err(e)) => Err(Error::Cluster(e)),
            None => Err(Error::Cluster(
                "the shuffle stopped before its map side finished".into(),
            )),
        }
    }

    /// Stop the job (if it still runs); returns true if it was running.
    fn stop(&self) -> bool {
        match lock(&self.task).take() {
            Some(t) => {
                t.abort();
                true
            }
            None => false,
        }
    }

    /// Stop the job and free its blocks on every worker (a shuffle already gone or a lost
    /// worker is not an error here).
    pub async fn close(&self) -> Result<()> {
        if !self.stop() {
            return Ok(());
        }
        match self.driver.drop_shuffle(self.id).await {
            Err(Error::Remote {
                code: tonic::Code::NotFound,
                ..
            })
            | Err(Error::WorkerLost { .. }) => Ok(()),
            other => other,
        }
    }
}

impl Drop for ShuffleJob {
    fn drop(&mut self) {
        if self.stop() {
            let (driver, id) = (self.driver.clone(), self.id);
            self.runtime.spawn(async move {
                let _ = driver.drop_shuffle(id).await;
            });
        }
    }
}

/// Receiver of map inputs as a stream (one adapter, no dependency for it).
struct Receiver<T>(mpsc::Receiver<T>);

impl<T> Stream for Receiver<T> {
    type Item = T;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}

/// The fewest rows of a slice cut from a batch larger than a map task.
const MIN_SLICE_ROWS: usize = 8192;

/// Cut the input into map tasks of about `map_bytes` each, in one blocking reader thread.
/// Each map's batches are kept on the driver as the map reads them ([`crate::kept`]), so a
/// map lost with its worker runs again from them.
fn split_input(schema: SchemaRef, input: Input, map_bytes: usize) -> Receiver<MapInput> {
    let (maps_tx, maps_rx) = mpsc::channel::<MapInput>(1);
    tokio::task::spawn_blocking(move || {
        let mut current: Option<mpsc::Sender<(Result<RecordBatch>, u64)>> = None;
        let mut bytes = 0usize;
        // A batch larger than a map task (a one-chunk DataFrame) is cut into row slices (no
        // copy) of at least MIN_SLICE_ROWS rows, so it still makes several map tasks.
        let pieces = input.flat_map(|batch| -> Vec<(Result<RecordBatch>, usize)> {
            match batch {
                Ok(b) => {
                    let size = b.get_array_memory_size();
                    let most = (b.num_rows() / MIN_SLICE_ROWS).max(1);
                    let n = size.div_ceil(map_bytes.max(1)).clamp(1, most);
                    let rows = b.num_rows().div_ceil(n).max(1);
                    (0..b.num_rows().max(1))
                        .step_by(rows)
                        .map(|at| {
                            let len = rows.min(b.num_rows() - at);
                            (Ok(b.slice(at, len)), size / n)
                        })
                        .collect()
                }
                Err(e) => vec![(Err(e), 0)],
            }
        });
        for (batch, size) in pieces {
            if current.is_none() || bytes >= map_bytes {
                let (tx, rx) = mpsc::channel(4);
                let kept = crate::kept::KeptInput::new(schema.clone(), rx);
                if maps_tx.blocking_send(MapInput::Kept(kept)).is_err() {
                    return; // the shuffle failed or was dropped
                }
                current = Some(tx);
                bytes = 0;
            }
            bytes += size;
            let failed = batch.is_err();
            if let Some(tx) = &current {
                if tx.blocking_send((batch, size as u64)).is_err() {
                    return;
                }
            }
            if failed {
                return;
            }
        }
    });
    Receiver(maps_rx)
}

/// Times a job recovers from lost workers before it gives up.
pub const MAX_RECOVERIES: usize = 3;

/// Whether `e` says a worker was lost (or is a failed call after a replacement started
/// since `replacements`), and the driver replaces lost workers, so the job can go on. An
/// error of the input or the data is never taken for one.
pub fn worker_lost(driver: &Driver, e: &Error, replacements: u64) -> bool {
    let lost = match e {
        Error::WorkerLost { .. } | Error::PartialCommit { .. } | Error::RowCount { .. } => true,
        Error::Remote { .. } | Error::Timeout { .. } | Error::UnknownShuffle(_) => {
            driver.replacements() != replacements
        }
        _ => false,
    };
    lost && driver.replaces_workers()
}

async fn run(
    driver: Arc<Driver>,
    spec: ShuffleSpec,
    opts: StrategyOptions,
    mut maps: Receiver<MapInput>,
    out: mpsc::Sender<Partition>,
    mapped_tx: watch::Sender<Option<std::result::Result<MapSummary, String>>>,
) {
    // Partitions are read after the seal: merging strategies may pack, lost maps run again.
    let opts = StrategyOptions {
        pack: true,
        recover: true,
        ..opts
    };
    // The map inputs handed out so far, to run the map side again after a lost worker (the
    // driver keeps their batches, see `crate::kept`).
    let handed = Arc::new(Mutex::new(Vec::<MapInput>::new()));
    let mut recoveries = 0;
    let mut replacements = driver.replacements();
    let mut first = 0u32;
    let fail = |e: Error| {
        let (mapped_tx, out) = (&mapped_tx, &out);
        async move {
            let _ = mapped_tx.send(Some(Err(e.to_string())));
            let _ = out.send(Err(e)).await;
        }
    };
    'shuffle: loop {
        if recoveries > 0 {
            // Again from the start: the same shuffle id, registered anew on the live workers.
            if let Err(e) = driver.restart_shuffle(&spec).await {
                return fail(e).await;
            }
        }
        let replay: Vec<MapInput> = lock(&handed).iter().filter_map(|m| m.again()).collect();
        let record = handed.clone();
        let inputs = futures::stream::iter(replay).chain((&mut maps).inspect(move |m| {
            if let Some(again) = m.again() {
                lock(&record).push(again);
            }
        }));
        let mapped = match strategy::map_side(&driver, &spec, inputs, opts).await {
            Ok(m) => m,
            Err(e) if recoveries < MAX_RECOVERIES && worker_lost(&driver, &e, replacements) => {
                tracing::warn!(shuffle = %spec.id, error = %e, "worker lost during the map side: running it again");
                recoveries += 1;
                driver.note_rerun();
                replacements = driver.replacements();
                continue 'shuffle;
            }
            Err(e) => return fail(e).await,
        };
        if first == 0 {
            let summary =
                MapSummary::of(&mapped, driver.live_blocks(spec.id), driver.choice(spec.id));
            let _ = mapped_tx.send(Some(Ok(summary)));
        }
        // Partitions already handed to the caller are not read again (a rerun makes the
        // same partitions: the same inputs, partitioner and boundaries).
        let mut p = first;
        while p < spec.partitions {
            match read_partition(&driver, spec.id, p).await {
                Ok(b) => {
                    if out.send(Ok((p, b))).await.is_err() {
                        return;
                    }
                    p += 1;
                }
                Err(e) if recoveries < MAX_RECOVERIES && worker_lost(&driver, &e, replacements) => {
                    recoveries += 1;
                    // Lost map outputs run again where the shuffle keeps its blocks in place;
                    // otherwise (push, two-level) the whole shuffle runs again.
                    match driver.repair(spec.id).await {
                        Ok(n) => {
                            tracing::warn!(shuffle = %spec.id, partition = p, recomputed = n, "worker lost while reading: lost map outputs recomputed");
                        }
                        Err(r) => {
                            tracing::warn!(shuffle = %spec.id, error = %r, "worker lost while reading: running the shuffle again");
                            driver.note_rerun();
                            replacements = driver.replacements();
                            first = p;
                            continue 'shuffle;
                        }
                    }
                    replacements = driver.replacements();
                }
                Err(e) => return fail(e).await,
            }
        }
        return;
    }
}

/// One sealed partition read whole to the driver, under the health watch, and checked
/// against the shuffle's manifest: rows missing or read twice are [`Error::RowCount`] (which
/// recovery handles like a lost worker), never a short or doubled partition.
pub async fn read_partition(
    driver: &Arc<Driver>,
    shuffle: ShuffleId,
    partition: u32,
) -> Result<Vec<RecordBatch>> {
    let read = async {
        let stream = driver.read_partition(shuffle, partition, true).await?;
        stream.try_collect::<Vec<_>>().await
    };
    let batches = driver.watch(read).await?;
    if !crate::checksum::verify_reads() {
        return Ok(batches);
    }
    if let Some(expected) = driver.expected_rows(shuffle, partition) {
        let received: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
        if received != expected {
            tracing::warn!(%shuffle, partition, expected, received, "a partition read does not match the manifest");
            return Err(Error::RowCount {
                shuffle,
                partition,
                expected,
                received,
            });
        }
    }
    Ok(batches)
}

/// The spec of a stage's shuffle: hashed on `keys`, or dealt round-robin without keys.
pub fn stage_spec(schema: SchemaRef, partitions: u32, keys: &[String]) -> ShuffleSpec {
    let keys: Vec<&str> = keys.iter().map(|s| s.as_str()).collect();
    ShuffleSpec {
        id: ShuffleId::random(),
        schema,
        partitions: partitions.max(1),
        partitioner: if keys.is_empty() {
            partitioner::round_robin()
        } else {
            partitioner::hash(&keys)
        },
        checksum_inputs: false,
        combine: None,
    }
}

/// Run one stage of worker-side map tasks into `spec`'s new shuffle, sealed at the end; on
/// failure the shuffle is dropped. Returns the rows the maps read.
pub async fn run_stage(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: Vec<MapInput>,
    opts: StrategyOptions,
) -> Result<Checksum> {
    if opts.strategy == strategy::Strategy::Auto {
        driver.calibration().await?;
    }
    driver.create_shuffle(spec).await?;
    // Read once sealed (the caller reads after this returns): merging strategies may pack,
    // lost maps run again.
    let opts = StrategyOptions {
        pack: true,
        recover: true,
        ..opts
    };
    match strategy::map_side(driver, spec, futures::stream::iter(inputs), opts).await {
        Ok(m) => Ok(m.input),
        Err(e) => {
            let _ = driver.drop_shuffle(spec.id).await;
            Err(e)
        }
    }
}

/// Every partition of a sealed shuffle, read back to the driver in partition order; map
/// outputs lost with a worker are recomputed ([`Driver::repair`]) and the partition read again.
pub async fn read_all(
    driver: &Arc<Driver>,
    shuffle: ShuffleId,
    partitions: u32,
) -> Result<Vec<Vec<RecordBatch>>> {
    let mut out = Vec::with_capacity(partitions as usize);
    let mut recoveries = 0;
    let mut replacements = driver.replacements();
    let mut p = 0;
    while p < partitions {
        match read_partition(driver, shuffle, p).await {
            Ok(b) => {
                out.push(b);
                p += 1;
            }
            Err(e) if recoveries < MAX_RECOVERIES && worker_lost(driver, &e, replacements) => {
                recoveries += 1;
                let n = driver.repair(shuffle).await?;
                tracing::warn!(%shuffle, partition = p, recomputed = n, "worker lost while reading: lost map outputs recomputed");
                if n > 0 && driver.deals_by_position(shuffle) {
                    // A recomputed map may deal its rows otherwise (its input in another
                    // order): the partitions read so far are read again.
                    out.clear();
                    p = 0;
                }
                replacements = driver.replacements();
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}
