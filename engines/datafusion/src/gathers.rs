//! Which gathers the stage planner leaves in place, to be computed by each consumer from the
//! files rather than cut into a stage ([`crate::planner`]): a small exchange-free subtree (at
//! most [`SMALL_GATHER_ROWS`] rows), and a broadcast join's build side that is a plain scan
//! (at most [`PLAIN_SCAN_GATHER_ROWS`] rows); and the rows a plan's scans read.

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;

/// Rows at or under which a broadcast join's build side that is a plain scan (columns of a
/// table, every row kept) is computed by its consumers: each worker decodes the scanned columns
/// itself, which costs less than a stage that decodes them once, then encodes, sends and
/// decodes them again on every worker (TPC-DS q82's 2.9 M `store_sales` item keys: 0.20 s ->
/// 0.14 s, one process 0.09 s).
pub const PLAIN_SCAN_GATHER_ROWS: u64 = 8 * 1024 * 1024;

/// The addresses of the gathers in `plan` that are a `CollectLeft` join's build side.
pub(crate) fn build_side_gathers(
    plan: &Arc<dyn ExecutionPlan>,
) -> std::collections::HashSet<usize> {
    let mut found = std::collections::HashSet::new();
    let mut seen = std::collections::HashSet::new();
    let mut todo = vec![plan.clone()];
    while let Some(p) = todo.pop() {
        // A node several consumers share is walked once.
        if !seen.insert(Arc::as_ptr(&p) as *const () as usize) {
            continue;
        }
        if let Some(join) = p.downcast_ref::<HashJoinExec>() {
            if *join.partition_mode() == PartitionMode::CollectLeft
                && join
                    .left()
                    .downcast_ref::<CoalescePartitionsExec>()
                    .is_some()
            {
                found.insert(Arc::as_ptr(join.left()) as *const () as usize);
            }
        }
        todo.extend(p.children().into_iter().cloned());
    }
    found
}

/// Whether `plan` only reads columns of its scans, every row (no filter, limit, computed or
/// volatile expression, join or aggregate), at most `limit` rows by the files' statistics:
/// every worker reading it gets the same rows.
pub(crate) fn is_plain_scan(plan: &Arc<dyn ExecutionPlan>, limit: u64) -> bool {
    // Every expression of the node (a projection's, a scan's projection and predicate) is a
    // column.
    let columns_only = |p: &Arc<dyn ExecutionPlan>| {
        let mut only = true;
        let _ = p.apply_expressions(&mut |e| {
            only &= e.downcast_ref::<Column>().is_some();
            Ok(TreeNodeRecursion::Continue)
        });
        only
    };
    let mut todo = vec![plan.clone()];
    while let Some(p) = todo.pop() {
        let plain = p.name() == "DataSourceExec"
            || p.downcast_ref::<ProjectionExec>().is_some()
            || p.name() == "CoalesceBatchesExec";
        if !plain || p.fetch().is_some() || !columns_only(&p) {
            return false;
        }
        todo.extend(p.children().into_iter().cloned());
    }
    scanned_rows(plan).is_some_and(|n| n <= limit)
}

/// Row count at or under which a gather of a subtree without exchanges is computed by its
/// consumers instead of being cut into a stage (DataFusion's own `CollectLeft` threshold for a
/// build side is 128 Ki rows).
pub const SMALL_GATHER_ROWS: usize = 128 * 1024;

/// DataFusion's estimates say every node of `plan` — its scans included, so a small aggregate
/// over a large table does not count — produces at most `limit` rows.
pub(crate) fn is_small(plan: &Arc<dyn ExecutionPlan>, limit: usize) -> bool {
    use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
    let stats = StatisticsContext::new();
    let args = StatisticsArgs::new();
    let small = |p: &Arc<dyn ExecutionPlan>| {
        stats
            .compute(p.as_ref(), &args)
            .ok()
            .and_then(|s| s.num_rows.get_value().copied())
            .is_some_and(|n| n <= limit)
    };
    let mut todo = vec![plan.clone()];
    while let Some(p) = todo.pop() {
        if !small(&p) {
            return false;
        }
        todo.extend(p.children().into_iter().cloned());
    }
    true
}

/// The rows `plan`'s leaves (its scans) read together, by DataFusion's statistics (exact for
/// Parquet files: their footers); None when a leaf's count is unknown.
pub fn scanned_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<u64> {
    use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
    let stats = StatisticsContext::new();
    let args = StatisticsArgs::new();
    let mut total = 0u64;
    let mut todo = vec![plan.clone()];
    while let Some(p) = todo.pop() {
        let children = p.children();
        if children.is_empty() {
            let rows = stats.compute(p.as_ref(), &args).ok()?;
            total = total.saturating_add(*rows.num_rows.get_value()? as u64);
        }
        todo.extend(children.into_iter().cloned());
    }
    Some(total)
}
