//! Online aggregation: where the fact table sits in a query's plan. A join that builds on it
//! is turned so it streams on the probe side ([`fact_on_probe_side`]); of the plan's scans of
//! its files, the one whose rows reach the result is the one sampled ([`sampled_scans`]; the
//! others read it whole, as TPC-H Q21's `EXISTS` over `lineitem` does), and it must stream to
//! the aggregate, never from a side a join collects whole ([`streams_to`]).

use crate::planner::Stage;
use crate::split::plan_err;
use crate::{Error, Result};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::physical_plan::ParquetSource;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::DataFusionError;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use std::collections::HashSet;
use std::sync::Arc;

/// `plan` with every inner (where it pays) and left broadcast join that builds on the fact
/// table turned around, so the fact table streams through it: DataFusion builds on the side
/// its estimates find smaller, and a filtered fact table can look smaller than a dimension (TPC-H Q14's month of
/// `lineitem` against `part`), which would read the whole fact table before the first
/// estimate. The other side, now the build side, is gathered; the fact side loses its gather.
pub(crate) fn fact_on_probe_side(
    plan: Arc<dyn ExecutionPlan>,
    files: &HashSet<String>,
) -> Result<Arc<dyn ExecutionPlan>> {
    use datafusion::common::JoinType;
    use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
    use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
    let plan_before = plan.clone();
    let out = plan.transform_up(|node| {
        let Some(j) = node.downcast_ref::<HashJoinExec>() else {
            return Ok(Transformed::no(node));
        };
        // A left join that builds on the fact table is always turned: it would emit the
        // fact rows no probe row met only after every split.
        let turn = *j.partition_mode() == PartitionMode::CollectLeft
            && matches!(j.join_type(), JoinType::Inner | JoinType::Left)
            && fact_scans(j.left(), files).map_err(to_df)? > 0
            && fact_scans(j.right(), files).map_err(to_df)? == 0
            && (*j.join_type() == JoinType::Left || build_cost(j.right()) < scan_cost(j.left()));
        if !turn {
            return Ok(Transformed::no(node));
        }
        let mut fact = j.left().clone();
        while let Some(c) = fact.downcast_ref::<CoalescePartitionsExec>() {
            if c.fetch().is_some() {
                return Ok(Transformed::no(node)); // a LIMIT on the fact side: left alone
            }
            fact = c.input().clone();
        }
        let mut build = j.right().clone();
        if build.output_partitioning().partition_count() > 1 {
            build = Arc::new(CoalescePartitionsExec::new(build));
        }
        // `swap_inputs` turns the sides and the keys, and restores the output's column order.
        let swapped = j
            .builder()
            .with_new_children(vec![fact, build])?
            .reset_state()
            .build_exec()?;
        let swapped = swapped
            .downcast_ref::<HashJoinExec>()
            .ok_or_else(|| DataFusionError::Internal("a rebuilt join is a join".into()))?
            .swap_inputs(PartitionMode::CollectLeft)?;
        Ok(Transformed::yes(swapped))
    })?;
    if !out.transformed {
        return Ok(plan_before);
    }
    // The turned joins' output is partitioned as the fact side is, no longer as the other
    // side was: a parent that needed the old partitioning or order keeps the plan as it was.
    use datafusion::physical_optimizer::sanity_checker::SanityCheckPlan;
    use datafusion::physical_optimizer::PhysicalOptimizerRule;
    let options = datafusion::config::ConfigOptions::default();
    match SanityCheckPlan::new().optimize(out.data.clone(), &options) {
        Ok(_) => Ok(out.data),
        Err(e) => {
            tracing::debug!(error = %e, "online: the fact table stays a build side");
            Ok(plan_before)
        }
    }
}

/// What building on `side` costs before the first estimate, in scanned-row units by
/// DataFusion's estimates: every row it scans, and [`HASHED_ROW_COST`] per row it hashes
/// (unknown: the most). A join is turned around only when building on the other side costs
/// less than merely scanning the fact side's input, whatever its filters keep: DataFusion's
/// estimate of what they keep is too rough to count on (TPC-H Q12 at SF 10: 60 M `lineitem`
/// rows scanned for ~1 M kept, built on, gave the first estimate at 1.78 s; 15 M `orders`
/// rows built on, at 2.18 s).
fn build_cost(side: &Arc<dyn ExecutionPlan>) -> f64 {
    use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
    let hashed = StatisticsContext::new()
        .compute(side.as_ref(), &StatisticsArgs::new())
        .ok()
        .and_then(|s| s.num_rows.get_value().copied());
    match (crate::planner::scanned_rows(side), hashed) {
        (Some(scanned), Some(hashed)) => scanned as f64 + HASHED_ROW_COST * hashed as f64,
        _ => f64::INFINITY,
    }
}

/// The rows `side` scans (unknown: none, so nothing is turned around for it).
fn scan_cost(side: &Arc<dyn ExecutionPlan>) -> f64 {
    crate::planner::scanned_rows(side).map_or(0.0, |n| n as f64)
}

/// A hashed build-side row's cost in scanned rows: about 4 on this 2-core machine (TPC-H Q12
/// and Q14 at SF 10, `docs/online/index.md`).
const HASHED_ROW_COST: f64 = 4.0;

pub(crate) fn to_df(e: Error) -> DataFusionError {
    DataFusionError::Plan(e.to_string())
}

/// Parquet scans of the fact table's files under `plan`.
pub(crate) fn fact_scans(plan: &Arc<dyn ExecutionPlan>, files: &HashSet<String>) -> Result<usize> {
    let mut n = usize::from(is_fact_scan(plan, files)?);
    for c in plan.children() {
        n += fact_scans(c, files)?;
    }
    Ok(n)
}

/// A scan of the fact table and the stage it sits in (None: the driver's part).
pub(crate) type SampledScan = (Option<Stage>, Arc<dyn ExecutionPlan>);

/// The scans of the fact table whose rows reach the query's result, each with the stage it
/// sits in (None: the driver's part): under the driver's part and the stages it reads,
/// every fact scan but those on the side of a semi or anti join that only filters the other
/// side's rows, and on the side of an outer join that only adds columns (or NULLs) to the
/// other side's: those read the table whole (TPC-H Q21's `EXISTS` over `lineitem`, the
/// sampled table itself). A stage read twice counts twice.
pub(crate) fn sampled_scans(
    staged: &crate::planner::StagedPlan,
    files: &HashSet<String>,
) -> Result<Vec<SampledScan>> {
    use crate::reader::ShuffleReaderExec;
    use datafusion::common::JoinType;
    use datafusion::physical_plan::joins::{
        HashJoinExec, NestedLoopJoinExec, SortMergeJoinExec, SymmetricHashJoinExec,
    };
    fn walk(
        node: &Arc<dyn ExecutionPlan>,
        stage: Option<&Stage>,
        staged: &crate::planner::StagedPlan,
        files: &HashSet<String>,
        depth: usize,
        out: &mut Vec<SampledScan>,
    ) -> Result<()> {
        if depth > 10_000 {
            return Err(plan_err("the plan is too deep to walk"));
        }
        if is_fact_scan(node, files)? {
            out.push((stage.cloned(), node.clone()));
            return Ok(());
        }
        if let Some(r) = node.downcast_ref::<ShuffleReaderExec>() {
            let s = staged
                .stages
                .iter()
                .find(|s| s.id() == r.stage)
                .ok_or_else(|| plan_err(format!("a reader of stage {}, not planned", r.stage)))?;
            let plan = s.writer.clone() as Arc<dyn ExecutionPlan>;
            return walk(&plan, Some(s), staged, files, depth + 1, out);
        }
        let join_type = node
            .downcast_ref::<HashJoinExec>()
            .map(|j| *j.join_type())
            .or_else(|| {
                node.downcast_ref::<SortMergeJoinExec>()
                    .map(|j| j.join_type())
            })
            .or_else(|| {
                node.downcast_ref::<NestedLoopJoinExec>()
                    .map(|j| *j.join_type())
            })
            .or_else(|| {
                node.downcast_ref::<SymmetricHashJoinExec>()
                    .map(|j| *j.join_type())
            });
        let children = node.children();
        let kept: Vec<&Arc<dyn ExecutionPlan>> = match (join_type, children.as_slice()) {
            (
                Some(JoinType::Left | JoinType::LeftSemi | JoinType::LeftAnti | JoinType::LeftMark),
                [left, _],
            ) => vec![*left],
            (
                Some(
                    JoinType::Right
                    | JoinType::RightSemi
                    | JoinType::RightAnti
                    | JoinType::RightMark,
                ),
                [_, right],
            ) => vec![*right],
            _ => children,
        };
        for c in kept {
            walk(c, stage, staged, files, depth + 1, out)?;
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(&staged.root, None, staged, files, 0, &mut out)?;
    Ok(out)
}

/// Whether `target` sits under `plan` on a path each split's rows stream along, within their
/// own partition, to the aggregate: never on the side a join collects whole (a broadcast
/// hash join's, a nested loop join's or a cross join's left side), which every task would
/// build from all the splits, and whose unmatched rows an outer join emits only at the end.
pub(crate) fn streams_to(plan: &Arc<dyn ExecutionPlan>, target: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::physical_plan::joins::{
        CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode,
    };
    if Arc::ptr_eq(plan, target) {
        return true;
    }
    let children = plan.children();
    let collects_left = plan
        .downcast_ref::<HashJoinExec>()
        .is_some_and(|j| *j.partition_mode() != PartitionMode::Partitioned)
        || plan.downcast_ref::<NestedLoopJoinExec>().is_some()
        || plan.downcast_ref::<CrossJoinExec>().is_some();
    let streaming = if collects_left {
        &children[1..]
    } else {
        &children[..]
    };
    streaming.iter().any(|c| streams_to(c, target))
}

/// Whether `plan` scans files of the fact table; an error if it mixes them with others.
fn is_fact_scan(
    plan: &Arc<dyn ExecutionPlan>,
    files: &HashSet<String>,
) -> datafusion::error::Result<bool> {
    let Some((config, _)) = plan
        .downcast_ref::<DataSourceExec>()
        .and_then(|s| s.downcast_to_file_source::<ParquetSource>())
    else {
        return Ok(false);
    };
    let paths: Vec<String> = config
        .file_groups
        .iter()
        .flat_map(|g| g.iter())
        .map(|f| f.path().to_string())
        .collect();
    let fact = paths.iter().filter(|p| files.contains(*p)).count();
    if fact > 0 && fact < paths.len() {
        return Err(DataFusionError::Plan(
            "online aggregation: a scan reads the fact table's files with others".into(),
        ));
    }
    Ok(fact > 0)
}

#[cfg(test)]
mod tests {
    use super::streams_to;
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::{JoinType, NullEquality};
    use datafusion::physical_expr::expressions::Column;
    use datafusion::physical_expr::PhysicalExprRef;
    use datafusion::physical_plan::empty::EmptyExec;
    use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
    use datafusion::physical_plan::ExecutionPlan;
    use std::sync::Arc;

    fn scan(name: &str) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new(name, DataType::Int64, false)]));
        Arc::new(EmptyExec::new(schema).with_partitions(2))
    }

    fn join(
        left: &Arc<dyn ExecutionPlan>,
        right: &Arc<dyn ExecutionPlan>,
        join_type: JoinType,
        mode: PartitionMode,
    ) -> Arc<dyn ExecutionPlan> {
        let on: Vec<(PhysicalExprRef, PhysicalExprRef)> = vec![(
            Arc::new(Column::new(left.schema().field(0).name(), 0)),
            Arc::new(Column::new(right.schema().field(0).name(), 0)),
        )];
        Arc::new(
            HashJoinExec::try_new(
                left.clone(),
                right.clone(),
                on,
                None,
                &join_type,
                None,
                mode,
                NullEquality::NullEqualsNothing,
                false,
            )
            .expect("a join"),
        )
    }

    #[test]
    fn only_a_broadcast_joins_probe_side_streams_the_splits() {
        let (a, b) = (scan("a"), scan("b"));
        for t in [
            JoinType::Inner,
            JoinType::Left,
            JoinType::LeftSemi,
            JoinType::Right,
        ] {
            let j = join(&a, &b, t, PartitionMode::CollectLeft);
            assert!(
                !streams_to(&j, &a),
                "{t}: the build side is collected whole"
            );
            assert!(streams_to(&j, &b), "{t}: the probe side streams");
        }
        let j = join(&a, &b, JoinType::Inner, PartitionMode::Partitioned);
        assert!(streams_to(&j, &a) && streams_to(&j, &b));
        // Below another join's probe side, and not found at all.
        let outer = join(
            &scan("c"),
            &join(&a, &b, JoinType::Inner, PartitionMode::CollectLeft),
            JoinType::Inner,
            PartitionMode::CollectLeft,
        );
        assert!(streams_to(&outer, &b) && !streams_to(&outer, &a));
        assert!(!streams_to(&outer, &scan("b")));
    }
}
