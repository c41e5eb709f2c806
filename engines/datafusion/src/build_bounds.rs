//! `BuildBoundsExec`: a broadcast join's build-side key bounds, handed to the scans of its
//! probe side when the build side has been read, so those scans skip the row groups (and
//! pages) no key can meet.
//!
//! One process gets this from the dynamic filter a hash join fills once its build side is read:
//! TPC-DS q37 reads 5 of the 96 row groups of `inventory`, whose rows are stored by date, since
//! the query keeps 60 days. DataFusion's join fills that filter only once *every* partition of
//! its plan instance has reported, and a stage task runs only some partitions of its instance,
//! so the filters are turned off in distributed sessions ([`crate::distributed_options`]) and
//! the stage read all 11.7 M rows.
//!
//! [`attach`] runs on a worker once it has decoded a stage plan: DataFusion's own
//! `FilterPushdown` rule places each join's filter in the scans below its probe side (through
//! the filters, projections and other joins DataFusion knows how to cross; never past a stage
//! boundary), then every `CollectLeft` join whose filter reached a scan gets a
//! `BuildBoundsExec` over its build side. It lets the build rows through to the join and,
//! when they end, sets the filter to `min <= key AND key <= max` for each key (`false` when
//! no key can match). A `CollectLeft` join reads its build side whole before its first probe
//! row, so its scans usually open with the bounds in place (one opened earlier, by an operator
//! that starts its inputs when it is executed, reads every row group: slower, never wrong).
//! The join itself never touches the filter: the session keeps DataFusion's join filters off.
//!
//! Only joins whose unmatched probe rows are dropped get a filter (DataFusion's own rule
//! decides that). Left without bounds: joins where NULL keys are equal (`IS NOT DISTINCT
//! FROM`) and null-aware anti joins (`NOT IN`), since the bounds drop NULL probe keys those
//! joins need; and keys of a type without a plain order, floats among them (NaN and -0.0
//! match in the join but sit outside, or on the wrong side of, Parquet's min/max
//! statistics).

use arrow::array::RecordBatch;
use arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{NullEquality, ScalarValue};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::{Accumulator, Operator};
use datafusion::physical_expr::expressions::{lit, BinaryExpr, DynamicFilterPhysicalExpr, Literal};
use datafusion::physical_expr::{conjunction, PhysicalExpr};
use datafusion::physical_optimizer::filter_pushdown::FilterPushdown;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::replace_children_if_necessary;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::StreamExt;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// Places the probe-side scan filters of a decoded stage plan's broadcast joins and the
/// [`BuildBoundsExec`]s that fill them (see the module doc). `options` are the session's.
pub fn attach(
    plan: Arc<dyn ExecutionPlan>,
    options: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    let mut placing = options.clone();
    placing.optimizer.enable_join_dynamic_filter_pushdown = true;
    let placed = FilterPushdown::new_post_optimization().optimize(plan, &placing)?;
    placed
        .transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            match bounds_for(join)? {
                Some(bounds) => {
                    let children = vec![Arc::new(bounds) as _, join.right().clone()];
                    Ok(Transformed::yes(replace_children_if_necessary(
                        node.clone(),
                        children,
                    )?))
                }
                None => Ok(Transformed::no(node)),
            }
        })
        .map(|t| t.data)
}

/// The `BuildBoundsExec` for `join`'s build side, if its filter reached a scan below its
/// probe side.
fn bounds_for(join: &HashJoinExec) -> Result<Option<BuildBoundsExec>> {
    if *join.partition_mode() != PartitionMode::CollectLeft
        || join.null_equality() == NullEquality::NullEqualsNull
        || join.null_aware
        || join.left().output_partitioning().partition_count() != 1
    {
        return Ok(None);
    }
    let Some(filter) = join.dynamic_expressions_produced().into_iter().next() else {
        return Ok(None);
    };
    let Some(id) = filter.expression_id() else {
        return Ok(None);
    };
    let Ok(filter) = (filter as Arc<dyn Any + Send + Sync>).downcast::<DynamicFilterPhysicalExpr>()
    else {
        return Ok(None);
    };
    if !reaches(join.right(), id)? {
        return Ok(None);
    }
    let (build_schema, probe_schema) = (join.left().schema(), join.right().schema());
    for (l, r) in join.on() {
        let t = l.data_type(&build_schema)?;
        if t != r.data_type(&probe_schema)? || !ordered(&t) {
            return Ok(None);
        }
    }
    let (build, probe) = join
        .on()
        .iter()
        .map(|(l, r)| (l.clone(), r.clone()))
        .unzip();
    BuildBoundsExec::try_new(join.left().clone(), build, probe, filter).map(Some)
}

/// Whether values of type `t` have an order that Parquet's statistics and DataFusion's
/// comparisons share with the join's equality: integers, decimals, dates, times, strings
/// and binaries; not floats (NaN, -0.0), nor nested, dictionary or interval types.
pub(crate) fn ordered(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Boolean
            | Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | UInt64
            | Decimal32(..)
            | Decimal64(..)
            | Decimal128(..)
            | Decimal256(..)
            | Date32
            | Date64
            | Time32(_)
            | Time64(_)
            | Timestamp(..)
            | Utf8
            | LargeUtf8
            | Utf8View
            | Binary
            | LargeBinary
            | BinaryView
            | FixedSizeBinary(_)
    )
}

/// Whether an expression with this id sits in `plan` (a scan's predicate, once placed).
fn reaches(plan: &Arc<dyn ExecutionPlan>, id: u64) -> Result<bool> {
    let mut found = false;
    plan.apply(|node| {
        node.apply_expressions(&mut |root| {
            root.apply(|e| {
                found |= e.expression_id() == Some(id);
                Ok(if found {
                    TreeNodeRecursion::Stop
                } else {
                    TreeNodeRecursion::Continue
                })
            })
        })?;
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    Ok(found)
}

/// See the module doc.
#[derive(Debug)]
pub struct BuildBoundsExec {
    input: Arc<dyn ExecutionPlan>,
    /// The join's keys on its build side (over `input`) and, in the same order, on its probe
    /// side (the columns the filter is written over).
    build_keys: Vec<Arc<dyn PhysicalExpr>>,
    probe_keys: Vec<Arc<dyn PhysicalExpr>>,
    filter: Arc<DynamicFilterPhysicalExpr>,
    properties: Arc<PlanProperties>,
}

impl BuildBoundsExec {
    /// Checks that the keys pair up and that the input has one partition (all of the build
    /// side); [`attach`] checks their types.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        build_keys: Vec<Arc<dyn PhysicalExpr>>,
        probe_keys: Vec<Arc<dyn PhysicalExpr>>,
        filter: Arc<DynamicFilterPhysicalExpr>,
    ) -> Result<Self> {
        let bad = |what: &str| DataFusionError::Plan(format!("build bounds: {what}"));
        if build_keys.is_empty() || build_keys.len() != probe_keys.len() {
            return Err(bad("keys do not pair up"));
        }
        if input.output_partitioning().partition_count() != 1 {
            return Err(bad("the build side must have one partition"));
        }
        let properties = Arc::new(input.properties().as_ref().clone());
        Ok(BuildBoundsExec {
            input,
            build_keys,
            probe_keys,
            filter,
            properties,
        })
    }
}

/// A build side's bounds as its rows go by, and the filter they end up in.
struct Watch {
    bounds: Bounds,
    build: Vec<Arc<dyn PhysicalExpr>>,
    probe: Vec<Arc<dyn PhysicalExpr>>,
    filter: Arc<DynamicFilterPhysicalExpr>,
}

impl Watch {
    /// Sets the filter from the whole build side's bounds.
    fn finish(mut self) -> Result<()> {
        self.filter.update(self.bounds.predicate(&self.probe)?)?;
        self.filter.mark_complete();
        Ok(())
    }
}

/// The running min and max of each build key.
struct Bounds(Vec<(MinAccumulator, MaxAccumulator)>);

impl Bounds {
    fn new(input: &arrow::datatypes::Schema, keys: &[Arc<dyn PhysicalExpr>]) -> Result<Self> {
        let each = keys
            .iter()
            .map(|k| {
                let t = k.data_type(input)?;
                Ok((MinAccumulator::try_new(&t)?, MaxAccumulator::try_new(&t)?))
            })
            .collect::<Result<_>>()?;
        Ok(Bounds(each))
    }

    fn update(&mut self, keys: &[Arc<dyn PhysicalExpr>], batch: &RecordBatch) -> Result<()> {
        for (k, (min, max)) in keys.iter().zip(&mut self.0) {
            let values = k.evaluate(batch)?.into_array(batch.num_rows())?;
            min.update_batch(std::slice::from_ref(&values))?;
            max.update_batch(&[values])?;
        }
        Ok(())
    }

    /// `min <= key AND key <= max` over each probe key; `false` when a key has no non-NULL
    /// value on the build side (nothing can match).
    fn predicate(&mut self, probe: &[Arc<dyn PhysicalExpr>]) -> Result<Arc<dyn PhysicalExpr>> {
        let mut bounds = Vec::new();
        for (key, (min, max)) in probe.iter().zip(&mut self.0) {
            let (lo, hi) = (min.evaluate()?, max.evaluate()?);
            if lo.is_null() || hi.is_null() {
                return Ok(lit(false));
            }
            bounds.push(compare(lo, Operator::LtEq, key));
            bounds.push(compare(hi, Operator::GtEq, key));
        }
        Ok(conjunction(bounds))
    }
}

fn compare(bound: ScalarValue, op: Operator, key: &Arc<dyn PhysicalExpr>) -> Arc<dyn PhysicalExpr> {
    Arc::new(BinaryExpr::new(
        Arc::new(Literal::new(bound)),
        op,
        key.clone(),
    ))
}

impl DisplayAs for BuildBoundsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let keys: Vec<String> = self.probe_keys.iter().map(|k| k.to_string()).collect();
        write!(
            f,
            "BuildBoundsExec: bounds of ({}) to the probe side's scans",
            keys.join(", ")
        )
    }
}

impl ExecutionPlan for BuildBoundsExec {
    fn name(&self) -> &str {
        "BuildBoundsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        datafusion::physical_plan::execution_plan::apply_expression_roots(&self.build_keys, f)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input]: [Arc<dyn ExecutionPlan>; 1] = children
            .try_into()
            .map_err(|_| DataFusionError::Plan("build bounds: one child".into()))?;
        Ok(Arc::new(BuildBoundsExec::try_new(
            input,
            self.build_keys.clone(),
            self.probe_keys.clone(),
            self.filter.clone(),
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let schema = self.schema();
        let watch = Watch {
            bounds: Bounds::new(&self.input.schema(), &self.build_keys)?,
            build: self.build_keys.clone(),
            probe: self.probe_keys.clone(),
            filter: self.filter.clone(),
        };
        // Rows pass as they come; the filter is set only once the input has ended whole (an
        // error or an early drop leaves it as it was: every row passes).
        let stream = futures::stream::unfold((input, Some(watch)), |(mut input, watch)| async {
            let mut watch = watch?;
            match input.next().await {
                Some(Ok(batch)) => match watch.bounds.update(&watch.build, &batch) {
                    Ok(()) => Some((Ok(batch), (input, Some(watch)))),
                    Err(e) => Some((Err(e), (input, None))),
                },
                Some(Err(e)) => Some((Err(e), (input, None))),
                None => watch.finish().err().map(|e| (Err(e), (input, None))),
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    use datafusion::physical_plan::collect;
    use datafusion::physical_plan::metrics::MetricValue;
    use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

    /// `big`: keys NULL, 1..999 in key order, 10 row groups of 100; `small`: the keys in
    /// `small`.
    async fn session(dir: &std::path::Path, small: Vec<Option<i64>>) -> SessionContext {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("v", DataType::Utf8, false),
        ]));
        let keys: Vec<Option<i64>> = (0..1000).map(|k| (k > 0).then_some(k)).collect();
        let names: Vec<String> = (0..1000).map(|k| format!("row {k}")).collect();
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(StringArray::from(names)),
            ],
        )
        .unwrap();
        let path = dir.join("big.parquet");
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(100))
            .build();
        let mut w =
            ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), schema, Some(props))
                .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let config = crate::distributed_options(SessionConfig::new().with_target_partitions(2));
        let ctx = SessionContext::new_with_config(config);
        ctx.register_parquet("big", path.to_str().unwrap(), ParquetReadOptions::default())
            .await
            .unwrap();
        let small_schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let small =
            RecordBatch::try_new(small_schema, vec![Arc::new(Int64Array::from(small))]).unwrap();
        ctx.register_batch("small", small).unwrap();
        ctx
    }

    /// Runs `sql` with the bounds attached or not: its rows, and the rows the scan of `big`
    /// let through.
    async fn run(ctx: &SessionContext, sql: &str, bounds: bool) -> (Vec<RecordBatch>, usize) {
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let plan = if bounds {
            attach(plan, ctx.state().config_options()).unwrap()
        } else {
            plan
        };
        let out = collect(plan.clone(), ctx.task_ctx()).await.unwrap();
        let mut scanned = 0;
        plan.apply(|node| {
            if node.name() == "DataSourceExec" {
                for m in node
                    .metrics()
                    .into_iter()
                    .flat_map(|m| m.iter().cloned().collect::<Vec<_>>())
                {
                    if let MetricValue::OutputRows(c) = m.value() {
                        scanned += c.value();
                    }
                }
            }
            Ok(TreeNodeRecursion::Continue)
        })
        .unwrap();
        (out, scanned)
    }

    fn count(batches: &[RecordBatch]) -> i64 {
        let col = batches[0]
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        col.value(0)
    }

    fn has_bounds(plan: &Arc<dyn ExecutionPlan>) -> bool {
        plan.exists(|n| Ok(n.name() == "BuildBoundsExec")).unwrap()
    }

    #[tokio::test]
    async fn a_broadcast_joins_scan_reads_only_the_row_groups_its_keys_can_meet() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = session(dir.path(), vec![Some(210), Some(250), None, Some(250)]).await;
        let sql = "SELECT count(*) FROM small JOIN big ON small.k = big.k";
        let (without, all) = run(&ctx, sql, false).await;
        let (with, pruned) = run(&ctx, sql, true).await;
        assert_eq!(count(&without), 3);
        assert_eq!(count(&with), 3);
        assert_eq!(all, 1000);
        assert_eq!(pruned, 100, "one row group holds 210..250");

        // Bounds on row-group edges keep both edge groups and the ones between.
        let ctx = session(dir.path(), vec![Some(300), Some(99)]).await;
        let (with, scanned) = run(&ctx, sql, true).await;
        assert_eq!(count(&with), 2);
        assert_eq!(scanned, 400);
    }

    #[tokio::test]
    async fn a_build_side_without_a_key_that_can_match_reads_no_row_group() {
        // A left join reads its probe side even when no build key can match.
        let sql = "SELECT count(*) FROM small LEFT JOIN big ON small.k = big.k";
        let dir = tempfile::tempdir().unwrap();
        let ctx = session(dir.path(), vec![None, None]).await;
        let (with, scanned) = run(&ctx, sql, true).await;
        assert_eq!(count(&with), 2);
        assert_eq!(scanned, 0);
        let (without, scanned) = run(&ctx, sql, false).await;
        assert_eq!(count(&without), 2);
        assert_eq!(scanned, 1000);
    }

    #[tokio::test]
    async fn joins_that_need_null_or_float_probe_keys_or_all_probe_rows_get_no_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = session(dir.path(), vec![Some(210), Some(5000), None]).await;
        for (sql, want) in [
            // The probe side's unmatched rows are kept.
            (
                "SELECT count(*) FROM small RIGHT JOIN big ON small.k = big.k",
                1000,
            ),
            // NULL meets NULL: big's NULL key (row group 0, below the bounds) meets small's.
            (
                "SELECT count(*) FROM small JOIN big ON small.k IS NOT DISTINCT FROM big.k",
                2,
            ),
            // big's NULL key (row group 0) empties NOT IN; 5000 is not in big otherwise.
            (
                "SELECT count(*) FROM (SELECT coalesce(k, 5000) AS k FROM small) s \
                 WHERE s.k NOT IN (SELECT k FROM big)",
                0,
            ),
            // Floats: NaN and -0.0 meet in the join but not in min/max statistics.
            (
                "SELECT count(*) FROM small JOIN big \
                 ON CAST(small.k AS DOUBLE) = CAST(big.k AS DOUBLE)",
                1,
            ),
        ] {
            let plan = ctx
                .sql(sql)
                .await
                .unwrap()
                .create_physical_plan()
                .await
                .unwrap();
            let attached = attach(plan, ctx.state().config_options()).unwrap();
            assert!(!has_bounds(&attached), "{sql}");
            let (out, _) = run(&ctx, sql, true).await;
            assert_eq!(count(&out), want, "{sql}");
        }
    }
}
