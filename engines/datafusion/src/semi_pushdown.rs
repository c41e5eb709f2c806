//! A broadcast semi join's keys pushed below the inner join it filters, into both of that
//! join's inputs, before they are exchanged.
//!
//! `... WHERE o_orderkey IN (SELECT l_orderkey ... HAVING sum(l_quantity) > 300)` (TPC-H q18)
//! is planned as a `RightSemi` join whose build side is the subquery's few keys and whose probe
//! side is an inner join of `orders` and `lineitem` on that key, partitioned: both of them
//! hash-exchanged whole. One process cuts them down through a dynamic filter that the semi
//! join's build side pushes into their scans; no dynamic filter crosses a stage. Here the semi
//! join is copied below the inner join, onto each input that holds the key (through the
//! join's equality, both), under its exchange, so only the rows that can meet a key move. The
//! copies build on the same node as the original, which the stage planner cuts into one stage
//! however many read it. The original stays (it then drops nothing).
//!
//! The same below an aggregate on the semi join's keys (TPC-H q20's sums per part and
//! supplier): the keys are copied below the partial aggregate, before its exchange.
//!
//! Only where it is exact: a semi join on plain columns, not null-aware, over an inner
//! equi-join or an aggregate grouped by its keys; a row whose key is not among the build
//! side's keys meets no row above either (NULL keys meet nothing, as in the join). The
//! copies filter by the keys alone; the semi join's own filter stays with it.

use datafusion::common::{JoinType, NullEquality};
use datafusion::error::Result;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{Partitioning, PhysicalExprRef};
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{replace_children_if_necessary, ExecutionPlan};
use std::sync::Arc;

/// `plan` with every qualifying semi join's keys pushed below its inner join (module doc).
/// Bottom-up, by node: a node several parents share (a build side read twice, see
/// [`crate::planner`]) stays one node, which the stage planner cuts once.
pub fn push_semi_joins(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    crate::subtree::rewrite_shared(plan, &|node| match node.downcast_ref::<HashJoinExec>() {
        Some(semi) => pushed(semi),
        None => Ok(None),
    })
}

/// `semi` with its probe side's inner join filtered below, or None where that does not apply.
fn pushed(semi: &HashJoinExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let applies = *semi.join_type() == JoinType::RightSemi
        && *semi.partition_mode() == PartitionMode::CollectLeft
        && !semi.null_aware
        && semi.null_equality() == NullEquality::NullEqualsNothing
        && semi.fetch().is_none();
    // The build side is one stage every copy reads, but a volatile one computed in place
    // (small enough not to be cut) would differ between them.
    if !applies || crate::subtree::volatile(semi.left()) {
        return Ok(None);
    }
    let Some(inner) = semi.right().downcast_ref::<HashJoinExec>() else {
        return through_aggregate(semi);
    };
    let inner_applies = *inner.join_type() == JoinType::Inner
        && inner.filter().is_none()
        && inner.null_equality() == NullEquality::NullEqualsNothing
        && inner.fetch().is_none();
    if !inner_applies {
        return Ok(None);
    }
    let left_len = inner.left().schema().fields().len();
    // Per semi key: the build key, and the column it is in each input of the inner join.
    let mut left_keys = Vec::new();
    let mut right_keys = Vec::new();
    for (build_key, probe_key) in semi.on() {
        let Some(c) = probe_key.downcast_ref::<Column>() else {
            return Ok(None);
        };
        let joined = match inner.projection.as_deref() {
            Some(p) => match p.get(c.index()) {
                Some(i) => *i,
                None => return Ok(None),
            },
            None => c.index(),
        };
        let (own, partner) = match joined < left_len {
            true => (
                Column::new(inner.left().schema().field(joined).name(), joined),
                0,
            ),
            false => {
                let i = joined - left_len;
                (Column::new(inner.right().schema().field(i).name(), i), 1)
            }
        };
        // The equality of the inner join that ties the key to the other input.
        let other = inner.on().iter().find_map(|(l, r)| {
            let (mine, theirs) = if partner == 0 { (l, r) } else { (r, l) };
            mine.downcast_ref::<Column>()
                .filter(|m| m.index() == own.index())
                .map(|_| theirs.clone())
        });
        let own: PhysicalExprRef = Arc::new(own);
        if partner == 0 {
            left_keys.push((build_key.clone(), own));
            right_keys.extend(other.map(|o| (build_key.clone(), o)));
        } else {
            right_keys.push((build_key.clone(), own));
            left_keys.extend(other.map(|o| (build_key.clone(), o)));
        }
    }
    let n = semi.on().len();
    let left = match left_keys.len() == n {
        true => filtered(semi, inner.left(), left_keys)?,
        false => inner.left().clone(),
    };
    let right = match right_keys.len() == n {
        true => filtered(semi, inner.right(), right_keys)?,
        false => inner.right().clone(),
    };
    if Arc::ptr_eq(&left, inner.left()) && Arc::ptr_eq(&right, inner.right()) {
        return Ok(None);
    }
    let inner = inner
        .builder()
        .with_new_children(vec![left, right])?
        .reset_state()
        .build_exec()?;
    let semi = semi
        .builder()
        .with_new_children(vec![semi.left().clone(), inner])?
        .reset_state()
        .build_exec()?;
    Ok(Some(semi))
}

/// `semi` over an aggregate on its keys (`... FROM (SELECT k, sum(x) ... GROUP BY k) WHERE k
/// IN (...)`, TPC-H q20's per-part-and-supplier sums): the keys are copied below the partial
/// aggregate, before its exchange, so only the groups that can meet them are summed and
/// moved. Through a projection of plain columns, a final aggregate, its exchange or gather,
/// down to the partial aggregate; every semi key must be a group key there.
fn through_aggregate(semi: &HashJoinExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    // The path from the semi join's probe side down to the partial aggregate.
    let mut path: Vec<Arc<dyn ExecutionPlan>> = Vec::new();
    let mut node = semi.right().clone();
    // Each semi key's column index in `node`'s output.
    let mut cols = Vec::new();
    for (_, probe_key) in semi.on() {
        match probe_key.downcast_ref::<Column>() {
            Some(c) => cols.push(c.index()),
            None => return Ok(None),
        }
    }
    let partial = loop {
        if let Some(p) = node.downcast_ref::<ProjectionExec>() {
            for c in cols.iter_mut() {
                match p
                    .expr()
                    .get(*c)
                    .and_then(|e| e.expr.downcast_ref::<Column>())
                {
                    Some(col) => *c = col.index(),
                    None => return Ok(None),
                }
            }
        } else if let Some(a) = node.downcast_ref::<AggregateExec>() {
            let groups = a.group_expr();
            // A limited aggregate (TopK) picks its groups before any filter below it could.
            if !groups.is_single()
                || a.limit_options().is_some()
                || cols.iter().any(|c| *c >= groups.expr().len())
            {
                return Ok(None);
            }
            match a.mode() {
                AggregateMode::Partial => break node.clone(),
                AggregateMode::Final | AggregateMode::FinalPartitioned => {}
                _ => return Ok(None),
            }
            // A final aggregate's output group column c is its group expression c, a column
            // of its input (the partial aggregate's output).
            for c in cols.iter_mut() {
                match groups.expr()[*c].0.downcast_ref::<Column>() {
                    Some(col) => *c = col.index(),
                    None => return Ok(None),
                }
            }
        } else if let Some(r) = node.downcast_ref::<RepartitionExec>() {
            if r.preserve_order() {
                return Ok(None);
            }
        } else if let Some(c) = node.downcast_ref::<CoalescePartitionsExec>() {
            if c.fetch().is_some() {
                return Ok(None);
            }
        } else {
            return Ok(None);
        }
        path.push(node.clone());
        let children = node.children();
        let [child] = children.as_slice() else {
            return Ok(None);
        };
        node = (*child).clone();
    };
    let agg = partial.downcast_ref::<AggregateExec>().ok_or_else(|| {
        datafusion::error::DataFusionError::Internal("a partial aggregate".into())
    })?;
    let mut on = Vec::new();
    for ((build_key, _), c) in semi.on().iter().zip(&cols) {
        let (expr, _) = &agg.group_expr().expr()[*c];
        if expr.downcast_ref::<Column>().is_none() {
            return Ok(None);
        }
        on.push((build_key.clone(), expr.clone()));
    }
    let below = filtered(semi, agg.input(), on)?;
    let mut rebuilt = replace_children_if_necessary(partial.clone(), vec![below])?;
    for above in path.iter().rev() {
        rebuilt = replace_children_if_necessary(above.clone(), vec![rebuilt])?;
    }
    let semi = semi
        .builder()
        .with_new_children(vec![semi.left().clone(), rebuilt])?
        .reset_state()
        .build_exec()?;
    Ok(Some(semi))
}

/// `input` keeping only the rows whose `on` keys meet `semi`'s build side, filtered under its
/// exchange or gather when it is one (so fewer rows cross it). The build side is `semi`'s own
/// node.
fn filtered(
    semi: &HashJoinExec,
    input: &Arc<dyn ExecutionPlan>,
    on: Vec<(PhysicalExprRef, PhysicalExprRef)>,
) -> Result<Arc<dyn ExecutionPlan>> {
    enum Above {
        Nothing,
        Exchange(Partitioning),
        Gather,
    }
    let (below, above) = if let Some(r) = input.downcast_ref::<RepartitionExec>() {
        match r.preserve_order() {
            false => (r.input().clone(), Above::Exchange(r.partitioning().clone())),
            true => (input.clone(), Above::Nothing),
        }
    } else if let Some(c) = input.downcast_ref::<CoalescePartitionsExec>() {
        match c.fetch() {
            None => (c.input().clone(), Above::Gather),
            // A LIMIT in the gather: its rows are chosen before any filter.
            Some(_) => (input.clone(), Above::Nothing),
        }
    } else {
        (input.clone(), Above::Nothing)
    };
    // The copy filters by the keys alone: the rows meeting the semi join's own filter are
    // among them, and the semi join above applies it.
    let kept = semi
        .builder()
        .with_on(on)
        .with_filter(None)
        .with_projection(None)
        .with_new_children(vec![semi.left().clone(), below])?
        .reset_state()
        .build_exec()?;
    Ok(match above {
        Above::Exchange(p) => Arc::new(RepartitionExec::try_new(kept, p)?),
        Above::Gather => Arc::new(CoalescePartitionsExec::new(kept)),
        Above::Nothing => kept,
    })
}
