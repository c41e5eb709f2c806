//! What a plan subtree does, as the planner's rewrites ask it: whether a node under it
//! passes a test, and whether running it again may give other rows.

use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;

/// Whether `plan` may give other rows when run again: an expression under it (a filter's, a
/// projection's) is volatile (`random()`), or a node stops after some rows (a `LIMIT`
/// without an order over several partitions keeps whichever come first). A subtree computed
/// twice must give the same rows both times.
pub fn volatile(plan: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::physical_expr_common::physical_expr::is_volatile;
    use datafusion::physical_plan::limit::{GlobalLimitExec, LocalLimitExec};
    any_node(plan, &|p| {
        if p.fetch().is_some()
            || p.downcast_ref::<GlobalLimitExec>().is_some()
            || p.downcast_ref::<LocalLimitExec>().is_some()
        {
            return true;
        }
        let in_filter = p
            .downcast_ref::<FilterExec>()
            .is_some_and(|f| is_volatile(f.predicate()));
        let in_projection = p
            .downcast_ref::<ProjectionExec>()
            .is_some_and(|pr| pr.expr().iter().any(|e| is_volatile(&e.expr)));
        in_filter || in_projection
    })
}

/// Whether `test` holds for `plan` or a node under it.
pub fn any_node(
    plan: &Arc<dyn ExecutionPlan>,
    test: &dyn Fn(&Arc<dyn ExecutionPlan>) -> bool,
) -> bool {
    test(plan) || plan.children().into_iter().any(|c| any_node(c, test))
}
