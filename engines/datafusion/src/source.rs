//! `StageSource`: how a worker runs its partitions of a stage plan as one map task's input.
//!
//! A stage task carries the partitions one worker runs (see
//! [`crate::writer::ShuffleWriterExec::task_groups`]): they execute concurrently, each on its
//! own tokio task, and their batches feed the one map task, so a stage costs one task call and
//! one commit per worker instead of one per partition.
//!
//! A worker keeps one DataFusion session (per peer list and batch size) and decodes a stage
//! plan once: every task of that stage on this worker executes its partition of the *same*
//! plan instance, as single-process DataFusion does. So a `CollectLeft` join's build side is
//! built once per worker and shared by the worker's probe partitions. This is safe because the
//! planner already removed the operators whose partitions coordinate through one instance
//! (joins that emit build-side rows at the end, dynamic filters; see [`crate::planner`]); the
//! rest only share read-only state. The cached plan is forgotten when its shuffle is dropped.

use crate::codec::ExchangeCodec;
use crate::ExchangeContext;
use arrow::datatypes::SchemaRef;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_proto::bytes::physical_plan_from_bytes_with_extension_codec;
use flightshuffle::source::{BatchSource, BatchStream, TaskContext};
use flightshuffle::sync::lock;
use flightshuffle::{Error, ShuffleId};
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The payload of a stage map task.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StageTask {
    /// The stage plan (rooted at its ShuffleWriterExec), `datafusion-proto` bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub plan: Vec<u8>,
    /// The stage partitions this task runs (all into one map output).
    #[prost(uint32, repeated, tag = "2")]
    pub partitions: Vec<u32>,
    /// Every worker's address, for the stage's shuffle readers.
    #[prost(string, repeated, tag = "3")]
    pub workers: Vec<String>,
    /// The driver's RPC timeout, in seconds.
    #[prost(uint64, tag = "4")]
    pub timeout_secs: u64,
    /// Rows per batch in the stage's session (0: DataFusion's default).
    #[prost(uint32, tag = "5")]
    pub batch_size: u32,
    /// The session turned `flightshuffle.build_bounds` off.
    #[prost(bool, tag = "6")]
    pub no_build_bounds: bool,
}

/// Runs stage partitions; caches sessions and decoded plans (see the module doc).
#[derive(Default)]
pub struct StageSource {
    sessions: Mutex<HashMap<(Vec<String>, u32), SessionContext>>,
    /// One DataFusion memory pool for every session here: half the worker's budget.
    pool: std::sync::OnceLock<Arc<crate::pool::WorkerPool>>,
    plans: Mutex<HashMap<ShuffleId, (Vec<String>, StagePlan)>>,
}

/// A decoded stage plan and the session it runs in.
type StagePlan = (Arc<dyn ExecutionPlan>, SessionContext);

fn task_err(e: impl std::fmt::Display) -> Error {
    Error::Task(e.to_string())
}

impl StageSource {
    fn session(&self, ctx: &TaskContext, task: &StageTask) -> SessionContext {
        let key = (task.workers.clone(), task.batch_size);
        lock(&self.sessions)
            .entry(key)
            .or_insert_with(|| {
                let ectx = ExchangeContext::new(task.workers.clone(), ctx.reader.clone());
                let mut config =
                    crate::distributed_options(SessionConfig::new()).with_extension(Arc::new(ectx));
                if task.batch_size > 0 {
                    config = config.with_batch_size(task.batch_size as usize);
                }
                let runtime = if flightshuffle::admission_enabled() {
                    let pool = self.pool.get_or_init(|| {
                        let half = usize::try_from(ctx.memory_budget / 2).unwrap_or(usize::MAX);
                        Arc::new(crate::pool::WorkerPool::new(half))
                    });
                    RuntimeEnvBuilder::new()
                        .with_memory_pool(pool.clone())
                        .build_arc()
                } else {
                    RuntimeEnvBuilder::new().build_arc()
                };
                let session = match runtime {
                    Ok(rt) => SessionContext::new_with_config_rt(config, rt),
                    Err(e) => {
                        tracing::warn!("no memory pool for stage sessions: {e}");
                        SessionContext::new_with_config(config)
                    }
                };
                session.register_udf(crate::double::udf());
                session
            })
            .clone()
    }

    /// The stage's plan instance on this worker, decoded by its first task.
    fn plan(&self, ctx: &TaskContext, task: &StageTask) -> flightshuffle::Result<StagePlan> {
        // Held while decoding so concurrent first tasks of one stage share one instance.
        // A task for other workers (a lost worker replaced since) decodes a fresh instance:
        // one that read from the lost worker may hold its failure (a join's shared build
        // side) and the old peers.
        let mut plans = lock(&self.plans);
        if let Some((workers, p)) = plans.get(&ctx.shuffle) {
            if *workers == task.workers {
                return Ok(p.clone());
            }
        }
        let session = self.session(ctx, task);
        let plan = physical_plan_from_bytes_with_extension_codec(
            &task.plan,
            &session.task_ctx(),
            &ExchangeCodec,
        )
        .map_err(|e| Error::invalid(format!("cannot decode stage plan: {e}")))?;
        let plan = match task.no_build_bounds {
            true => plan,
            false => crate::build_bounds::attach(plan, session.state().config_options())
                .map_err(|e| Error::invalid(format!("cannot place build-side bounds: {e}")))?,
        };
        plans.insert(
            ctx.shuffle,
            (task.workers.clone(), (plan.clone(), session.clone())),
        );
        Ok((plan, session))
    }
}

impl BatchSource for StageSource {
    fn open(
        &self,
        ctx: &TaskContext,
        payload: &[u8],
        _schema: SchemaRef,
    ) -> flightshuffle::Result<BatchStream> {
        let task = StageTask::decode(payload)
            .map_err(|e| Error::invalid(format!("malformed stage task: {e}")))?;
        let (plan, session) = self.plan(ctx, &task)?;
        let count = plan.properties().partitioning.partition_count();
        let mut seen = std::collections::HashSet::new();
        if task.partitions.is_empty() {
            return Err(Error::invalid("a stage task needs at least one partition"));
        }
        for &p in &task.partitions {
            if p as usize >= count || !seen.insert(p) {
                return Err(Error::invalid(format!(
                    "stage task for partitions {:?} of a plan with {count}",
                    task.partitions
                )));
            }
        }
        let mut streams = task
            .partitions
            .iter()
            .map(|&p| {
                plan.execute(p as usize, session.task_ctx())
                    .map_err(task_err)
            })
            .collect::<flightshuffle::Result<Vec<_>>>()?;
        if streams.len() == 1 {
            let only = streams.pop().ok_or_else(|| task_err("no stream"))?;
            return Ok(Box::pin(only.map_err(task_err)));
        }
        Ok(concurrently(streams))
    }

    fn shuffle_dropped(&self, shuffle: ShuffleId) {
        lock(&self.plans).remove(&shuffle);
    }

    fn memory_peaks(&self) -> (u64, u64) {
        self.pool.get().map_or((0, 0), |p| {
            let (all, unspillable) = p.peaks();
            (all as u64, unspillable as u64)
        })
    }
}

/// Drive each stream on its own tokio task (so the partitions use the worker's cores as
/// separate map tasks would) and interleave their batches; dropping the result stops them.
/// The tasks start on the first poll: a stage task is opened before the worker admits it
/// (see `flightshuffle::admission_enabled`), and must not scan while it waits.
fn concurrently(streams: Vec<datafusion::execution::SendableRecordBatchStream>) -> BatchStream {
    Box::pin(futures::stream::once(async move { spawned(streams) }).flatten())
}

fn spawned(streams: Vec<datafusion::execution::SendableRecordBatchStream>) -> BatchStream {
    let (tx, rx) = tokio::sync::mpsc::channel(2 * streams.len());
    let handles: Vec<_> = streams
        .into_iter()
        .map(|mut stream| {
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Some(item) = stream.next().await {
                    let failed = item.is_err();
                    if tx.send(item.map_err(task_err)).await.is_err() || failed {
                        return;
                    }
                }
            })
        })
        .collect();
    let guard = PartitionTasks(handles);
    let rx = futures::stream::unfold((rx, guard), |(mut rx, mut guard)| async move {
        if let Some(item) = rx.recv().await {
            return Some((item, (rx, guard)));
        }
        // Every partition's sender is gone: each task ended. One that panicked ended without
        // its rows, so the map output would be short: report it instead of committing.
        for h in std::mem::take(&mut guard.0) {
            if let Err(e) = h.await {
                if e.is_panic() {
                    let err = task_err(format!("a stage partition panicked: {e}"));
                    return Some((Err(err), (rx, guard)));
                }
            }
        }
        None
    });
    Box::pin(rx)
}

/// The partition tasks of a map task: awaited once every partition is sent (a panic is an
/// error), aborted when the map task's stream is dropped first (failed, aborted).
struct PartitionTasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for PartitionTasks {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}
