//! Online aggregation: a broadcast join's build side cut down to the keys a join below it
//! on the fact table's path already allows.
//!
//! TPC-H Q9 joins each `lineitem` row with `part` (only the 5% of parts named `%green%`) and
//! then with `partsupp` on the same part key. Every row that reaches `partsupp`'s join holds
//! a green part's key, so `partsupp`'s rows of other parts never match, yet every worker
//! hashed all 8 M of them (at SF10) before the first unit. [`narrow`] puts a semi join with
//! the lower join's build side (the same node, so one stage) under such a build side: 430 K
//! rows are built instead.
//!
//! Exact: the upper join compares its build key `b` with a probe column that, on every row
//! reaching it, holds a value the lower join matched with one of its build keys (a column
//! passed up unchanged from the lower join's probe key, through projections, filters and the
//! probe sides of broadcast joins). A build row whose `b` is none of those keys meets no
//! probe row. The upper join must not emit unmatched build rows (inner, right, right-semi and
//! right-anti joins), neither join may match NULLs, and the keys are plain columns of one
//! type. Done only where it pays by DataFusion's estimates: the build side at least
//! [`MIN_ROWS`] rows and [`RATIO`] times the lower build side's, which its filters cut to at
//! most [`MAX_SHARE`] of the rows it scans (the key with the smallest share is taken).

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{JoinType, NullEquality};
use datafusion::error::Result;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::PhysicalExprRef;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use std::sync::Arc;

/// The fewest estimated rows a build side must have to be cut down.
pub const MIN_ROWS: usize = 256 * 1024;
/// How many times the lower join's build side (estimated rows) it must be.
pub const RATIO: usize = 4;
/// The largest share of the rows it scans the lower join's build side may keep (by
/// DataFusion's estimates): an unfiltered one (every supplier) would drop nothing.
pub const MAX_SHARE: f64 = 0.5;

/// `plan` with each qualifying broadcast build side cut down (module doc), but those for
/// which `reads_fact` says yes: a build side that reads the sampled table itself (an
/// `EXISTS` over it, TPC-H Q21) is left plain, for each unit to read its own keys' pages
/// ([`crate::unit_builds`]). Cut down by a semi join, it would become a stage every worker
/// builds whole before the first estimate.
pub fn narrow(
    plan: Arc<dyn ExecutionPlan>,
    reads_fact: &dyn Fn(&Arc<dyn ExecutionPlan>) -> Result<bool>,
) -> Result<Arc<dyn ExecutionPlan>> {
    Ok(plan
        .transform_up(|node| {
            let Some(j) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            if reads_fact(j.left())? {
                return Ok(Transformed::no(node));
            }
            Ok(match narrowed(j)? {
                Some(new) => Transformed::yes(new),
                None => Transformed::no(node),
            })
        })?
        .data)
}

/// Whether `j` is a broadcast join that matches no NULLs.
fn broadcast(j: &HashJoinExec) -> bool {
    *j.partition_mode() == PartitionMode::CollectLeft
        && j.null_equality() == NullEquality::NullEqualsNothing
        && !j.null_aware
        && j.fetch().is_none()
}

fn rows(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    StatisticsContext::new()
        .compute(plan.as_ref(), &StatisticsArgs::new())
        .ok()?
        .num_rows
        .get_value()
        .copied()
}

/// `j` with its build side cut down, or None where nothing applies.
fn narrowed(j: &HashJoinExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let kept = matches!(
        j.join_type(),
        JoinType::Inner | JoinType::Right | JoinType::RightSemi | JoinType::RightAnti
    );
    if !broadcast(j) || !kept {
        return Ok(None);
    }
    let mut build = j.left().clone();
    while let Some(c) = build.downcast_ref::<CoalescePartitionsExec>() {
        if c.fetch().is_some() {
            return Ok(None);
        }
        build = c.input().clone();
    }
    let Some(build_rows) = rows(&build).filter(|r| *r >= MIN_ROWS) else {
        return Ok(None);
    };
    // Of the keys with a lower join, the one whose build side its filters cut most.
    let mut best: Option<(f64, Arc<dyn ExecutionPlan>, usize, usize)> = None;
    for (b, p) in j.on() {
        let (Some(b), Some(p)) = (b.downcast_ref::<Column>(), p.downcast_ref::<Column>()) else {
            continue;
        };
        let Some((keys, key)) = lower_keys(j.right(), p.index()) else {
            continue;
        };
        let key_type = keys.schema().field(key).data_type().clone();
        if key_type != *build.schema().field(b.index()).data_type()
            || crate::subtree::volatile(&keys)
        {
            continue;
        }
        let (Some(kept), Some(scanned)) = (rows(&keys), crate::planner::scanned_rows(&keys)) else {
            continue;
        };
        let share = kept as f64 / scanned.max(1) as f64;
        if share > MAX_SHARE || kept.saturating_mul(RATIO) > build_rows {
            continue;
        }
        if best.as_ref().is_none_or(|(s, ..)| share < *s) {
            best = Some((share, keys, key, b.index()));
        }
    }
    if let Some((_, keys, key, b)) = best {
        let on: Vec<(PhysicalExprRef, PhysicalExprRef)> = vec![(
            Arc::new(Column::new(keys.schema().field(key).name(), key)),
            Arc::new(Column::new(build.schema().field(b).name(), b)),
        )];
        // The build rows some lower key meets: the same columns, in the same order.
        let semi: Arc<dyn ExecutionPlan> = Arc::new(HashJoinExec::try_new(
            keys,
            build.clone(),
            on,
            None,
            &JoinType::RightSemi,
            None,
            PartitionMode::CollectLeft,
            NullEquality::NullEqualsNothing,
            false,
        )?);
        let left: Arc<dyn ExecutionPlan> = match semi.output_partitioning().partition_count() {
            1 => semi,
            _ => Arc::new(CoalescePartitionsExec::new(semi)),
        };
        let out = j
            .builder()
            .with_new_children(vec![left, j.right().clone()])?
            .reset_state()
            .build_exec()?;
        return Ok(Some(out));
    }
    Ok(None)
}

/// Where column `i` of `plan`'s output passes up unchanged from the probe key of a broadcast
/// join below that keeps only matched probe rows (inner or right-semi): that join's build
/// side and its build key's column. Through projections, filters and the probe sides of
/// other broadcast joins.
fn lower_keys(plan: &Arc<dyn ExecutionPlan>, i: usize) -> Option<(Arc<dyn ExecutionPlan>, usize)> {
    let (child, c) = crate::key_trace::passed_down(plan, i)?;
    if let Some(j) = plan.downcast_ref::<HashJoinExec>() {
        // `c` is a probe column: a key of a join that keeps only matched probe rows?
        if broadcast(j) && matches!(j.join_type(), JoinType::Inner | JoinType::RightSemi) {
            let key = j.on().iter().find_map(|(l, r)| {
                let r = r.downcast_ref::<Column>()?;
                (r.index() == c).then(|| l.downcast_ref::<Column>().map(|l| l.index()))?
            });
            if let Some(key) = key {
                return Some((j.left().clone(), key));
            }
        }
    }
    lower_keys(plan.children().get(child)?, c)
}
