//! Running a staged plan on the cluster: each stage as the scheduler runs it (its shuffle
//! and one map task per worker), pipelined, the root on the driver reading the last
//! exchanges, then per-stage metrics; every stage's shuffle dropped at the end.

use crate::codec::ExchangeCodec;
use crate::context::DistributedContext;
use crate::planner::StagedPlan;
use crate::result::StageMetrics;
use crate::skew::{self, SkewConfig};
use crate::source::StageTask;
use crate::writer::ShuffleWriterExec;
use crate::{Error, Result, STAGE_SOURCE};
use arrow::array::RecordBatch;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion_proto::bytes::physical_plan_to_bytes_with_extension_codec;
use flightshuffle::driver::{MapInput, ShuffleSpec};
use flightshuffle::proto;
use flightshuffle::scheduler::{run_pipelined, Deferred, StageRun};
use flightshuffle::strategy::StrategyOptions;
use prost::Message;
use std::sync::Arc;
use std::time::Instant;

impl DistributedContext {
    /// Run every stage and the driver's part at once (pipelined, see
    /// [`flightshuffle::scheduler`]); frees every shuffle, whatever the outcome.
    pub async fn execute(
        &self,
        staged: &StagedPlan,
    ) -> Result<(Vec<RecordBatch>, Vec<StageMetrics>)> {
        self.run_stages(staged, None).await
    }

    /// [`Self::execute`]; with `hold`, the driver's part reads nothing and the shuffle `hold`
    /// (the last stage's) is kept, sealed, for readers elsewhere ([`crate::held`]); it is
    /// freed too if the run fails.
    pub(crate) async fn run_stages(
        &self,
        staged: &StagedPlan,
        hold: Option<flightshuffle::block::ShuffleId>,
    ) -> Result<(Vec<RecordBatch>, Vec<StageMetrics>)> {
        // `auto` calibrates the machine once, before any stage of the query runs (a
        // calibration taken under a running stage's load would be kept for good).
        if staged
            .stages
            .iter()
            .any(|s| s.writer.strategy == flightshuffle::strategy::Strategy::Auto)
        {
            self.driver.calibration().await?;
        }
        let started = Instant::now();
        let rpcs_before = self.rpcs().await;
        let skew = self.skew_config();
        let combine = self.options().combine;
        let shuffle_of = |stage: &u32| {
            staged
                .stages
                .iter()
                .find(|s| s.id() == *stage)
                .map(|s| s.writer.shuffle)
        };
        let runs = staged
            .stages
            .iter()
            .map(|s| {
                let mut run = self.stage_run(s, &skew, combine)?;
                run.reads = s.inputs.iter().filter_map(shuffle_of).collect();
                Ok(run)
            })
            .collect::<Result<Vec<_>>>()?;
        let root_reads: Vec<_> = match hold {
            Some(_) => Vec::new(),
            None => staged.root_inputs.iter().filter_map(shuffle_of).collect(),
        };
        if let Some(store) = self.session_storage()? {
            for run in &runs {
                self.driver.use_storage(run.spec.id, store.as_ref())?;
            }
        }
        // Made again when a lost worker's stages were finished (the first one's rows dropped).
        let root = || async {
            if hold.is_some() {
                return Ok(Vec::new());
            }
            collect(staged.root.clone(), self.task_ctx())
                .await
                .map_err(root_error)
        };
        let result = run_pipelined(
            &self.driver,
            runs,
            &root_reads,
            root,
            started,
            self.strategy_options,
        )
        .await;
        let drops = staged
            .stages
            .iter()
            .filter(|s| result.is_err() || Some(s.writer.shuffle) != hold)
            .map(|s| self.driver.drop_shuffle(s.writer.shuffle));
        let _ = futures::future::join_all(drops).await;
        let (batches, reports) = result?;
        let rpcs = match (rpcs_before, self.rpcs().await) {
            (Some(a), Some(b)) => b.saturating_sub(a + self.driver.num_workers() as u64),
            _ => 0,
        };
        *self.last_rpcs.lock().unwrap_or_else(|p| p.into_inner()) = rpcs;
        let metrics = staged
            .stages
            .iter()
            .zip(reports)
            .map(|(s, r)| StageMetrics {
                stage: s.writer.stage,
                shuffle: r.shuffle.clone(),
                exchange: s.writer.describe(),
                tasks: r.tasks,
                rows: r.rows,
                bytes: r.bytes,
                blocks: r.blocks,
                spilled_bytes: r.spilled_bytes,
                max_partition_bytes: r.max_partition_bytes,
                strategy: r.strategy.clone(),
                median_partition_bytes: r.median_partition_bytes,
                seconds: r.end_s - r.start_s,
                start_s: r.start_s,
                first_commit_s: r.first_commit_s,
                end_s: r.end_s,
                stored_objects: r.stored_objects,
                stored_bytes: r.stored_bytes,
                store_gets: r.store_gets,
            })
            .collect();
        Ok((batches, metrics))
    }

    /// Flight calls the workers served so far (None if stats are unavailable).
    async fn rpcs(&self) -> Option<u64> {
        let stats = self.driver.stats().await.ok()?;
        Some(stats.iter().map(|s| s.rpcs).sum())
    }

    /// Flight calls the last query made (driver to workers and between workers).
    pub fn last_rpcs(&self) -> u64 {
        *self.last_rpcs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One stage as the scheduler runs it: its shuffle and its map tasks, one per worker
    /// ([`crate::writer::ShuffleWriterExec::task_groups`]). A stage that can split a skewed
    /// probe side ([`crate::skew`]) is deferred until its probe producer is sealed.
    fn stage_run(
        &self,
        stage: &crate::planner::Stage,
        skew: &SkewConfig,
        combine: bool,
    ) -> Result<StageRun> {
        let writer = &stage.writer;
        let spec = ShuffleSpec {
            id: writer.shuffle,
            schema: writer.input().schema(),
            partitions: writer.partitions,
            partitioner: writer.partitioner(),
            checksum_inputs: false,
            combine: match combine {
                true => crate::combine::spec_for(writer)?,
                false => None,
            },
        };
        let tasks = TaskBuilder {
            workers: self.driver.addresses(),
            timeout_secs: self.driver.config().rpc_timeout.as_secs(),
            batch_size: self.ctx.copied_config().batch_size() as u32,
            build_bounds: self.options().build_bounds,
        };
        // A sorted-run exchange's readers read each map output as one run: merging runs would
        // break them, so such an exchange moves its blocks with pull whatever it asks for.
        let strategy = match writer.kind {
            crate::writer::WriterKind::Merge => flightshuffle::strategy::Strategy::Pull,
            _ => writer.strategy,
        };
        let split = skew.enabled().then(|| skew::candidate(writer)).flatten();
        let Some((probe_stage, probe)) = split else {
            return Ok(StageRun {
                spec,
                inputs: tasks.inputs(writer)?,
                strategy,
                deferred: None,
                reads: Vec::new(),
                refresh: Some(Arc::new(refresh_workers)),
            });
        };
        let (writer, skew) = (writer.clone(), *skew);
        let decide = move |bytes: &[u64]| {
            let task_err = |e: Error| flightshuffle::Error::Task(e.to_string());
            match skew::decide(bytes, &skew) {
                None => Ok((tasks.inputs(&writer).map_err(task_err)?, String::new())),
                Some((layout, note)) => {
                    let split =
                        skew::apply(&writer, probe, &layout).map_err(|e| task_err(e.into()))?;
                    let inputs = tasks.inputs(&split).map_err(task_err)?;
                    Ok((inputs, format!("{note}, reading stage {probe_stage}")))
                }
            }
        };
        Ok(StageRun {
            spec,
            inputs: vec![],
            strategy,
            deferred: Some(Deferred {
                after: probe,
                decide: Box::new(decide),
            }),
            reads: Vec::new(),
            refresh: Some(Arc::new(refresh_workers)),
        })
    }

    /// [`Self::stage_run`] without skew splits or combining: a stage of an online query.
    pub(crate) fn stage_run_plain(&self, stage: &crate::planner::Stage) -> Result<StageRun> {
        let off = SkewConfig {
            factor: 0.0,
            min_bytes: u64::MAX,
            max_splits: 1,
        };
        self.stage_run(stage, &off, self.options().combine)
    }

    /// The knobs stages run with.
    pub(crate) fn strategy_options(&self) -> StrategyOptions {
        self.strategy_options
    }

    /// Skew-split settings of the session (`SET flightshuffle.skew_factor` and
    /// `flightshuffle.skew_min_bytes`).
    pub fn skew_config(&self) -> SkewConfig {
        let o = self.options();
        SkewConfig {
            factor: o.skew_factor,
            min_bytes: o.skew_min_bytes,
            max_splits: 2 * self.driver.num_workers() as u32,
        }
    }
}

/// Builds a stage's map tasks: one per worker, each running a group of the stage's partitions.
#[derive(Clone)]
struct TaskBuilder {
    workers: Vec<String>,
    timeout_secs: u64,
    batch_size: u32,
    build_bounds: bool,
}

impl TaskBuilder {
    fn inputs(&self, writer: &Arc<ShuffleWriterExec>) -> Result<Vec<MapInput>> {
        let plan = physical_plan_to_bytes_with_extension_codec(
            writer.clone() as Arc<dyn ExecutionPlan>,
            &ExchangeCodec,
        )?
        .to_vec();
        Ok(writer
            .task_groups(self.workers.len())
            .into_iter()
            .map(|partitions| {
                let task = StageTask {
                    plan: plan.clone(),
                    partitions,
                    workers: self.workers.clone(),
                    timeout_secs: self.timeout_secs,
                    batch_size: self.batch_size,
                    no_build_bounds: !self.build_bounds,
                };
                MapInput::Source(proto::TaskSource {
                    kind: STAGE_SOURCE.into(),
                    payload: task.encode_to_vec(),
                })
            })
            .collect())
    }
}

/// A failure of the driver's part as an exchange error: a lost worker, a failed call or a
/// timeout underneath stays one (so the scheduler can tell a loss and recover); anything
/// else is a task error.
fn root_error(e: datafusion::error::DataFusionError) -> flightshuffle::Error {
    use flightshuffle::Error as X;
    let text = e.to_string();
    let e = Error::from(e);
    match e.exchange() {
        Some(X::WorkerLost {
            worker,
            addr,
            reason,
            lost_blocks,
        }) => X::WorkerLost {
            worker: *worker,
            addr: addr.clone(),
            reason: reason.clone(),
            lost_blocks: *lost_blocks,
        },
        Some(X::Remote {
            worker,
            addr,
            code,
            message,
        }) => X::Remote {
            worker: *worker,
            addr: addr.clone(),
            code: *code,
            message: message.clone(),
        },
        Some(X::Timeout { what, seconds }) => X::Timeout {
            what: what.clone(),
            seconds: *seconds,
        },
        _ => X::Task(text),
    }
}

/// A stage task made for the workers' addresses now (a lost worker's replacement has
/// another); any other input as it is.
fn refresh_workers(input: MapInput, workers: &[String]) -> MapInput {
    let MapInput::Source(mut source) = input else {
        return input;
    };
    if source.kind == STAGE_SOURCE {
        if let Ok(mut task) = StageTask::decode(source.payload.as_slice()) {
            task.workers = workers.to_vec();
            source.payload = task.encode_to_vec();
        }
    }
    MapInput::Source(source)
}
