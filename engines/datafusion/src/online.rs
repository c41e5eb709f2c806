//! Online aggregation of distributed SQL (Hellerstein, Haas, Wang 1997), the native map side.
//!
//! The caller (the Python layer) rewrites a grouped aggregate into its *statistics query*
//! (per group: counts, sums, minima, maxima), names the fact table (the largest input) and
//! cuts it into splits (the sampling units), in a random order, and groups consecutive splits
//! into map tasks. Here:
//!
//! * [`plan`] plans the statistics query once, on the driver, with every join planned as a
//!   broadcast (the other join inputs are small next to the fact table). The stage that scans
//!   the fact table must end in DataFusion's partial aggregate; its scan becomes a
//!   [`SplitScanExec`] with one partition per split, and with terms the aggregate is followed
//!   by a [`SplitTotalsExec`] (each split's totals per group and the products of them the
//!   intervals need, see [`crate::split_totals`]). A map task runs the partitions of its
//!   splits, each joined with the broadcast build sides, which a worker builds once for all
//!   its splits (it decodes a stage plan once, see [`crate::source`]). A build side stored
//!   in the fact table's key order is read per split instead, only the pages whose keys the
//!   split can meet ([`crate::unit_builds`]).
//! * [`run`] runs the stages that feed the fact stage to completion first, then the fact stage
//!   under the streaming strategy with rounds by completion: its partial aggregates are
//!   hash-exchanged on the group keys into one fold partition per worker and folded there
//!   by [`PartialFold`] (the
//!   same `PartialReduce` aggregate in-exchange combining uses, see [`crate::fold`]), and
//!   each round's combined statistics go to the caller, which turns them into estimates
//!   (for `ORDER BY ... LIMIT k`, only the groups that can be among the first k).

use crate::codec::ExchangeCodec;
use crate::context::DistributedContext;
use crate::fact_side::{fact_on_probe_side, fact_scans, sampled_scans, streams_to, to_df};
use crate::planner::Stage;
use crate::source::StageTask;
use crate::writer::ShuffleWriterExec;
use crate::{Error, Result, STAGE_SOURCE};
use arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::DataFusionError;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use datafusion_proto::bytes::physical_plan_to_bytes_with_extension_codec;
use flightshuffle::driver::{MapInput, ShuffleSpec};
use flightshuffle::proto;
use flightshuffle::strategy::streaming::{self, Partial, StreamingJob};
use futures::future::BoxFuture;
use prost::Message;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub use crate::distinct_counts::DistinctCounts;
pub use crate::fold::{EmitTop, FoldEmit, PartialFold, PARTIAL_FOLD};

use crate::split::plan_err;
pub use crate::split::{FactSplit, SplitScanExec};
use crate::split_totals::{self, SplitTotalsExec};
pub use crate::split_totals::{Term, ONE, SIZE};

/// Why a query has no fact stage to stream: its inputs are small (it runs whole on the
/// driver), or its answer comes from file statistics. Callers run it whole instead.
pub const SMALL: &str = "the query is small enough to run whole";

/// The statistics query as it runs online.
pub struct OnlinePlan {
    /// The stages the fact stage reads (broadcast build sides), run to completion first.
    pub dims: Vec<Stage>,
    /// The fact stage: one partition per split, rooted at its partial aggregate's exchange.
    pub fact: Stage,
    /// What folds the fact stage's rows: an encoded [`crate::fold::FoldPayload`].
    pub fold: Vec<u8>,
    /// Columns of the folded statistics: the group columns, then one per statistic.
    pub schema: SchemaRef,
    /// The staged plan as `EXPLAIN` shows it.
    pub explain: String,
    /// The splits each map task reads (consecutive ranges of the splits, in order).
    pub tasks: Vec<std::ops::Range<usize>>,
    /// Rows of each split.
    pub split_rows: Vec<u64>,
    /// The session had `flightshuffle.build_bounds` off when the query was planned.
    pub no_build_bounds: bool,
}

/// Plans the query again, as the caller planned it first (over the same tables), with new
/// shuffles: for a run after a lost worker.
pub type Replan = Arc<dyn Fn() -> BoxFuture<'static, Result<OnlinePlan>> + Send + Sync>;

/// Plan `sql` (a grouped aggregate whose inputs include the fact table `splits` cut) for
/// online aggregation (see the module doc). `ctx` should plan joins as broadcasts
/// ([`DistributedContext::online_config`]). `emit` says what the folds send each round: with
/// `top`, only the groups that can be among the caller's first `top.k`; with `distinct`, a
/// COUNT(DISTINCT)'s counts per group (see [`crate::fold`]).
pub async fn plan(
    ctx: &DistributedContext,
    sql: &str,
    splits: Vec<FactSplit>,
    emit: FoldEmit,
    terms: Vec<Term>,
    per_task: Vec<u32>,
) -> Result<OnlinePlan> {
    if splits.is_empty() {
        return Err(plan_err("the fact table has no rows to split"));
    }
    let tasks = task_ranges(&per_task, splits.len())?;
    let files: HashSet<String> = splits
        .iter()
        .map(|s| {
            PartitionedFile::new(s.path.clone(), s.size)
                .path()
                .to_string()
        })
        .collect();
    let narrow_builds = ctx.options().narrow_builds;
    let staged = ctx
        .plan_rewritten(sql, None, |p| {
            let p = fact_on_probe_side(p, &files)?;
            match narrow_builds {
                true => Ok(crate::build_keys::narrow(p, &|side| {
                    Ok(fact_scans(side, &files).map_err(to_df)? > 0)
                })?),
                false => Ok(p),
            }
        })
        .await?;
    if let Some(why) = &staged.on_driver {
        return Err(plan_err(why));
    }
    // The one scan of the fact table that is sampled; any other reads it whole (the
    // filtering side of a semi or anti join: an `EXISTS` over the sampled table itself).
    let sampled = sampled_scans(&staged, &files)?;
    let (fact, sampled_scan) = match sampled.as_slice() {
        [] if fact_scans(&staged.root, &files)? > 0
            || staged.stages.iter().any(|s| {
                fact_scans(&(s.writer.clone() as Arc<dyn ExecutionPlan>), &files)
                    .is_ok_and(|n| n > 0)
            }) =>
        {
            return Err(plan_err(
                "the fact table is read only where its rows do not reach the result (the \
                 subquery side of a semi or anti join, the table of a LEFT JOIN)",
            ))
        }
        [] => return Err(plan_err(format!("no stage reads the fact table: {SMALL}"))),
        [(None, _)] => {
            return Err(plan_err(format!(
                "the fact table is read on the driver: {SMALL}"
            )))
        }
        [(Some(stage), scan)] => (stage.clone(), scan.clone()),
        _ => {
            return Err(plan_err(
                "the fact table is read more than once with its rows in the result (a \
                 self-join of the sampled table)",
            ))
        }
    };
    let agg = fact
        .writer
        .input()
        .downcast_ref::<AggregateExec>()
        .filter(|a| *a.mode() == AggregateMode::Partial)
        .ok_or_else(|| {
            plan_err(format!(
                "the stage reading the fact table must end in a partial aggregate, and ends \
                 in {} (the fact table is hash-joined or repartitioned before aggregating?); \
                 its plan:\n{}",
                fact.writer.input().name(),
                staged.display()
            ))
        })?;
    if !streams_to(&fact.writer.input().clone(), &sampled_scan) {
        return Err(plan_err(format!(
            "the fact table is on the build side of a join, which would read it whole before \
             any estimate (a self-join, or an outer join the plan could not turn); its \
             plan:\n{}",
            staged.display()
        )));
    }
    // With terms, the folds merge the widened states (see [`crate::split_totals`]).
    let folded = if terms.is_empty() {
        None
    } else {
        Some(split_totals::widened(agg, &terms)?)
    };
    let reduce = crate::combine::partial_reduce(folded.as_ref().unwrap_or(agg))?
        .ok_or_else(|| plan_err("the aggregate's partial states cannot be folded again"))?;
    let schema = folded.as_ref().unwrap_or(agg).schema();
    let n = schema.fields().len() as u32;
    if let Some(d) = &emit.distinct {
        if d.keys > n || d.value >= n || d.rows >= n {
            return Err(plan_err(format!(
                "the COUNT(DISTINCT) columns are outside the statistics' {n} columns"
            )));
        }
    }
    if let Some(t) = &emit.top {
        if let Some(c) = [Some(t.column), t.divisor]
            .into_iter()
            .flatten()
            .find(|c| *c >= n)
        {
            return Err(plan_err(format!(
                "the ordering column {c} is outside the statistics' {n} columns"
            )));
        }
    }
    let fold = crate::fold::FoldPayload {
        plan: reduce,
        top: emit.top.clone(),
        distinct: emit.distinct.clone(),
    }
    .encode_to_vec();
    // The stages the fact stage reads, transitively.
    let mut needed: HashSet<u32> = fact.inputs.iter().copied().collect();
    for s in staged.stages.iter().rev() {
        if needed.contains(&s.id()) {
            needed.extend(s.inputs.iter().copied());
        }
    }
    let dims: Vec<Stage> = staged
        .stages
        .iter()
        .filter(|s| needed.contains(&s.id()))
        .cloned()
        .collect();
    let n = splits.len();
    let input = fact
        .writer
        .input()
        .clone()
        .transform_up(|node| {
            if !Arc::ptr_eq(&node, &sampled_scan) {
                return Ok(Transformed::no(node));
            }
            let scan = node
                .downcast_ref::<DataSourceExec>()
                .ok_or_else(|| DataFusionError::Internal("a fact scan is a data source".into()))?;
            let split = SplitScanExec::try_new(scan, splits.clone())
                .map_err(|e| DataFusionError::Plan(e.to_string()))?;
            Ok(Transformed::yes(Arc::new(split) as Arc<dyn ExecutionPlan>))
        })?
        .data;
    // Build sides stored in the fact table's key order are read per split instead.
    let (input, inlined) = if ctx.options().unit_builds {
        let others: Vec<Stage> = staged
            .stages
            .iter()
            .filter(|s| s.id() != fact.id())
            .cloned()
            .collect();
        crate::unit_builds::apply(ctx, input, &splits, &others).await?
    } else {
        (input, Vec::new())
    };
    let dims: Vec<Stage> = dims
        .into_iter()
        .filter(|s| !inlined.contains(&s.id()))
        .collect();
    let mut fact_inputs: Vec<u32> = fact
        .inputs
        .iter()
        .copied()
        .filter(|i| !inlined.contains(i))
        .collect();
    for s in staged.stages.iter().filter(|s| inlined.contains(&s.id())) {
        fact_inputs.extend(s.inputs.iter().copied());
    }
    // A stage inlined into another inlined one (`key_trace::reorient`) is not read either.
    fact_inputs.retain(|i| !inlined.contains(i));
    fact_inputs.sort_unstable();
    fact_inputs.dedup();
    if input.output_partitioning().partition_count() != n {
        return Err(plan_err(format!(
            "the fact stage has {} partitions for {n} splits (a repartition between the scan \
             and the aggregate?)",
            input.output_partitioning().partition_count()
        )));
    }
    let input = if terms.is_empty() {
        input
    } else {
        let rows = splits.iter().map(|s| s.rows).collect();
        Arc::new(SplitTotalsExec::try_new(input, terms, rows)?) as Arc<dyn ExecutionPlan>
    };
    // One fold partition per worker, not the planner's count (cut for the cores of the whole
    // query): every round costs a fold task per partition, a call and a read of its blocks
    // from every worker.
    let mut writer = fact.writer.with_input(input);
    writer.partitions = fold_partitions(ctx.driver().num_workers(), writer.partitions);
    let writer = Arc::new(writer);
    crate::sendable::check(&(writer.clone() as Arc<dyn ExecutionPlan>), &ctx.task_ctx()).map_err(
        |why| {
            plan_err(format!(
                "the fact stage cannot be sent to the workers: {why}"
            ))
        },
    )?;
    let fact = Stage {
        writer,
        inputs: fact_inputs,
    };
    let explain = explain(&dims, &fact);
    Ok(OnlinePlan {
        dims,
        fact,
        fold,
        schema,
        explain,
        tasks,
        split_rows: splits.iter().map(|s| s.rows).collect(),
        no_build_bounds: !ctx.options().build_bounds,
    })
}

/// The splits of each map task: `per_task[i]` consecutive splits for task i (one each when
/// empty), which must cover the `n` splits exactly.
fn task_ranges(per_task: &[u32], n: usize) -> Result<Vec<std::ops::Range<usize>>> {
    if per_task.is_empty() {
        return Ok((0..n).map(|i| i..i + 1).collect());
    }
    let mut at = 0usize;
    let mut out = Vec::with_capacity(per_task.len());
    for &k in per_task {
        if k == 0 {
            return Err(plan_err("a map task of no splits"));
        }
        out.push(at..at + k as usize);
        at += k as usize;
    }
    if at != n {
        return Err(plan_err(format!("the map tasks read {at} splits of {n}")));
    }
    Ok(out)
}

/// Fold partitions of the fact stage's exchange on `workers` workers, where the planner cut
/// `planned` (1 without group keys): one per worker, at most as planned.
fn fold_partitions(workers: usize, planned: u32) -> u32 {
    (workers.max(1) as u32).min(planned.max(1))
}

/// What an online query runs, as `EXPLAIN` shows a query: the build stages, the fact stage
/// (one partition per split), then the folds.
fn explain(dims: &[Stage], fact: &Stage) -> String {
    let mut stages = dims.to_vec();
    stages.push(fact.clone());
    let mut out = crate::planner::display_stages(&stages);
    out.push_str(&format!(
        "Folds — stage {}'s partial aggregates, folded on the workers as its splits commit; \
         fold partitions: {}; the driver estimates from each round\n",
        fact.id(),
        fact.writer.partitions
    ));
    out
}

/// Run `plan`: its build sides to completion, then the fact stage in rounds by completion (an
/// early first round, then the other splits in `rounds` rounds as they commit), sending each
/// round's folded statistics to `out` (the last one is final), or the error that stopped it.
/// Every shuffle is dropped at the end.
///
/// A worker lost on the way (the driver replacing it) makes the query run again whole, planned
/// again by `replan`, once the replacement is up, at most [`crate::context::QUERY_RETRIES`]
/// times: the build sides and fold states it held are gone with it. Rounds already sent are
/// not sent again, so the caller sees one pause and then the next round.
pub async fn run(
    ctx: &DistributedContext,
    plan: OnlinePlan,
    rounds: usize,
    out: mpsc::Sender<flightshuffle::Result<Partial>>,
    replan: Replan,
) {
    let driver = ctx.driver().clone();
    let mut sent = 0usize;
    let mut retries = 0;
    let mut plan = plan;
    loop {
        let replacements = driver.replacements();
        let (tx, mut rx) = mpsc::channel(2);
        let attempt = run_once(ctx, &plan, rounds, tx);
        let forward = async {
            while let Some(item) = rx.recv().await {
                match item {
                    Ok(p) if p.round < sent => {}
                    Ok(p) => {
                        sent = p.round + 1;
                        if out.send(Ok(p)).await.is_err() {
                            return None;
                        }
                    }
                    Err(e) => return Some(e),
                }
            }
            None
        };
        let ((), failure) = tokio::join!(attempt, forward);
        let Some(e) = failure else { return };
        let lost = matches!(e, flightshuffle::Error::WorkerLost { .. })
            || driver.replacements() != replacements;
        if !(driver.replaces_workers() && lost && retries < crate::context::QUERY_RETRIES) {
            let _ = out.send(Err(e)).await;
            return;
        }
        retries += 1;
        driver.note_rerun();
        tracing::warn!(error = %e, retries, "worker lost during an online query: running it again");
        if let Err(e) = driver
            .wait_all_live(flightshuffle::driver::REPLACE_TIMEOUT)
            .await
        {
            let _ = out.send(Err(e)).await;
            return;
        }
        // New shuffles: a fold or map of the failed run still in flight on a worker must
        // not land in the next run's.
        plan = match replan().await {
            Ok(p) => p,
            Err(e) => {
                let _ = out
                    .send(Err(flightshuffle::Error::Task(e.to_string())))
                    .await;
                return;
            }
        };
    }
}

/// One run of [`run`]: errors go to `out` too.
async fn run_once(
    ctx: &DistributedContext,
    plan: &OnlinePlan,
    rounds: usize,
    out: mpsc::Sender<flightshuffle::Result<Partial>>,
) {
    let driver = ctx.driver().clone();
    let dims: Vec<_> = plan.dims.iter().map(|s| s.writer.shuffle).collect();
    let result = async {
        let started = Instant::now();
        let runs = plan
            .dims
            .iter()
            .map(|s| {
                let mut run = ctx.stage_run_plain(s)?;
                run.reads = s
                    .inputs
                    .iter()
                    .filter_map(|i| plan.dims.iter().find(|d| d.id() == *i))
                    .map(|d| d.writer.shuffle)
                    .collect();
                Ok(run)
            })
            .collect::<Result<Vec<_>>>()?;
        let opts = ctx.strategy_options();
        // The build sides, complete before the first split (none for a query over one table).
        if !runs.is_empty() {
            flightshuffle::scheduler::run_pipelined(
                &driver,
                runs,
                &dims,
                || async { Ok(()) },
                started,
                opts,
            )
            .await?;
        }
        let spec: ShuffleSpec = ctx.stage_run_plain(&plan.fact)?.spec;
        let job = StreamingJob {
            spec,
            inputs: split_tasks(ctx, &plan.fact.writer, &plan.tasks, plan.no_build_bounds)?,
            weights: plan
                .tasks
                .iter()
                .map(|r| plan.split_rows[r.clone()].iter().sum())
                .collect(),
            unit_sizes: plan
                .tasks
                .iter()
                .map(|r| plan.split_rows[r.clone()].to_vec())
                .collect(),
            rounds,
            by_completion: true,
            reducer: PARTIAL_FOLD.to_string(),
            payload: plan.fold.clone(),
        };
        streaming::run(&driver, job, opts, out.clone()).await;
        Ok::<_, Error>(())
    }
    .await;
    let drops = dims.iter().map(|id| driver.drop_shuffle(*id));
    let _ = futures::future::join_all(drops).await;
    if let Err(e) = result {
        let e = match e {
            Error::Exchange(e) => e,
            other => flightshuffle::Error::Task(other.to_string()),
        };
        let _ = out.send(Err(e)).await;
    }
}

/// One map task per range of splits: those partitions of the fact stage.
fn split_tasks(
    ctx: &DistributedContext,
    writer: &Arc<ShuffleWriterExec>,
    tasks: &[std::ops::Range<usize>],
    no_build_bounds: bool,
) -> Result<Vec<MapInput>> {
    let plan = physical_plan_to_bytes_with_extension_codec(
        writer.clone() as Arc<dyn ExecutionPlan>,
        &ExchangeCodec,
    )?
    .to_vec();
    let n = writer.input().output_partitioning().partition_count();
    if tasks.last().map_or(0, |r| r.end) != n {
        return Err(plan_err(format!(
            "map tasks for {n} splits do not cover them"
        )));
    }
    let workers = ctx.driver().addresses();
    let timeout_secs = ctx.driver().config().rpc_timeout.as_secs();
    let batch_size = ctx.session().copied_config().batch_size() as u32;
    Ok(tasks
        .iter()
        .map(|r| {
            let task = StageTask {
                plan: plan.clone(),
                partitions: r.clone().map(|p| p as u32).collect(),
                workers: workers.clone(),
                timeout_secs,
                batch_size,
                no_build_bounds,
            };
            MapInput::Source(proto::TaskSource {
                kind: STAGE_SOURCE.into(),
                payload: task.encode_to_vec(),
            })
        })
        .collect())
}
