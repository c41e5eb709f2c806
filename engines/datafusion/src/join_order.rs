//! `SelectiveJoinsFirst`: a logical optimizer rule that moves the inner joins with filtered
//! (selective) inputs of a chain of inner joins down to the chain's first input, ahead of the
//! joins that do not reduce it.
//!
//! DataFusion keeps a chain of joins in the order the query wrote it, and on one process it
//! makes up for a selective join written late with dynamic filters: the join's build side,
//! once built, filters the scan far below it. Cut into stages, that scan runs in another
//! stage, which no dynamic filter reaches. In TPC-DS q72 the sales table joins the inventory
//! on the item first (15 M rows out of 1.4 M) and only then meets the filtered demographics
//! and dates: on one process the scan returns 0.37 M rows; distributed all 1.4 M, and every
//! later join does four times the work. Joining the filtered dimensions first makes the
//! reduction part of the plan, wherever its stages run.
//!
//! Only inner joins move (they commute), and a join moves only to where every column its
//! condition reads is already joined; the chain's output keeps its columns and their order.

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, NullEquality, Result};
use datafusion::logical_expr::{Expr, Join, JoinType, LogicalPlan, Projection};
use datafusion::optimizer::optimizer::ApplyOrder;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};
use std::collections::HashSet;
use std::sync::Arc;

/// The rule (on unless `SET flightshuffle.selective_joins_first = false`).
#[derive(Debug, Default)]
pub struct SelectiveJoinsFirst;

/// One join of a chain: its right input and its condition.
struct Step {
    join: Join,
}

impl Step {
    /// The columns of the left side its condition reads.
    fn reads(&self) -> HashSet<Column> {
        let right = self.join.right.schema();
        let mut cols: HashSet<Column> = HashSet::new();
        for (l, _) in &self.join.on {
            cols.extend(l.column_refs().into_iter().cloned());
        }
        if let Some(f) = &self.join.filter {
            cols.extend(
                f.column_refs()
                    .into_iter()
                    .filter(|c| !right.has_column(c))
                    .cloned(),
            );
        }
        cols
    }

    /// Whether its right input filters rows: a `Filter`, or a scan with filters, anywhere in it.
    fn selective(&self) -> bool {
        let mut found = false;
        let _ = self.join.right.apply(|p| {
            found = match p {
                LogicalPlan::Filter(_) => true,
                LogicalPlan::TableScan(s) => !s.filters.is_empty(),
                _ => false,
            };
            Ok(match found {
                true => TreeNodeRecursion::Stop,
                false => TreeNodeRecursion::Continue,
            })
        });
        found
    }
}

/// A plain inner equi-join, the kind that can move.
fn movable(plan: &LogicalPlan) -> Option<&Join> {
    match plan {
        LogicalPlan::Join(j)
            if j.join_type == JoinType::Inner
                && j.null_equality == NullEquality::NullEqualsNothing
                && !j.null_aware
                && !j.on.is_empty() =>
        {
            Some(j)
        }
        _ => None,
    }
}

/// Below projections that only pick columns.
fn through_projections(mut plan: &LogicalPlan) -> &LogicalPlan {
    while let LogicalPlan::Projection(p) = plan {
        if !p.expr.iter().all(|e| matches!(e, Expr::Column(_))) {
            break;
        }
        plan = &p.input;
    }
    plan
}

/// The chain of inner joins `plan` ends: its first input and its joins, first to last.
fn chain(plan: &LogicalPlan) -> Option<(LogicalPlan, Vec<Step>)> {
    let mut steps = vec![];
    let mut at = movable(plan)?;
    loop {
        steps.push(Step { join: at.clone() });
        let left = through_projections(&at.left);
        match movable(left) {
            Some(j) => at = j,
            None => {
                steps.reverse();
                return Some((left.clone(), steps));
            }
        }
    }
}

/// The order to join the steps in: selective joins as early as the columns they read allow
/// (among themselves in the query's order), then the rest in the query's order.
fn order(first: &LogicalPlan, steps: &[Step]) -> Vec<usize> {
    let mut have: HashSet<Column> = first.schema().columns().into_iter().collect();
    let mut placed = vec![false; steps.len()];
    let mut out = vec![];
    loop {
        let next = (0..steps.len())
            .find(|&i| !placed[i] && steps[i].selective() && steps[i].reads().is_subset(&have));
        let Some(i) = next else { break };
        placed[i] = true;
        have.extend(steps[i].join.right.schema().columns());
        out.push(i);
    }
    out.extend((0..steps.len()).filter(|&i| !placed[i]));
    out
}

fn rebuild(plan: &LogicalPlan) -> Result<Option<LogicalPlan>> {
    let Some((first, steps)) = chain(plan) else {
        return Ok(None);
    };
    let order = order(&first, &steps);
    if order.iter().enumerate().all(|(at, &i)| at == i) {
        return Ok(None);
    }
    let mut left = Arc::new(first);
    for &i in &order {
        let j = &steps[i].join;
        left = Arc::new(LogicalPlan::Join(Join::try_new(
            left,
            j.right.clone(),
            j.on.clone(),
            j.filter.clone(),
            JoinType::Inner,
            j.join_constraint,
            j.null_equality,
            false,
        )?));
    }
    // The chain's own columns, in its order.
    let columns = plan
        .schema()
        .columns()
        .into_iter()
        .map(Expr::Column)
        .collect();
    Ok(Some(LogicalPlan::Projection(Projection::try_new(
        columns, left,
    )?)))
}

impl OptimizerRule for SelectiveJoinsFirst {
    fn name(&self) -> &str {
        "flightshuffle_selective_joins_first"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::TopDown)
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        let on = config
            .options()
            .extensions
            .get::<crate::FlightshuffleOptions>()
            .is_none_or(|o| o.selective_joins_first);
        if !on {
            return Ok(Transformed::no(plan));
        }
        // A chain that cannot be rebuilt (its columns would clash) stays as it is.
        match rebuild(&plan) {
            Ok(Some(p)) => Ok(Transformed::yes(p)),
            _ => Ok(Transformed::no(plan)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Int32Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::prelude::{SessionConfig, SessionContext};
    use proptest::prelude::*;

    type Rows = Vec<Vec<Option<i32>>>;

    /// Tables: a fact `f(a, b, c, v)`, dimensions `da(a, x)`, `db(b, y)`, `dc(y, z)` (keyed
    /// on `db`'s column, so it can only follow `db`) and `e(a, w)`, many rows per key.
    const TABLES: [(&str, &[&str]); 5] = [
        ("f", &["a", "b", "c", "v"]),
        ("da", &["a", "x"]),
        ("db", &["b", "y"]),
        ("dc", &["y", "z"]),
        ("e", &["a", "w"]),
    ];

    fn context(rule: bool, data: &[Rows]) -> SessionContext {
        let mut state = SessionStateBuilder::new()
            .with_config(SessionConfig::new().with_target_partitions(2))
            .with_default_features();
        if rule {
            state = state.with_optimizer_rule(Arc::new(SelectiveJoinsFirst));
        }
        let ctx = SessionContext::new_with_state(state.build());
        for ((name, cols), rows) in TABLES.iter().zip(data) {
            let schema = Arc::new(Schema::new(
                cols.iter()
                    .map(|c| Field::new(*c, DataType::Int32, true))
                    .collect::<Vec<_>>(),
            ));
            let arrays = (0..cols.len())
                .map(|i| Arc::new(rows.iter().map(|r| r[i]).collect::<Int32Array>()) as _)
                .collect();
            let batch = RecordBatch::try_new(schema.clone(), arrays).expect("batch");
            let table = MemTable::try_new(schema, vec![vec![batch]]).expect("table");
            ctx.register_table(*name, Arc::new(table))
                .expect("register");
        }
        ctx
    }

    /// The query's rows, sorted, as text; and its optimized logical plan.
    fn run(ctx: &SessionContext, sql: &str) -> (Vec<String>, String) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let df = ctx.sql(sql).await.expect("plan");
            let plan = df.clone().into_optimized_plan().expect("optimize");
            let batches = df.collect().await.expect("run");
            let text = pretty_format_batches(&batches).expect("format").to_string();
            let mut rows: Vec<String> = text.lines().map(str::to_string).collect();
            rows.sort();
            let plan = plan.display_indent().to_string();
            (rows, plan)
        })
    }

    /// A join of the chain: its clause and, for some, a filter on its table.
    const JOINS: [&str; 4] = [
        "JOIN da ON f.a = da.a",
        "JOIN db ON f.b = db.b",
        "JOIN dc ON db.y = dc.y",
        "JOIN e ON f.a = e.a AND e.w < f.v",
    ];
    const FILTERS: [&str; 4] = ["da.x > 2", "db.y < 3", "dc.z <> 1", "e.w > 1"];

    fn rows(cols: usize) -> impl Strategy<Value = Rows> {
        prop::collection::vec(
            prop::collection::vec(prop::option::weighted(0.9, 0..5i32), cols),
            0..12,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Whatever the order of the joins and which of them filter, the rule changes no
        /// answer (every column, in the query's order).
        #[test]
        fn reordered_chains_give_the_same_rows(
            data in (rows(4), rows(2), rows(2), rows(2), rows(2)),
            order in Just((0..4).collect::<Vec<usize>>()).prop_shuffle(),
            take in 1..=4usize,
            filtered in prop::collection::vec(any::<bool>(), 4),
        ) {
            // `dc` reads `db`'s column: keep it after `db`, or leave it out.
            let mut steps: Vec<usize> = order.into_iter().take(take).collect();
            if let (Some(c), Some(b)) = (
                steps.iter().position(|&s| s == 2),
                steps.iter().position(|&s| s == 1),
            ) {
                if c < b {
                    steps.swap(c, b);
                }
            } else {
                steps.retain(|&s| s != 2);
            }
            let mut sql = String::from("SELECT * FROM f");
            for &s in &steps {
                sql += " ";
                sql += JOINS[s];
            }
            let wheres: Vec<&str> = steps
                .iter()
                .filter(|&&s| filtered[s])
                .map(|&s| FILTERS[s])
                .collect();
            if !wheres.is_empty() {
                sql += " WHERE ";
                sql += &wheres.join(" AND ");
            }
            let data = [data.0, data.1, data.2, data.3, data.4];
            let (want, _) = run(&context(false, &data), &sql);
            let (got, _) = run(&context(true, &data), &sql);
            prop_assert_eq!(got, want, "{}", sql);
        }
    }

    /// q72's shape: the filtered dimensions join the fact table before the many-to-many join
    /// written first; an outer join and a join reading a later table's column stay put.
    #[test]
    fn filtered_dimensions_join_the_first_input_first() {
        let data: Vec<Rows> = vec![vec![]; 5];
        let sql = "SELECT f.v, e.w, db.y, da.x, dc.z FROM f JOIN e ON f.a = e.a \
                   JOIN db ON f.b = db.b JOIN dc ON db.y = dc.y JOIN da ON f.a = da.a \
                   WHERE da.x = 1 AND dc.z = 2";
        let (_, plan) = run(&context(true, &data), sql);
        let joins: Vec<&str> = plan.lines().filter(|l| l.contains("Join:")).collect();
        // Bottom-up: f ⋈ da (filtered, reads f) first, then e, db, dc as written (dc is
        // filtered but reads db's column).
        let order: Vec<&str> = joins
            .iter()
            .rev()
            .map(|l| l.split("= ").nth(1).unwrap_or("").trim())
            .collect();
        assert_eq!(order, ["da.a", "e.a", "db.b", "dc.y"], "{plan}");
        let (_, plain) = run(&context(false, &data), sql);
        assert!(plain.contains("TableScan: e"), "{plain}");
        let firsts: Vec<&str> = plain.lines().filter(|l| l.contains("Join:")).collect();
        assert!(firsts.last().is_some_and(|l| l.contains("e.a")), "{plain}");
        // A left join's chain is not touched.
        let sql = "SELECT * FROM f LEFT JOIN e ON f.a = e.a JOIN da ON f.a = da.a WHERE da.x = 1";
        let (_, with) = run(&context(true, &data), sql);
        let (_, without) = run(&context(false, &data), sql);
        assert_eq!(with, without);
    }
}
