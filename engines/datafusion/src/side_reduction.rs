//! A partitioned join's large input cut down, before its exchange, to the rows whose keys the
//! small input holds.
//!
//! `NOT EXISTS (SELECT * FROM lineitem l3 WHERE l3.l_orderkey = l1.l_orderkey AND ...)`
//! (TPC-H q21) is planned as a partitioned anti join: its one side is the few outer rows left
//! after the query's other joins (73 K at SF1), its other the subquery's 3.8 M late lineitems,
//! both hash-exchanged whole. A late lineitem whose order is not among the outer rows' can
//! change no output row, so here it is dropped before the exchange: every task of the large
//! side reads the small side's exchange whole (the same node the join reads, cut into one
//! stage, [`crate::planner`]) and keeps the rows that meet it on the join keys (a broadcast
//! semi join). One process gets the same from the dynamic filter the join's build side
//! pushes into the scan; no dynamic filter crosses a stage.
//!
//! Only where it is exact: a side is cut down only where the join never emits its unmatched
//! rows (not a join's outer side, not a full join, not `NOT IN`'s null-aware anti join), and
//! not under a `LIMIT` that stops the join early. The copy matches on the join keys with the
//! join's NULL equality, and on the join's filter when the cut side is the join's right
//! (the filter's sides then stay as they are).
//!
//! Only where it is likely to pay, by DataFusion's estimates: the small side at most
//! [`MAX_SMALL_ROWS`] rows, the large side at least [`MIN_RATIO`] times its rows per
//! partition of the exchange (every task reads the small side whole). The large side then
//! waits for the small side's exchange to be whole.
//!
//! Where the estimates are too close to tell but the smaller side filters its rows, the cut
//! is decided when the task runs ([`crate::key_filter`]): the small side is read whole and,
//! if it holds at most [`MAX_KEYS_AT_RUN`] rows, the large side keeps the rows whose keys it
//! holds; otherwise every row passes. The same filter goes below the partial aggregate of a
//! larger side that is an aggregate grouped by the join keys (TPC-H q17's average quantity
//! per part over every lineitem, met by the few parts the query keeps).

use crate::key_filter::KeyFilterExec;
use crate::subtree::{any_node, volatile};
use datafusion::common::JoinType;
use datafusion::common::NullEquality;
use datafusion::error::Result;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::Partitioning;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{replace_children_if_necessary, ExecutionPlan};
use std::sync::Arc;

/// The most rows (estimated) the small side may have: every task of the large side builds a
/// hash table of all of them.
pub const MAX_SMALL_ROWS: usize = 4_000_000;

/// The large side must have at least this many times the small side's rows per partition of
/// its exchange (estimated): each of its tasks reads the small side whole.
pub const MIN_RATIO: usize = 4;

/// The most rows the small side may turn out to hold where only its filter says it is small
/// ([`at_run`]): past it, the key filter lets every row through.
pub const MAX_KEYS_AT_RUN: usize = 2_000_000;

/// `plan` with each qualifying partitioned join's large side cut down (module doc). Bottom-up,
/// by node: a node several parents share stays one node, which the stage planner cuts once.
pub fn reduce_large_sides(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    crate::subtree::rewrite_shared(plan, &|node| match node.downcast_ref::<HashJoinExec>() {
        Some(j) => reduced(j),
        None => Ok(None),
    })
}

/// Whether the join never emits a row of its left (`left == true`) or right side that meets
/// no row of the other side on the keys.
fn drops_unmatched(t: &JoinType, left: bool) -> bool {
    use JoinType::*;
    match left {
        true => matches!(
            t,
            Inner | Right | RightSemi | RightAnti | RightMark | LeftSemi
        ),
        false => matches!(t, Inner | Left | LeftSemi | LeftAnti | LeftMark | RightSemi),
    }
}

/// DataFusion's estimate of the rows `plan` produces.
fn estimated_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
    StatisticsContext::new()
        .compute(plan.as_ref(), &StatisticsArgs::new())
        .ok()
        .and_then(|s| s.num_rows.get_value().copied())
}

/// A hash exchange's input and partition count.
fn hash_exchange(plan: &Arc<dyn ExecutionPlan>) -> Option<(&Arc<dyn ExecutionPlan>, usize)> {
    let r = plan.downcast_ref::<RepartitionExec>()?;
    match r.partitioning() {
        Partitioning::Hash(_, n) if !r.preserve_order() => Some((r.input(), *n)),
        _ => None,
    }
}

/// `j` with its large side cut down, or None where that does not apply or pay.
fn reduced(j: &HashJoinExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if *j.partition_mode() != PartitionMode::Partitioned || j.null_aware || j.fetch().is_some() {
        return Ok(None);
    }
    let (Some((left_in, n)), Some((right_in, _))) =
        (hash_exchange(j.left()), hash_exchange(j.right()))
    else {
        return below_aggregate(j);
    };
    let (Some(left_rows), Some(right_rows)) = (estimated_rows(j.left()), estimated_rows(j.right()))
    else {
        return Ok(None);
    };
    let pays = |small: usize, large: usize| {
        small <= MAX_SMALL_ROWS && small.saturating_mul(MIN_RATIO).saturating_mul(n) <= large
    };
    // The side cut down: the left when the right is small, and the other way round.
    let cut_left = if drops_unmatched(j.join_type(), true) && pays(right_rows, left_rows) {
        true
    } else if drops_unmatched(j.join_type(), false) && pays(left_rows, right_rows) {
        false
    } else {
        return at_run(j, left_rows, right_rows);
    };
    let (small, large_in, large) = match cut_left {
        true => (j.right(), left_in, j.left()),
        false => (j.left(), right_in, j.right()),
    };
    // A join `independent_joins` re-partitioned has its probe side cut down already (and
    // its build side, read whole by that cut, must stay one node).
    if reduced_by(left_in, j.right()) || reduced_by(right_in, j.left()) {
        return Ok(None);
    }
    // The small side computed twice would have to give the same rows both times; it is one
    // stage here, but stay on the safe side of a LIMIT or random() under it.
    if volatile(small) {
        return Ok(None);
    }
    let Some(exchange) = large.downcast_ref::<RepartitionExec>() else {
        return Ok(None);
    };
    // The semi join builds on the small side's exchange read whole and keeps the large side's
    // rows that meet it: `RightSemi` with the small side on the left. Cutting the join's
    // right side keeps its keys and filter as they are; cutting its left swaps the keys, and
    // the filter (whose sides would swap too) is left to the join.
    let builder = j
        .builder()
        .with_type(JoinType::RightSemi)
        .with_projection(None)
        .with_fetch(None);
    let builder = match cut_left {
        true => builder
            .with_on(j.on().iter().map(|(l, r)| (r.clone(), l.clone())).collect())
            .with_filter(None),
        false => builder,
    };
    let semi = builder
        .with_new_children(vec![
            Arc::new(CoalescePartitionsExec::new(small.clone())),
            large_in.clone(),
        ])?
        .with_partition_mode(PartitionMode::CollectLeft)
        .reset_state()
        .build_exec()?;
    let cut: Arc<dyn ExecutionPlan> = Arc::new(RepartitionExec::try_new(
        semi,
        exchange.partitioning().clone(),
    )?);
    with_side(j, cut_left, cut).map(Some)
}

/// Whether `input` is already a broadcast semi join that builds on `small` read whole.
fn reduced_by(input: &Arc<dyn ExecutionPlan>, small: &Arc<dyn ExecutionPlan>) -> bool {
    input.downcast_ref::<HashJoinExec>().is_some_and(|semi| {
        *semi.join_type() == JoinType::RightSemi
            && semi
                .left()
                .downcast_ref::<CoalescePartitionsExec>()
                .is_some_and(|c| Arc::ptr_eq(c.input(), small))
    })
}

/// `j` with its larger side (by estimate) cut down by a [`KeyFilterExec`] when the estimates
/// are too close to tell but the smaller side filters its rows (DataFusion's filter
/// estimates are often far too high: TPC-H q12's lineitem filter keeps 0.5% of the rows and
/// is estimated at 20%). The key filter reads the small side whole when the task starts and
/// lets every row through if it holds more than [`MAX_KEYS_AT_RUN`] rows. Plain key columns
/// of one type on both sides only.
fn at_run(
    j: &HashJoinExec,
    left_rows: usize,
    right_rows: usize,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let cut_left = left_rows >= right_rows;
    if !drops_unmatched(j.join_type(), cut_left) {
        return Ok(None);
    }
    let (small, large) = match cut_left {
        true => (j.right(), j.left()),
        false => (j.left(), j.right()),
    };
    let filters = any_node(small, &|p| p.downcast_ref::<FilterExec>().is_some());
    let (Some((large_in, _)), Some((small_in, _))) = (hash_exchange(large), hash_exchange(small))
    else {
        return Ok(None);
    };
    if !filters || volatile(small) || reduced_by(large_in, small) || reduced_by(small_in, large) {
        return Ok(None);
    }
    let Some((small_cols, large_cols)) = key_columns(j, cut_left) else {
        return Ok(None);
    };
    let Some(exchange) = large.downcast_ref::<RepartitionExec>() else {
        return Ok(None);
    };
    let filter = match KeyFilterExec::try_new(
        Arc::new(CoalescePartitionsExec::new(small.clone())),
        large_in.clone(),
        small_cols,
        large_cols,
        j.null_equality() == NullEquality::NullEqualsNull,
        MAX_KEYS_AT_RUN,
    ) {
        Ok(f) => f,
        // Key columns of different types: left alone.
        Err(_) => return Ok(None),
    };
    let cut: Arc<dyn ExecutionPlan> = Arc::new(RepartitionExec::try_new(
        Arc::new(filter),
        exchange.partitioning().clone(),
    )?);
    with_side(j, cut_left, cut).map(Some)
}

/// `j` with its larger side (by estimate), an aggregate grouped by the join keys over an
/// exchange (TPC-H q17's average quantity per part, over every lineitem), cut down below its
/// partial aggregate by a [`KeyFilterExec`] on the smaller side's keys, so only the groups
/// that can meet them are aggregated and exchanged. The smaller side must be a hash exchange
/// and filter its rows; the path down from the join: projections of plain columns, row
/// filters, final aggregates, exchanges, then the partial aggregate, every join key a group
/// key throughout.
fn below_aggregate(j: &HashJoinExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let (Some(left_rows), Some(right_rows)) = (estimated_rows(j.left()), estimated_rows(j.right()))
    else {
        return Ok(None);
    };
    let cut_left = left_rows >= right_rows;
    if !drops_unmatched(j.join_type(), cut_left) {
        return Ok(None);
    }
    let (small, large) = match cut_left {
        true => (j.right(), j.left()),
        false => (j.left(), j.right()),
    };
    let filters = any_node(small, &|p| p.downcast_ref::<FilterExec>().is_some());
    if hash_exchange(small).is_none() || !filters || volatile(small) {
        return Ok(None);
    }
    // Per join key: its column in the small side, and in `node`'s output on the way down.
    let Some((small_cols, mut cols)) = key_columns(j, cut_left) else {
        return Ok(None);
    };
    let mut path: Vec<Arc<dyn ExecutionPlan>> = Vec::new();
    let mut node = large.clone();
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
            // An output group column c is group expression c, a column of the input.
            for c in cols.iter_mut() {
                match groups.expr()[*c].0.downcast_ref::<Column>() {
                    Some(col) => *c = col.index(),
                    None => return Ok(None),
                }
            }
            match a.mode() {
                AggregateMode::Partial => break node.clone(),
                AggregateMode::Final | AggregateMode::FinalPartitioned => {}
                _ => return Ok(None),
            }
        } else if let Some(f) = node.downcast_ref::<FilterExec>() {
            // A row filter (a HAVING): a group it keeps still needs its key to meet a row.
            if volatile(&node) {
                return Ok(None);
            }
            if let Some(p) = f.projection() {
                for c in cols.iter_mut() {
                    match p.get(*c) {
                        Some(i) => *c = *i,
                        None => return Ok(None),
                    }
                }
            }
        } else if let Some(r) = node.downcast_ref::<RepartitionExec>() {
            if r.preserve_order() {
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
    let exchanged = path
        .iter()
        .any(|p| p.downcast_ref::<RepartitionExec>().is_some());
    let Some(agg) = partial.downcast_ref::<AggregateExec>() else {
        return Ok(None);
    };
    if !exchanged || agg.input().downcast_ref::<KeyFilterExec>().is_some() {
        return Ok(None);
    }
    let filter = match KeyFilterExec::try_new(
        Arc::new(CoalescePartitionsExec::new(small.clone())),
        agg.input().clone(),
        small_cols,
        cols,
        j.null_equality() == NullEquality::NullEqualsNull,
        MAX_KEYS_AT_RUN,
    ) {
        Ok(f) => f,
        Err(_) => return Ok(None),
    };
    let mut rebuilt = replace_children_if_necessary(partial.clone(), vec![Arc::new(filter)])?;
    for above in path.iter().rev() {
        rebuilt = replace_children_if_necessary(above.clone(), vec![rebuilt])?;
    }
    with_side(j, cut_left, rebuilt).map(Some)
}

/// The join keys' column indices in the small side and in the side cut down (the left when
/// `cut_left`), or None when a key is not a plain column.
fn key_columns(j: &HashJoinExec, cut_left: bool) -> Option<(Vec<usize>, Vec<usize>)> {
    j.on()
        .iter()
        .map(|(l, r)| {
            let (small, large) = if cut_left { (r, l) } else { (l, r) };
            Some((
                small.downcast_ref::<Column>()?.index(),
                large.downcast_ref::<Column>()?.index(),
            ))
        })
        .collect::<Option<Vec<_>>>()
        .map(|pairs| pairs.into_iter().unzip())
}

/// `j` with its left (`cut_left`) or right input replaced by `cut`.
fn with_side(
    j: &HashJoinExec,
    cut_left: bool,
    cut: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let children = match cut_left {
        true => vec![cut, j.right().clone()],
        false => vec![j.left().clone(), cut],
    };
    j.builder()
        .with_new_children(children)?
        .reset_state()
        .build_exec()
}
