//! The stage planner: cuts a physical plan into a DAG of stages at every node that moves rows
//! between partitions, so that every stage partition can run as an independent map task.
//!
//! Boundaries and what replaces them:
//! * `RepartitionExec` hash → a stage whose writer hashes the key columns into R partitions
//!   (plain columns where they are, other key expressions appended); the consumer reads
//!   partition p from every worker. Round-robin likewise.
//! * `CoalescePartitionsExec` over several partitions → a *gather* stage (one partition); the
//!   consumer keeps the coalesce (and its fetch) over a one-partition reader. This is also how
//!   `CollectLeft` hash joins (and cross / nested-loop joins) are distributed: their build side
//!   is coalesced, so every task of the probe stage reads the whole gathered build side — a
//!   broadcast. DataFusion only picks `CollectLeft` for small build sides (its
//!   `hash_join_single_partition_threshold`), where a broadcast is cheaper than shuffling the
//!   probe side; larger joins are planned `Partitioned` and become hash exchanges above.
//! * `SortPreservingMergeExec` over several partitions → a stage writing each sorted partition
//!   as one run; the consumer reads run p as its partition p and merges them as before.
//!
//! * A `CollectLeft` join that emits build-side rows at its end (left outer, full, left
//!   semi/anti/mark) relies on every probe partition of one plan instance reporting to the
//!   last one; as independent tasks they never would. Such hash joins are re-planned
//!   `Partitioned` (both sides hash-exchanged on the join keys, same partition count), the
//!   probe side first cut down by a broadcast semi join with the build side to the rows that
//!   can meet it (unless it is a full or `NOT IN` join, which need the others); such
//!   nested-loop joins get their probe side gathered and their output dealt back out.
//!
//! * A gather of a *small* subtree that reads no exchange (nation, region, a filtered
//!   dimension table: DataFusion's statistics say at most [`SMALL_GATHER_ROWS`] rows) is not
//!   cut: every consumer computes it itself from the files, which costs less than a stage, its
//!   calls and a network hop (a worker decodes a stage plan once, so a `CollectLeft` build side
//!   built this way is built once per worker). So is a broadcast join's build side that only
//!   reads columns of a table, up to [`PLAIN_SCAN_GATHER_ROWS`] rows. A query over small
//!   tables only runs whole on the driver.
//! * A gather straight over an exchange reads all of its partitions in place (no stage of its
//!   own), and a node that several consumers share (a build side that a reduced probe side
//!   and a join both read; a semi join's keys copied below a join, [`crate::semi_pushdown`])
//!   is cut into one stage, which they all read.
//!
//! Parquet scans need no boundary: their file groups are the stage's partitions, so map tasks
//! split the scan across workers. A plan whose root has several partitions gets a final gather
//! so that only the last, single-partition step runs on the driver.

use crate::gathers::{build_side_gathers, is_plain_scan, is_small};
pub use crate::gathers::{scanned_rows, PLAIN_SCAN_GATHER_ROWS, SMALL_GATHER_ROWS};
use crate::reader::{ReadMode, ShuffleReaderExec};
use crate::subtree::{any_node, volatile};
use crate::writer::{ShuffleWriterExec, WriterKind, KEY_PREFIX};
use datafusion::common::JoinType;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{Partitioning, PhysicalExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, NestedLoopJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{
    displayable, replace_children_if_necessary, ExecutionPlan, ExecutionPlanProperties,
};
use flightshuffle::strategy::Strategy;
use flightshuffle::ShuffleId;
use std::sync::Arc;

/// One producing stage: its writer (root) and the stages it reads from.
#[derive(Debug, Clone)]
pub struct Stage {
    /// The stage's plan, rooted at the shuffle writer of its exchange.
    pub writer: Arc<ShuffleWriterExec>,
    /// Ids of the stages it reads from.
    pub inputs: Vec<u32>,
}

impl Stage {
    /// The stage's id (its writer's stage number).
    pub fn id(&self) -> u32 {
        self.writer.stage
    }
}

/// Stages in dependency order (every stage after the stages it reads) and the driver's part.
#[derive(Debug, Clone)]
pub struct StagedPlan {
    /// The producing stages, run on the workers.
    pub stages: Vec<Stage>,
    /// The driver's part, yielding the query's rows (the whole plan when it runs on the driver).
    pub root: Arc<dyn ExecutionPlan>,
    /// Ids of the stages the driver's part reads from.
    pub root_inputs: Vec<u32>,
    /// Why the whole query runs on the driver although it has exchanges: a stage plan would
    /// not reach the workers unchanged (see [`crate::sendable`]).
    pub on_driver: Option<String>,
}

impl StagedPlan {
    /// Choose the exchange strategy of one stage (stage ids start at 1).
    pub fn set_strategy(&mut self, stage: u32, strategy: Strategy) -> Result<()> {
        let s = self
            .stages
            .iter_mut()
            .find(|s| s.id() == stage)
            .ok_or_else(|| DataFusionError::Plan(format!("no stage {stage}")))?;
        s.writer = Arc::new(s.writer.with_strategy(strategy));
        Ok(())
    }

    /// Every stage, indented, then the driver's part: what `EXPLAIN` prints.
    pub fn display(&self) -> String {
        let mut out = display_stages(&self.stages);
        match &self.on_driver {
            Some(why) => out.push_str(&format!("Driver — runs the whole query: {why}\n")),
            None => out.push_str(&format!("Driver — reads stages {:?}\n", self.root_inputs)),
        }
        out.push_str(&indent(
            &displayable(self.root.as_ref()).indent(true).to_string(),
        ));
        out
    }
}

/// `stages`, each with its exchange and its plan indented (the first part of
/// [`StagedPlan::display`]).
pub fn display_stages(stages: &[Stage]) -> String {
    let mut out = String::new();
    for s in stages {
        let reads = if s.inputs.is_empty() {
            String::new()
        } else {
            format!(", reads stages {:?}", s.inputs)
        };
        out.push_str(&format!(
            "Stage {} — {} partitions, exchange: {} (strategy {}){reads}\n",
            s.id(),
            s.writer.tasks(),
            s.writer.describe(),
            s.writer.strategy,
        ));
        out.push_str(&indent(
            &displayable(s.writer.as_ref()).indent(true).to_string(),
        ));
    }
    out
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}

struct Planner {
    stages: Vec<Stage>,
    /// Gathers of exchange-free subtrees this small (in rows) are not cut.
    small_gather_rows: usize,
    /// Nodes cut already, by address (kept alive here), and what they became: a node that
    /// several consumers share (a semi join's build side, see [`crate::semi_pushdown`]) is
    /// cut into one stage, which they all read.
    cut: std::collections::HashMap<usize, Cut>,
    /// Gathers that are a broadcast join's build side, by address: those over a plain scan
    /// (see [`PLAIN_SCAN_GATHER_ROWS`]) are not cut either.
    build_sides: std::collections::HashSet<usize>,
    /// See [`JoinRewrites::plain_build_rows`].
    plain_build_rows: u64,
    /// See [`JoinRewrites::small_build_stages_in_place`].
    in_place_builds: bool,
    /// Nodes reached from more than one parent, by address.
    shared: std::collections::HashSet<usize>,
}

/// A node the planner cut: the node itself, what replaced it, and the stages that reads.
type Cut = (Arc<dyn ExecutionPlan>, Arc<dyn ExecutionPlan>, Vec<u32>);

/// Cut `plan` into stages, with the default small-gather threshold ([`SMALL_GATHER_ROWS`]).
pub fn plan_stages(plan: Arc<dyn ExecutionPlan>) -> Result<StagedPlan> {
    plan_stages_with(plan, SMALL_GATHER_ROWS)
}

/// Cut `plan` into stages; a gather of an exchange-free subtree whose every node has at most
/// `small_gather_rows` rows is left to its consumers (0: every gather is cut).
pub fn plan_stages_with(
    plan: Arc<dyn ExecutionPlan>,
    small_gather_rows: usize,
) -> Result<StagedPlan> {
    plan_stages_reducing(plan, small_gather_rows, JoinRewrites::default())
}

/// Which rewrites cut a join's inputs down before their exchanges (all on by default).
#[derive(Clone, Copy, Debug)]
pub struct JoinRewrites {
    /// Cut the probe side of a re-partitioned join that emits build rows down to the rows
    /// that meet the build side first (see `independent_joins`).
    pub reduce_probe_sides: bool,
    /// Cut a partitioned join's large side down to the rows meeting its small side
    /// ([`crate::side_reduction`]).
    pub reduce_large_sides: bool,
    /// Copy broadcast semi joins below the inner joins they filter
    /// ([`crate::semi_pushdown`]).
    pub push_semi_joins: bool,
    /// A broadcast join's build side that is a plain scan of at most this many rows is read
    /// by each consumer from the files, not cut into a stage (0: never; see
    /// [`PLAIN_SCAN_GATHER_ROWS`]).
    pub plain_build_rows: u64,
    /// Compute a small build side with exchanges inside whole on each worker, not cut into
    /// stages (see `Planner::in_place`).
    pub small_build_stages_in_place: bool,
}

impl Default for JoinRewrites {
    fn default() -> Self {
        JoinRewrites {
            reduce_probe_sides: true,
            reduce_large_sides: true,
            push_semi_joins: true,
            plain_build_rows: PLAIN_SCAN_GATHER_ROWS,
            small_build_stages_in_place: true,
        }
    }
}

/// [`plan_stages_with`], with the join rewrites `rewrites` asks for.
pub fn plan_stages_reducing(
    plan: Arc<dyn ExecutionPlan>,
    small_gather_rows: usize,
    rewrites: JoinRewrites,
) -> Result<StagedPlan> {
    let plan = if plan.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(plan)) as Arc<dyn ExecutionPlan>
    } else {
        plan
    };
    let plan = independent_joins(plan, rewrites.reduce_probe_sides)?;
    let plan = match rewrites.reduce_large_sides {
        true => crate::side_reduction::reduce_large_sides(plan)?,
        false => plan,
    };
    let plan = match rewrites.push_semi_joins {
        true => crate::semi_pushdown::push_semi_joins(plan)?,
        false => plan,
    };
    let mut planner = Planner {
        stages: Vec::new(),
        small_gather_rows,
        cut: Default::default(),
        build_sides: Default::default(),
        plain_build_rows: 0,
        in_place_builds: false,
        shared: Default::default(),
    };
    planner.build_sides = build_side_gathers(&plan);
    planner.plain_build_rows = rewrites.plain_build_rows;
    planner.in_place_builds = rewrites.small_build_stages_in_place;
    planner.shared = shared_nodes(&plan);
    let (root, root_inputs) = planner.cut(plan)?;
    Ok(StagedPlan {
        stages: planner.stages,
        root,
        root_inputs,
        on_driver: None,
    })
}

/// A plan the planner left whole on the driver (no exchange in it; a query over small tables)
/// as one stage of one task on a worker, the driver only reading its output: for callers
/// that want every query's work on the workers (the sqllogictest runner, tests).
pub fn on_workers(staged: StagedPlan) -> StagedPlan {
    if !staged.stages.is_empty() {
        return staged;
    }
    let mut planner = Planner {
        stages: Vec::new(),
        small_gather_rows: 0,
        cut: Default::default(),
        build_sides: Default::default(),
        plain_build_rows: 0,
        in_place_builds: false,
        shared: Default::default(),
    };
    let root = staged.root;
    let schema = root.schema();
    let tasks = root.output_partitioning().partition_count();
    let writer = planner.add_stage(root, vec![], WriterKind::Gather, 1, vec![]);
    let reader: Arc<dyn ExecutionPlan> = Arc::new(ShuffleReaderExec::new(
        writer.stage,
        writer.shuffle,
        ReadMode::Partition,
        schema,
        1,
    ));
    let root = match tasks {
        1 => reader,
        _ => Arc::new(CoalescePartitionsExec::new(reader)),
    };
    StagedPlan {
        stages: planner.stages,
        root,
        root_inputs: vec![writer.stage],
        on_driver: staged.on_driver,
    }
}

/// The columns (name, index) of hash partitioning expressions that are all plain columns.
fn key_columns(
    exprs: &[Arc<dyn datafusion::physical_plan::PhysicalExpr>],
) -> Option<Vec<(String, usize)>> {
    exprs
        .iter()
        .map(|e| {
            e.downcast_ref::<datafusion::physical_expr::expressions::Column>()
                .map(|c| (c.name().to_string(), c.index()))
        })
        .collect()
}

/// `staged` with its driver's part cut into one more stage on the workers, gathered into one
/// partition that no one reads here (a query result left on the workers, see [`crate::held`]):
/// the driver's part's partitions become that stage's (a final coalesce is dropped: each
/// task's rows stay where it ran). A driver's part that only reads one gathered partition
/// adds nothing: that gather's exchange holds the result. None when the query runs whole on
/// the driver. Returns the holding stage's id too.
pub fn hold_on_workers(staged: &StagedPlan) -> Option<(StagedPlan, u32)> {
    if staged.on_driver.is_some() {
        return None;
    }
    let root = staged.root.clone();
    let body = match root.downcast_ref::<CoalescePartitionsExec>() {
        Some(c) => c.input().clone(),
        None => root,
    };
    // The driver's part only reads a gathered partition whole: that exchange holds the result.
    if let Some(r) = body.downcast_ref::<ShuffleReaderExec>() {
        let gathered = matches!(r.mode, ReadMode::Partition)
            && r.layout.is_none()
            && r.partitions() == 1
            && staged.root_inputs == [r.stage];
        if gathered {
            return Some((staged.clone(), r.stage));
        }
    }
    let schema = body.schema();
    let mut planner = Planner {
        stages: staged.stages.clone(),
        small_gather_rows: 0,
        cut: Default::default(),
        build_sides: Default::default(),
        plain_build_rows: 0,
        in_place_builds: false,
        shared: Default::default(),
    };
    let writer = planner.add_stage(
        body,
        staged.root_inputs.clone(),
        WriterKind::Gather,
        1,
        vec![],
    );
    let reader: Arc<dyn ExecutionPlan> = Arc::new(ShuffleReaderExec::new(
        writer.stage,
        writer.shuffle,
        ReadMode::Partition,
        schema,
        1,
    ));
    Some((
        StagedPlan {
            stages: planner.stages,
            root: reader,
            root_inputs: vec![writer.stage],
            on_driver: None,
        },
        writer.stage,
    ))
}

impl Planner {
    fn add_stage(
        &mut self,
        input: Arc<dyn ExecutionPlan>,
        inputs: Vec<u32>,
        kind: WriterKind,
        partitions: usize,
        keys: Vec<String>,
    ) -> Arc<ShuffleWriterExec> {
        let id = self.stages.len() as u32 + 1;
        let writer = Arc::new(ShuffleWriterExec::new(
            input,
            id,
            ShuffleId::random(),
            kind,
            partitions as u32,
            keys,
        ));
        self.stages.push(Stage {
            writer: writer.clone(),
            inputs,
        });
        writer
    }

    /// Whether `plan` is a broadcast join's build side small enough by DataFusion's estimates
    /// (every node, its scans too: [`SMALL_GATHER_ROWS`]) to be computed whole by each worker,
    /// exchanges and all, instead of cut into stages: an aggregate over a small table, as a
    /// scalar subquery's (TPC-DS q06's average price per category over `item`). Its
    /// repartitions then run inside the worker's one plan instance, whose join builds them
    /// once, as one process does. Not with a volatile expression or a limit, nor an operator
    /// whose rows depend on the order they arrive in (each worker would get other rows: see
    /// [`same_rows`]), nor a node reached from two parents (executed twice on one plan
    /// instance where it is not encoded, as on the driver, a repartition would fail).
    fn in_place(&self, plan: &Arc<dyn ExecutionPlan>) -> bool {
        let Some(gather) = plan.downcast_ref::<CoalescePartitionsExec>() else {
            return false;
        };
        self.in_place_builds
            && self.small_gather_rows > 0
            && gather.fetch().is_none()
            && self
                .build_sides
                .contains(&(Arc::as_ptr(plan) as *const () as usize))
            && any_node(gather.input(), &|p| {
                p.downcast_ref::<RepartitionExec>().is_some()
            })
            && !volatile(gather.input())
            && !any_node(plan, &|p| {
                self.shared
                    .contains(&(Arc::as_ptr(p) as *const () as usize))
                    || !same_rows(p)
            })
            && is_small(gather.input(), self.small_gather_rows)
    }

    /// Rewrite `plan` bottom-up; returns the new plan and the stages it reads. A node met
    /// again (shared by several consumers) becomes what it became the first time.
    fn cut(&mut self, plan: Arc<dyn ExecutionPlan>) -> Result<(Arc<dyn ExecutionPlan>, Vec<u32>)> {
        let key = Arc::as_ptr(&plan) as *const () as usize;
        if let Some((_, out, deps)) = self.cut.get(&key) {
            return Ok((out.clone(), deps.clone()));
        }
        let (out, deps) = self.cut_once(plan.clone())?;
        self.cut.insert(key, (plan, out.clone(), deps.clone()));
        Ok((out, deps))
    }

    fn cut_once(
        &mut self,
        plan: Arc<dyn ExecutionPlan>,
    ) -> Result<(Arc<dyn ExecutionPlan>, Vec<u32>)> {
        if self.in_place(&plan) {
            return Ok((plan, Vec::new()));
        }
        let mut children = Vec::new();
        let mut deps = Vec::new();
        for c in plan.children() {
            let (c, d) = self.cut(c.clone())?;
            children.push(c);
            deps.extend(d);
        }
        if let Some(r) = plan.downcast_ref::<RepartitionExec>() {
            let child = children.swap_remove(0);
            let schema = child.schema();
            let (kind, n, input, keys, columns) = match r.partitioning() {
                Partitioning::Hash(exprs, n) => {
                    let (input, keys) = with_key_columns(child.clone(), exprs)?;
                    (WriterKind::Hash, *n, input, keys, key_columns(exprs))
                }
                other => (
                    WriterKind::RoundRobin,
                    other.partition_count(),
                    child.clone(),
                    vec![],
                    None,
                ),
            };
            let writer = self.add_stage(input, deps, kind, n, keys);
            let mut reader = ShuffleReaderExec::new(
                writer.stage,
                writer.shuffle,
                ReadMode::Partition,
                schema,
                n,
            );
            // Reported hashed as the repartition was: a union's InterleaveExec above it
            // needs its inputs partitioned alike.
            if let Some(columns) = columns {
                reader = reader.with_hash_keys(columns);
            }
            let reader: Arc<dyn ExecutionPlan> = Arc::new(reader);
            // A sort-preserving repartition promised sorted partitions: restore the order.
            let out = match (r.preserve_order(), child.output_ordering()) {
                (true, Some(order)) => {
                    Arc::new(SortExec::new(order.clone(), reader).with_preserve_partitioning(true))
                        as Arc<dyn ExecutionPlan>
                }
                _ => reader,
            };
            return Ok((out, vec![writer.stage]));
        }
        let gather = plan.downcast_ref::<CoalescePartitionsExec>().is_some();
        let merge = plan.downcast_ref::<SortPreservingMergeExec>().is_some();
        if gather
            && deps.is_empty()
            && self.small_gather_rows > 0
            && (is_small(&children[0], self.small_gather_rows)
                || (self
                    .build_sides
                    .contains(&(Arc::as_ptr(&plan) as *const () as usize))
                    && plan.fetch().is_none()
                    && is_plain_scan(&children[0], self.plain_build_rows)))
        {
            return Ok((replace_children_if_necessary(plan, children)?, deps));
        }
        // A gather straight over an exchange (a build side read whole by every task, as the
        // probe side reduction above makes) reads all its partitions in place: no stage.
        let over_exchange = gather
            && children.first().is_some_and(|c| {
                c.downcast_ref::<ShuffleReaderExec>()
                    .is_some_and(|r| matches!(r.mode, ReadMode::Partition) && r.layout.is_none())
            });
        if gather && over_exchange {
            return Ok((replace_children_if_necessary(plan, children)?, deps));
        }
        if (gather || merge) && children[0].output_partitioning().partition_count() > 1 {
            let child = children.swap_remove(0);
            let runs = child.output_partitioning().partition_count();
            let schema = child.schema();
            let (kind, mode, partitions) = if merge {
                (WriterKind::Merge, ReadMode::MapOutput, runs)
            } else {
                (WriterKind::Gather, ReadMode::Partition, 1)
            };
            let writer = self.add_stage(child, deps, kind, 1, vec![]);
            let reader: Arc<dyn ExecutionPlan> = Arc::new(ShuffleReaderExec::new(
                writer.stage,
                writer.shuffle,
                mode,
                schema,
                partitions,
            ));
            let out = replace_children_if_necessary(plan, vec![reader])?;
            return Ok((out, vec![writer.stage]));
        }
        Ok((replace_children_if_necessary(plan, children)?, deps))
    }
}

/// The nodes of `plan` reached from more than one parent (a node several consumers share,
/// see [`crate::semi_pushdown`]), by address.
fn shared_nodes(plan: &Arc<dyn ExecutionPlan>) -> std::collections::HashSet<usize> {
    let mut parents: std::collections::HashMap<usize, usize> = Default::default();
    let mut walked = std::collections::HashSet::new();
    let mut todo = vec![plan.clone()];
    while let Some(p) = todo.pop() {
        if !walked.insert(Arc::as_ptr(&p) as *const () as usize) {
            continue;
        }
        for c in p.children() {
            *parents
                .entry(Arc::as_ptr(c) as *const () as usize)
                .or_default() += 1;
            todo.push(c.clone());
        }
    }
    parents
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, _)| k)
        .collect()
}

/// Whether `plan`'s rows do not depend on the order its input rows arrive in, as a
/// repartition delivers them: not a window function (ties numbered in arrival order), nor
/// an aggregate but COUNT, SUM, MIN, MAX and AVG (FIRST_VALUE, ARRAY_AGG, STRING_AGG without
/// an order, approximate aggregates give what came first).
fn same_rows(plan: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::physical_plan::aggregates::AggregateExec;
    if plan.name().contains("WindowAgg") {
        return false;
    }
    match plan.downcast_ref::<AggregateExec>() {
        Some(a) => a.aggr_expr().iter().all(|e| {
            matches!(
                e.fun().name().to_ascii_lowercase().as_str(),
                "count" | "sum" | "min" | "max" | "avg"
            )
        }),
        None => true,
    }
}

/// Whether the probe side of `j` (a `CollectLeft` join emitting build rows, about to be
/// partitioned) may be cut down to the probe rows that meet some build row on its keys and
/// filter: its output never holds an unmatched probe row. Not a full join (it emits those),
/// nor `NOT IN`'s null-aware anti join (a NULL key anywhere on the probe side empties it), nor
/// a join whose row count stops it early.
///
/// Only where it is likely to pay: a build side that filters its rows (an unfiltered
/// dimension meets every probe row of a foreign key; TPC-H q13 took 1.27× → 1.48× one process
/// with it). The probe side then waits for the build side's exchange to be whole. TPC-H SF1,
/// 2 workers: q4 moved 32 MB → 4 MB, 2.13× → 1.44× one process
/// (`docs/bench/small-queries.md`).
fn reducible(j: &HashJoinExec, build: &Arc<dyn ExecutionPlan>) -> bool {
    matches!(
        j.join_type(),
        JoinType::Left | JoinType::LeftSemi | JoinType::LeftAnti | JoinType::LeftMark
    ) && !j.null_aware
        && j.fetch().is_none()
        && any_node(build, &|p| p.downcast_ref::<FilterExec>().is_some())
        && !volatile(build)
}

/// A join's build side without the gather DataFusion put over it; a gather that also limits
/// the rows (`fetch`, from a `LIMIT` pushed into it) is kept.
fn without_gather(left: &Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    match left.downcast_ref::<CoalescePartitionsExec>() {
        Some(c) if c.fetch().is_none() => c.input().clone(),
        _ => left.clone(),
    }
}

/// Join types whose build-side rows are emitted after the whole probe side was seen.
fn emits_build_rows(t: &JoinType) -> bool {
    matches!(
        t,
        JoinType::Left
            | JoinType::Full
            | JoinType::LeftSemi
            | JoinType::LeftAnti
            | JoinType::LeftMark
    )
}

/// Rewrite joins whose partitions coordinate inside one plan instance (see module doc).
fn independent_joins(
    plan: Arc<dyn ExecutionPlan>,
    reduce_probes: bool,
) -> Result<Arc<dyn ExecutionPlan>> {
    let children = plan
        .children()
        .into_iter()
        .map(|c| independent_joins(c.clone(), reduce_probes))
        .collect::<Result<Vec<_>>>()?;
    let plan = replace_children_if_necessary(plan, children)?;
    if let Some(j) = plan.downcast_ref::<HashJoinExec>() {
        let n = j.right().output_partitioning().partition_count();
        if j.null_aware && n > 1 {
            // `NOT IN (subquery)`: one NULL anywhere on the probe side empties the result, and
            // the probe partitions learn of it through their one plan instance. Partitions on
            // different workers would not: the join runs as one partition.
            let build = without_gather(j.left());
            let left = Arc::new(CoalescePartitionsExec::new(build));
            let right = Arc::new(CoalescePartitionsExec::new(j.right().clone()));
            return j
                .builder()
                .with_partition_mode(PartitionMode::CollectLeft)
                .with_new_children(vec![left, right])?
                .reset_state()
                .build_exec();
        }
        if *j.partition_mode() == PartitionMode::CollectLeft
            && emits_build_rows(j.join_type())
            && n > 1
        {
            let (lk, rk): (Vec<_>, Vec<_>) = j.on().iter().cloned().unzip();
            let build = without_gather(j.left());
            let reduce = reduce_probes && reducible(j, &build);
            let left: Arc<dyn ExecutionPlan> =
                Arc::new(RepartitionExec::try_new(build, Partitioning::Hash(lk, n))?);
            // The probe side is cut down first to the rows that can meet a build row: every
            // partition of the build side's exchange, read whole (small: DataFusion collected
            // it), keeps them, probe row by probe row, so only those cross the network. The
            // exchange is the same node, cut into one stage that both read.
            let probe = match reduce {
                true => j
                    .builder()
                    .with_type(JoinType::RightSemi)
                    .with_projection(None)
                    .with_fetch(None)
                    .with_new_children(vec![
                        Arc::new(CoalescePartitionsExec::new(left.clone())),
                        j.right().clone(),
                    ])?
                    .with_partition_mode(PartitionMode::CollectLeft)
                    .reset_state()
                    .build_exec()?,
                false => j.right().clone(),
            };
            let right = Arc::new(RepartitionExec::try_new(probe, Partitioning::Hash(rk, n))?);
            return j
                .builder()
                .with_partition_mode(PartitionMode::Partitioned)
                .with_new_children(vec![left, right])?
                .reset_state()
                .build_exec();
        }
    }
    if let Some(j) = plan.downcast_ref::<NestedLoopJoinExec>() {
        let n = j.right().output_partitioning().partition_count();
        if emits_build_rows(j.join_type()) && n > 1 {
            let right = Arc::new(CoalescePartitionsExec::new(j.right().clone()));
            let single =
                replace_children_if_necessary(plan.clone(), vec![j.left().clone(), right])?;
            return Ok(Arc::new(RepartitionExec::try_new(
                single,
                Partitioning::RoundRobinBatch(n),
            )?));
        }
    }
    Ok(plan)
}

/// The key columns the exchange hashes: a hash expression that is a plain column (with a name
/// no other column has) is hashed where it is; any other expression is appended as a trailing
/// `__fs_key_<k>` column (readers drop trailing columns beyond their schema). Not copying plain
/// key columns keeps every shuffled row that much smaller.
fn with_key_columns(
    child: Arc<dyn ExecutionPlan>,
    exprs: &[Arc<dyn PhysicalExpr>],
) -> Result<(Arc<dyn ExecutionPlan>, Vec<String>)> {
    let schema = child.schema();
    let unique = |name: &str| schema.fields().iter().filter(|f| f.name() == name).count() == 1;
    let mut appended: Vec<(Arc<dyn PhysicalExpr>, String)> = Vec::new();
    let mut keys = Vec::with_capacity(exprs.len());
    for (k, e) in exprs.iter().enumerate() {
        match e.downcast_ref::<Column>() {
            Some(c) if unique(c.name()) && schema.index_of(c.name()).ok() == Some(c.index()) => {
                keys.push(c.name().to_string())
            }
            _ => {
                let name = format!("{KEY_PREFIX}{k}");
                appended.push((e.clone(), name.clone()));
                keys.push(name);
            }
        }
    }
    if appended.is_empty() {
        return Ok((child, keys));
    }
    let mut projection: Vec<(Arc<dyn PhysicalExpr>, String)> = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            (
                Arc::new(Column::new(f.name(), i)) as Arc<dyn PhysicalExpr>,
                f.name().clone(),
            )
        })
        .collect();
    projection.extend(appended);
    Ok((Arc::new(ProjectionExec::try_new(projection, child)?), keys))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{binary, col, lit};
    use datafusion::physical_plan::empty::EmptyExec;

    fn hash_stage(key: impl Fn(&Schema) -> Arc<dyn PhysicalExpr>) -> (Stage, Vec<String>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Utf8, true),
        ]));
        let scan = Arc::new(EmptyExec::new(schema.clone()).with_partitions(2));
        let plan = Arc::new(
            RepartitionExec::try_new(scan, Partitioning::Hash(vec![key(&schema)], 4)).unwrap(),
        );
        let staged = plan_stages_with(plan, 0).unwrap();
        let stage = staged.stages[0].clone();
        let fields = stage
            .writer
            .input()
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        (stage, fields)
    }

    #[test]
    fn plain_key_columns_are_hashed_in_place() {
        let (stage, fields) = hash_stage(|s| col("b", s).unwrap());
        assert_eq!(stage.writer.keys, vec!["b".to_string()]);
        assert_eq!(fields, vec!["a", "b"]);
    }

    #[test]
    fn key_expressions_are_appended_as_key_columns() {
        let (stage, fields) =
            hash_stage(|s| binary(col("a", s).unwrap(), Operator::Plus, lit(1i64), s).unwrap());
        assert_eq!(stage.writer.keys, vec![format!("{KEY_PREFIX}0")]);
        assert_eq!(fields, vec!["a", "b", "__fs_key_0"]);
    }
}
