//! Where a join key of an online build side comes from, and that build side turned so it
//! can be read per split ([`crate::unit_builds`]).
//!
//! [`trace`] follows a column of a plan down to a Parquet scan when each output row, in the
//! same partition, comes from one row of that scan: through filters, column projections and
//! the probe sides of broadcast (`CollectLeft`) joins. [`reorient`] makes more plans
//! traceable with the same rows: an inner broadcast join whose key column comes from its
//! build side is turned around (the other side is hashed whole, by each worker once; this
//! side streams, each partition on its own), and a gathered stage read there by nothing else
//! is replaced by its plan (TPC-H Q10: `orders`, filtered by a gathered stage, is the build
//! side of `customer`'s join inside the stage `lineitem` builds on).

use crate::planner::Stage;
use crate::reader::ShuffleReaderExec;
use crate::split::SplitScanExec;
use crate::writer::WriterKind;
use datafusion::common::JoinType;
use datafusion::datasource::physical_plan::ParquetSource;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{
    replace_children_if_necessary, ExecutionPlan, ExecutionPlanProperties,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Where column `i` of `plan`'s output passes down unchanged, row for row, within the same
/// partition: to column `.1` of child `.0`, through a projection's column, a filter, a batch
/// coalescer, or the probe side of a broadcast (`CollectLeft`) join (inner and right joins
/// pass their probe side's columns; right-semi and right-anti joins all theirs). None for
/// anything else, and for a node with a limit.
pub fn passed_down(plan: &Arc<dyn ExecutionPlan>, i: usize) -> Option<(usize, usize)> {
    if plan.fetch().is_some() {
        return None;
    }
    if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
        return Some((0, p.expr().get(i)?.expr.downcast_ref::<Column>()?.index()));
    }
    if let Some(f) = plan.downcast_ref::<FilterExec>() {
        return match f.projection() {
            Some(p) => Some((0, *p.get(i)?)),
            None => Some((0, i)),
        };
    }
    if plan.name() == "CoalesceBatchesExec" {
        return Some((0, i));
    }
    let j = plan.downcast_ref::<HashJoinExec>()?;
    if *j.partition_mode() != PartitionMode::CollectLeft {
        return None;
    }
    let k = match &j.projection {
        Some(p) => *p.get(i)?,
        None => i,
    };
    let left = j.left().schema().fields().len();
    match j.join_type() {
        JoinType::Inner | JoinType::Right if k >= left => Some((1, k - left)),
        JoinType::RightSemi | JoinType::RightAnti => Some((1, k)),
        _ => None,
    }
}

/// Where column `i` of `plan`'s output comes from, when `plan` makes each of its rows, in the
/// same partition, from one row of a Parquet scan, that column unchanged: the scan (a
/// `DataSourceExec` or a [`SplitScanExec`]) and the column's name in its table.
pub fn trace(plan: &Arc<dyn ExecutionPlan>, i: usize) -> Option<(Arc<dyn ExecutionPlan>, String)> {
    if plan.fetch().is_some() {
        return None;
    }
    if let Some((child, c)) = passed_down(plan, i) {
        return trace(plan.children().get(child)?, c);
    }
    if plan.downcast_ref::<HashJoinExec>().is_some() {
        return None;
    }
    let scan = match plan.downcast_ref::<SplitScanExec>() {
        Some(s) => s.scan(),
        None => plan.clone(),
    };
    let (config, _) = scan
        .downcast_ref::<DataSourceExec>()?
        .downcast_to_file_source::<ParquetSource>()?;
    if config.limit.is_some() {
        return None;
    }
    let table = config.file_source.table_schema().table_schema().clone();
    let column = match config.file_source.projection() {
        Some(p) => p.iter().nth(i)?.expr.downcast_ref::<Column>()?.index(),
        None => i,
    };
    Some((plan.clone(), table.fields().get(column)?.name().clone()))
}

/// `plan` with the same rows, turned where it helps so that [`trace`] finds where column `i`
/// comes from: an inner broadcast join whose column `i` comes from its build side is turned
/// around (the other side gathered into one partition and hashed; the output columns kept in
/// order), and a gathered stage that is that build side, read by nothing else (`readers`:
/// how many readers of each stage the query's plans hold), is replaced by its plan, its id
/// added to `inlined`. Anything else is left as it is.
pub fn reorient(
    plan: &Arc<dyn ExecutionPlan>,
    i: usize,
    stages: &[Stage],
    readers: &HashMap<u32, usize>,
    inlined: &mut Vec<u32>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let same = || Ok(plan.clone());
    if plan.fetch().is_some() {
        return same();
    }
    if let Some((child, c)) = passed_down(plan, i) {
        let children = plan.children();
        let mut new: Vec<Arc<dyn ExecutionPlan>> = children.iter().map(|c| (*c).clone()).collect();
        new[child] = reorient(children[child], c, stages, readers, inlined)?;
        return replace_children_if_necessary(plan.clone(), new);
    }
    // Not passed down: a column of an inner broadcast join's build side, turned around.
    let Some(j) = plan.downcast_ref::<HashJoinExec>() else {
        return same();
    };
    let k = match &j.projection {
        Some(p) => p.get(i).copied(),
        None => Some(i),
    };
    let inner = *j.partition_mode() == PartitionMode::CollectLeft
        && *j.join_type() == JoinType::Inner
        && !j.null_aware;
    match k {
        Some(k) if inner && k < j.left().schema().fields().len() => {
            match turned(j, k, stages, readers, inlined)? {
                Some(out) => Ok(out),
                None => same(),
            }
        }
        _ => same(),
    }
}

/// The inner broadcast join `j` turned around so that its build side's column `k` streams
/// (see [`reorient`]); None where its build side is not a plan or a gathered stage this can
/// take, or the column cannot be traced there.
fn turned(
    j: &HashJoinExec,
    k: usize,
    stages: &[Stage],
    readers: &HashMap<u32, usize>,
    inlined: &mut Vec<u32>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let unchanged = || Ok(None);
    let mut build = j.left().clone();
    while let Some(c) = build.downcast_ref::<CoalescePartitionsExec>() {
        if c.fetch().is_some() {
            return unchanged();
        }
        build = c.input().clone();
    }
    let mut taken = Vec::new();
    if let Some(reader) = build.downcast_ref::<ShuffleReaderExec>() {
        let stage = stages.iter().find(|s| s.id() == reader.stage);
        match stage {
            Some(s)
                if reader.layout.is_none()
                    && readers.get(&s.id()) == Some(&1)
                    && s.writer.kind == WriterKind::Gather =>
            {
                taken.push(s.id());
                build = s.writer.input().clone();
            }
            _ => return unchanged(),
        }
    }
    let streamed = reorient(&build, k, stages, readers, &mut taken)?;
    if trace(&streamed, k).is_none() {
        return unchanged();
    }
    // Turned: the old probe side, gathered, is hashed; the old build side streams.
    let other = j.right().clone();
    let hashed: Arc<dyn ExecutionPlan> = if other.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(other))
    } else {
        other
    };
    let swapped = j
        .builder()
        .reset_state()
        .build()?
        .swap_inputs(PartitionMode::CollectLeft)?;
    let with_children = |join: &HashJoinExec| {
        join.builder()
            .with_new_children(vec![hashed.clone(), streamed.clone()])
            .map(|b| b.recompute_properties().build_exec())
    };
    let out = match swapped.downcast_ref::<HashJoinExec>() {
        Some(join) => with_children(join)??,
        None => {
            // A projection that puts the columns back in their order, over the join.
            let Some(join) = swapped
                .children()
                .first()
                .and_then(|c| c.downcast_ref::<HashJoinExec>())
            else {
                return unchanged();
            };
            let join = with_children(join)??;
            replace_children_if_necessary(swapped.clone(), vec![join])?
        }
    };
    inlined.extend(taken);
    Ok(Some(out))
}
