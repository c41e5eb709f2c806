//! What a plan subtree does, as the planner's rewrites ask it: whether a node under it
//! passes a test, and whether running it again may give other rows; and the bottom-up
//! rewrite those rewrites share.

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::physical_plan::{replace_children_if_necessary, ExecutionPlan};
use std::collections::HashMap;
use std::sync::Arc;

/// Whether `plan` may give other rows when run again: an expression under it (a filter's, a
/// projection's, a scan's) is volatile (`random()`), or a node stops after some rows (a `LIMIT`
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
        // Any expression of the node: a filter's, a projection's, a scan's own projection
        // (DataFusion moves `random() AS r` into the scan) or predicate.
        let mut any = false;
        let _ = p.apply_expressions(&mut |e| {
            any |= is_volatile(e);
            Ok(TreeNodeRecursion::Continue)
        });
        any
    })
}

/// Whether `test` holds for `plan` or a node under it.
pub fn any_node(
    plan: &Arc<dyn ExecutionPlan>,
    test: &dyn Fn(&Arc<dyn ExecutionPlan>) -> bool,
) -> bool {
    test(plan) || plan.children().into_iter().any(|c| any_node(c, test))
}

/// `plan` rewritten bottom-up by `f` (given each node with its children already rewritten;
/// None keeps it), by node: a node several parents share (a build side read twice, see
/// [`crate::planner`]) is rewritten once and stays one node, which the stage planner cuts once.
pub fn rewrite_shared(
    plan: Arc<dyn ExecutionPlan>,
    f: &NodeRewrite,
) -> Result<Arc<dyn ExecutionPlan>> {
    rewrite(plan, f, &mut HashMap::new())
}

/// A rewrite of one node: its replacement, or None to keep it.
pub type NodeRewrite = dyn Fn(&Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>>;

type Rewritten = HashMap<usize, (Arc<dyn ExecutionPlan>, Arc<dyn ExecutionPlan>)>;

fn rewrite(
    plan: Arc<dyn ExecutionPlan>,
    f: &NodeRewrite,
    done: &mut Rewritten,
) -> Result<Arc<dyn ExecutionPlan>> {
    let key = Arc::as_ptr(&plan) as *const () as usize;
    if let Some((_, out)) = done.get(&key) {
        return Ok(out.clone());
    }
    let children = plan
        .children()
        .into_iter()
        .map(|c| rewrite(c.clone(), f, done))
        .collect::<Result<Vec<_>>>()?;
    let node = replace_children_if_necessary(plan.clone(), children)?;
    let out = f(&node)?.unwrap_or(node);
    // `plan` is kept alive so its address is not reused by another node while we rewrite.
    done.insert(key, (plan, out.clone()));
    Ok(out)
}
