//! Whether a stage plan reaches the workers as the plan the driver made.
//!
//! Stage plans travel as `datafusion-proto` bytes. Some nodes cannot be encoded (DataFusion
//! 55's `PiecewiseMergeJoinExec`, `PartitionedTopKExec`, a recursive query's
//! `WorkTableExec`), and some round trips change the plan without an error: a window
//! aggregate's `FILTER (WHERE ...)` is dropped (`PhysicalWindowExprNode` has no field for
//! it), so is `first_value(x) IGNORE NULLS`, a `Float16` literal comes back `Float32`. Either would be a failed query or, worse, a
//! different answer. [`check`] encodes the plan, decodes it the way a worker does, and
//! compares the two node by node (names and output types); the context then runs such a
//! query whole on the driver, as single-process DataFusion, and says why in `EXPLAIN`.

use crate::codec::ExchangeCodec;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::window::WindowExpr;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::windows::{BoundedWindowAggExec, WindowAggExec};
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use std::sync::Arc;

/// `Ok` if `plan` survives the trip to a worker unchanged; else why not.
pub fn check(plan: &Arc<dyn ExecutionPlan>, ctx: &TaskContext) -> Result<(), String> {
    if let Some(name) = lossy_window(plan) {
        return Err(format!(
            "the window function {name} has a FILTER, IGNORE NULLS or a reversed frame, which \
             datafusion-proto 55 does not carry"
        ));
    }
    let bytes = physical_plan_to_bytes_with_extension_codec(plan.clone(), &ExchangeCodec)
        .map_err(|e| format!("it cannot be encoded: {e}"))?;
    let back = physical_plan_from_bytes_with_extension_codec(&bytes, ctx, &ExchangeCodec)
        .map_err(|e| format!("it cannot be decoded: {e}"))?;
    let (a, b) = (shape(plan), shape(&back));
    match a.iter().zip(&b).find(|(x, y)| x != y) {
        Some((x, y)) => {
            let (x, y) = difference(x, y);
            Err(format!(
                "a round trip through datafusion-proto changes {x} into {y}"
            ))
        }
        None if a.len() != b.len() => Err("a round trip changes its nodes".to_string()),
        None => Ok(()),
    }
}

/// Every node, in pre-order: its name and output column types.
fn shape(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let schema = plan.schema();
    let types: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| f.data_type().to_string())
        .collect();
    let mut out = vec![format!("{}({})", plan.name(), types.join(", "))];
    // Grouping sets (`GROUPING SETS (())` must give one row, also over no input) are not
    // visible in the output types.
    if let Some(a) = plan.downcast_ref::<AggregateExec>() {
        out.push(format!("{:?}", a.group_expr()).replace(", nullable: true", ""));
    }
    // Window functions carry options a round trip may lose without changing any type
    // (`IGNORE NULLS` of `first_value`): their whole description must come back the same.

    for c in plan.children() {
        out.extend(shape(c));
    }
    out
}

/// The window expressions of a window node (none for other nodes).
fn window_exprs(plan: &Arc<dyn ExecutionPlan>) -> &[Arc<dyn WindowExpr>] {
    if let Some(w) = plan.downcast_ref::<BoundedWindowAggExec>() {
        w.window_expr()
    } else if let Some(w) = plan.downcast_ref::<WindowAggExec>() {
        w.window_expr()
    } else {
        &[]
    }
}

/// The name of a window function anywhere in `plan` with an option a round trip loses
/// without changing any type: a FILTER (`PhysicalWindowExprNode` has no field for it),
/// IGNORE NULLS of `first_value` and kin, a frame the optimizer reversed. DataFusion 55 does
/// not export the trait with their getters; the expressions' `Debug` shows the fields.
fn lossy_window(plan: &Arc<dyn ExecutionPlan>) -> Option<String> {
    let lossy = |e: &&Arc<dyn WindowExpr>| {
        let debug = format!("{e:?}");
        ["filter: Some(", "ignore_nulls: true", "is_reversed: true"]
            .iter()
            .any(|field| debug.contains(field))
    };
    match window_exprs(plan).iter().find(lossy) {
        Some(e) => Some(e.name().to_string()),
        None => plan.children().into_iter().find_map(lossy_window),
    }
}

/// Where `a` and `b` differ: a short stretch of each from a little before the first
/// difference.
fn difference(a: &str, b: &str) -> (String, String) {
    let first = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i);
    let from = a[..first]
        .char_indices()
        .rev()
        .nth(60)
        .map_or(0, |(i, _)| i);
    let cut = |s: &str| -> String {
        let tail = s.get(from..).unwrap_or("");
        let t: String = tail.chars().take(160).collect();
        if from > 0 {
            format!("...{t}")
        } else {
            t
        }
    };
    (cut(a), cut(b))
}
