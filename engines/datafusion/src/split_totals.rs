//! Per-split totals for online intervals that hold on data as it is stored
//! ([`SplitTotalsExec`]).
//!
//! An online query reads its fact table split by split, in a random order, so the sampling
//! unit is a split, not a row: rows of one split are read together, and where a layout keeps
//! a group's rows together (TPC-H's orders by key, a table sorted by date) they are not
//! independent. The variance of an estimate has to come from the spread *between splits*
//! (cluster sampling with a ratio-to-size estimator: Cochran, *Sampling Techniques*, §9A;
//! Lohr, *Sampling: Design and Analysis*, §5.3), which needs, per group, sums over the splits
//! read of products of each split's totals: `Σ t_a·t_b` for statistics `a`, `b` (and of a
//! statistic with the split's size, and the number of splits a group appears in).
//!
//! A map task of the fact stage reads one split, so its partial aggregate's output holds
//! that split's totals, though a group may come in several partial rows (DataFusion's
//! partial aggregate passes rows through when groups are many). [`SplitTotalsExec`] merges
//! them into one row per group (the same [`Running`] state the folds use), then appends one
//! column per [`Term`]: that split's product. The products are summed as the folds merge
//! states: the extra columns are the states of `SUM` aggregates of a widened partial
//! aggregate ([`widened`]), whose `PartialReduce` plan is what the folds run.

use crate::running::Running;
use arrow::array::{Array, ArrayRef, Float64Array, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::functions_aggregate::sum::sum_udaf;
use datafusion::physical_expr::aggregate::AggregateExprBuilder;
use datafusion::physical_expr::expressions::col;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::StreamExt;
use std::fmt;
use std::sync::Arc;

/// A factor of a [`Term`]: the split's rows.
pub const SIZE: u32 = u32::MAX;
/// A factor of a [`Term`]: 1 (`ONE × ONE` counts the splits a group appears in).
pub const ONE: u32 = u32::MAX - 1;

/// One product summed over splits: `Σ_splits x_a · x_b`, each factor a statistic (the index
/// of an aggregate of the partial aggregate, whose one state column holds a split's total),
/// [`SIZE`] or [`ONE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Term(pub u32, pub u32);

/// Name of term k's column in the folded statistics.
fn term_name(k: usize) -> String {
    format!("__term{k}")
}

/// The partial aggregate `agg` with one `SUM` over a Float64 column per term appended: it
/// never runs; its schema is what [`SplitTotalsExec`] emits and its `PartialReduce` plan is
/// what the folds merge (every `SUM` state a Float64 sum, merged by adding).
pub fn widened(agg: &AggregateExec, terms: &[Term]) -> Result<AggregateExec> {
    let input = agg.input_schema();
    let mut fields: Vec<Arc<Field>> = input.fields().iter().cloned().collect();
    fields.extend(
        (0..terms.len()).map(|k| Arc::new(Field::new(term_name(k), DataType::Float64, true))),
    );
    let schema = Arc::new(Schema::new_with_metadata(fields, input.metadata().clone()));
    let mut aggs = agg.aggr_expr().to_vec();
    let mut filters = agg.filter_expr().to_vec();
    for k in 0..terms.len() {
        let name = term_name(k);
        let sum = AggregateExprBuilder::new(sum_udaf(), vec![col(&name, &schema)?])
            .schema(schema.clone())
            .alias(name)
            .build()?;
        aggs.push(Arc::new(sum));
        filters.push(None);
    }
    AggregateExec::try_new(
        AggregateMode::Partial,
        agg.group_expr().clone(),
        aggs,
        filters,
        Arc::new(EmptyExec::new(schema.clone())),
        schema,
    )
}

/// The partial aggregate of an online query's fact stage (one partition per split), its
/// partial rows merged per group and each [`Term`]'s product of the split appended.
#[derive(Debug)]
pub struct SplitTotalsExec {
    input: Arc<dyn ExecutionPlan>,
    /// The products to append.
    pub terms: Vec<Term>,
    /// Rows of split i, read by partition i.
    pub split_rows: Arc<Vec<u64>>,
    /// Merges the input's partial rows (its `PartialReduce`).
    reduce: Arc<AggregateExec>,
    keys: usize,
    properties: Arc<PlanProperties>,
}

impl SplitTotalsExec {
    /// `input` (a partial aggregate with one partition per split, each aggregate with one
    /// state column) with `terms` appended; `split_rows[i]` rows in split i.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        terms: Vec<Term>,
        split_rows: Vec<u64>,
    ) -> Result<Self> {
        let agg = input
            .downcast_ref::<AggregateExec>()
            .filter(|a| *a.mode() == AggregateMode::Partial)
            .ok_or_else(|| plan_err("per-split totals need a partial aggregate"))?;
        let aggs = agg.aggr_expr().len();
        for expr in agg.aggr_expr() {
            if expr.state_fields()?.len() != 1 {
                return Err(plan_err(format!(
                    "{} has {} state columns (per-split totals need one)",
                    expr.name(),
                    expr.state_fields()?.len()
                )));
            }
        }
        for t in &terms {
            for f in [t.0, t.1] {
                if f != SIZE && f != ONE && f as usize >= aggs {
                    return Err(plan_err(format!(
                        "term factor {f} is not one of the {aggs} statistics"
                    )));
                }
            }
        }
        if split_rows.len() != input.output_partitioning().partition_count() {
            return Err(plan_err(format!(
                "{} split sizes for {} partitions",
                split_rows.len(),
                input.output_partitioning().partition_count()
            )));
        }
        let keys = agg.group_expr().expr().len();
        if !agg.group_expr().is_single() {
            return Err(plan_err("grouping sets have no per-split totals"));
        }
        let reduce = AggregateExec::try_new(
            AggregateMode::PartialReduce,
            agg.group_expr().as_final(),
            agg.aggr_expr().to_vec(),
            vec![None; aggs],
            Arc::new(EmptyExec::new(agg.schema())),
            agg.input_schema(),
        )?;
        let schema = widened(agg, &terms)?.schema();
        let properties = PlanProperties::new(
            EquivalenceProperties::new(schema),
            input.output_partitioning().clone(),
            EmissionType::Final,
            Boundedness::Bounded,
        );
        Ok(SplitTotalsExec {
            input,
            terms,
            split_rows: Arc::new(split_rows),
            reduce: Arc::new(reduce),
            keys,
            properties: Arc::new(properties),
        })
    }

    /// The partial aggregate it reads.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

fn plan_err(what: impl fmt::Display) -> DataFusionError {
    DataFusionError::Plan(format!("online aggregation: {what}"))
}

/// A split's partial rows merged into one row per group.
fn merged(
    reduce: &AggregateExec,
    input: SchemaRef,
    keys: usize,
    batches: Vec<RecordBatch>,
) -> Result<Vec<RecordBatch>> {
    if keys == 0 {
        // Without group keys a partial aggregate emits one row: the split's totals.
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        if rows != 1 {
            return Err(DataFusionError::Execution(format!(
                "online aggregation: a split's aggregate without group keys gave {rows} rows"
            )));
        }
        return Ok(batches.into_iter().filter(|b| b.num_rows() > 0).collect());
    }
    let mut running = Running::try_new(reduce, input)?.ok_or_else(|| {
        DataFusionError::Execution(
            "online aggregation: these aggregates cannot be merged per split".into(),
        )
    })?;
    for b in batches.iter().filter(|b| b.num_rows() > 0) {
        running.add(b)?;
    }
    running.snapshot()
}

/// A split's totals of one statistic per row, as doubles (a null total is 0).
fn factor(batch: &RecordBatch, keys: usize, f: u32, size: f64) -> Result<Vec<f64>> {
    let n = batch.num_rows();
    if f == SIZE {
        return Ok(vec![size; n]);
    }
    if f == ONE {
        return Ok(vec![1.0; n]);
    }
    let column = batch.column(keys + f as usize);
    let doubles = cast(column, &DataType::Float64)?;
    let doubles = doubles
        .as_any()
        .downcast_ref::<Float64Array>()
        .ok_or_else(|| DataFusionError::Internal("a cast to Float64 gave another type".into()))?;
    Ok((0..n)
        .map(|i| {
            if doubles.is_null(i) {
                0.0
            } else {
                doubles.value(i)
            }
        })
        .collect())
}

/// `batches` (one row per group) with each term's product appended.
fn with_terms(
    batches: Vec<RecordBatch>,
    schema: &SchemaRef,
    keys: usize,
    terms: &[Term],
    size: f64,
) -> Result<Vec<RecordBatch>> {
    batches
        .into_iter()
        .map(|b| {
            let mut columns: Vec<ArrayRef> = b.columns().to_vec();
            for t in terms {
                let (a, c) = (factor(&b, keys, t.0, size)?, factor(&b, keys, t.1, size)?);
                let product: Float64Array = a.iter().zip(&c).map(|(x, y)| Some(x * y)).collect();
                columns.push(Arc::new(product));
            }
            Ok(RecordBatch::try_new(schema.clone(), columns)?)
        })
        .collect()
}

impl DisplayAs for SplitTotalsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "SplitTotalsExec: per split, {} products of its totals",
            self.terms.len()
        )
    }
}

impl ExecutionPlan for SplitTotalsExec {
    fn name(&self) -> &str {
        "SplitTotalsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = children
            .into_iter()
            .next()
            .ok_or_else(|| plan_err("per-split totals without an input"))?;
        Ok(Arc::new(SplitTotalsExec::try_new(
            input,
            self.terms.clone(),
            self.split_rows.as_ref().clone(),
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let size = *self.split_rows.get(partition).ok_or_else(|| {
            DataFusionError::Execution(format!("no split for partition {partition}"))
        })? as f64;
        let mut input = self.input.execute(partition, context)?;
        let schema = self.schema();
        let (reduce, keys, terms) = (self.reduce.clone(), self.keys, self.terms.clone());
        let input_schema = self.input.schema();
        let out_schema = schema.clone();
        let totals = async move {
            let mut batches = Vec::new();
            while let Some(b) = input.next().await {
                batches.push(b?);
            }
            let rows = merged(&reduce, input_schema, keys, batches)?;
            with_terms(rows, &out_schema, keys, &terms, size)
        };
        let stream = futures::stream::once(totals).flat_map(|r| {
            let items: Vec<Result<RecordBatch>> = match r {
                Ok(batches) => batches.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e)],
            };
            futures::stream::iter(items)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}
