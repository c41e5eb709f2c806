//! `KeyFilterExec`: an input's rows kept only where their key columns take a value that a
//! second, small plan (its *keys* side, one partition) holds, decided when the keys are read.
//!
//! It is a broadcast semi join without the join: the keys side is read whole once per plan
//! instance (a worker decodes a stage plan once, so once per worker), into a set of the keys'
//! row encodings; each input batch is then filtered against it. Where the keys side turns out
//! to hold more than `max_keys` rows, the filter passes every input row through: the estimate
//! that put it there was wrong, and a set that large would cost more than the rows it saves
//! (`crate::side_reduction`, which places it below a join's exchange).
//!
//! NULL keys meet nothing unless `nulls_equal` (`IS NOT DISTINCT FROM` joins), as in the
//! join above it.

use arrow::array::{Array, ArrayRef, BooleanArray, RecordBatch};
use arrow::compute::filter_record_batch;
use arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::Statistics;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::{StreamExt, TryStreamExt};
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use tokio::sync::OnceCell;

/// The keys side's values and the memory they hold, or None: too many of them (by rows, or
/// by the bytes the worker's memory pool grants), every row passes.
type KeySet = Option<Arc<Keys>>;

/// The set of key encodings, its bytes reserved from the worker's memory pool while it lives.
#[derive(Debug)]
struct Keys {
    set: HashSet<Box<[u8]>>,
    _reservation: MemoryReservation,
}

/// See the module doc.
#[derive(Debug)]
pub struct KeyFilterExec {
    keys: Arc<dyn ExecutionPlan>,
    input: Arc<dyn ExecutionPlan>,
    /// Key columns in the keys side's schema and, in the same order, in the input's.
    key_columns: Vec<usize>,
    input_columns: Vec<usize>,
    nulls_equal: bool,
    max_keys: usize,
    set: Arc<OnceCell<KeySet>>,
    properties: Arc<PlanProperties>,
}

impl KeyFilterExec {
    /// Checks that the key columns exist on both sides with the same types, and that the keys
    /// side has one partition.
    pub fn try_new(
        keys: Arc<dyn ExecutionPlan>,
        input: Arc<dyn ExecutionPlan>,
        key_columns: Vec<usize>,
        input_columns: Vec<usize>,
        nulls_equal: bool,
        max_keys: usize,
    ) -> Result<Self> {
        let bad = |what: &str| DataFusionError::Plan(format!("key filter: {what}"));
        if key_columns.is_empty() || key_columns.len() != input_columns.len() {
            return Err(bad("key columns do not pair up"));
        }
        if keys.output_partitioning().partition_count() != 1 {
            return Err(bad("the keys side must have one partition"));
        }
        let (ks, is) = (keys.schema(), input.schema());
        for (k, i) in key_columns.iter().zip(&input_columns) {
            let (Some(kf), Some(inf)) = (ks.fields().get(*k), is.fields().get(*i)) else {
                return Err(bad("a key column is out of range"));
            };
            if kf.data_type() != inf.data_type() {
                return Err(bad("key columns of different types"));
            }
        }
        let properties = Arc::new(input.properties().as_ref().clone());
        Ok(KeyFilterExec {
            keys,
            input,
            key_columns,
            input_columns,
            nulls_equal,
            max_keys,
            set: Arc::new(OnceCell::new()),
            properties,
        })
    }

    /// The keys side (one partition).
    pub fn keys(&self) -> &Arc<dyn ExecutionPlan> {
        &self.keys
    }
    /// The input it filters.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
    /// The key columns in the keys side's schema.
    pub fn key_columns(&self) -> &[usize] {
        &self.key_columns
    }
    /// The key columns in the input's schema, in the same order.
    pub fn input_columns(&self) -> &[usize] {
        &self.input_columns
    }
    /// Whether NULL keys meet NULL keys.
    pub fn nulls_equal(&self) -> bool {
        self.nulls_equal
    }
    /// Past this many keys side rows every input row passes.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }
}

/// A converter to row encodings for the columns `cols` of `batch`, and whether each row has
/// a NULL among them.
fn encode(
    converter: &RowConverter,
    batch: &RecordBatch,
    cols: &[usize],
) -> Result<(arrow::row::Rows, Vec<bool>)> {
    let arrays: Vec<ArrayRef> = cols.iter().map(|c| batch.column(*c).clone()).collect();
    let rows = converter.convert_columns(&arrays)?;
    let mut nulls = vec![false; batch.num_rows()];
    for a in &arrays {
        if let Some(valid) = a.logical_nulls() {
            for (null, v) in nulls.iter_mut().zip(valid.iter()) {
                *null |= !v;
            }
        }
    }
    Ok((rows, nulls))
}

fn converter_for(batch_schema: &arrow::datatypes::Schema, cols: &[usize]) -> Result<RowConverter> {
    let fields = cols
        .iter()
        .map(|c| SortField::new(batch_schema.field(*c).data_type().clone()))
        .collect();
    Ok(RowConverter::new(fields)?)
}

/// Reads the keys side whole into a set; None once it holds more than `max_keys` rows or the
/// worker's memory pool refuses the set's bytes.
async fn collect_keys(
    keys: Arc<dyn ExecutionPlan>,
    ctx: Arc<TaskContext>,
    cols: Vec<usize>,
    nulls_equal: bool,
    max_keys: usize,
) -> Result<KeySet> {
    let converter = converter_for(&keys.schema(), &cols)?;
    let reservation = MemoryConsumer::new("KeyFilterExec").register(ctx.memory_pool());
    let mut stream = keys.execute(0, ctx)?;
    let mut set = HashSet::new();
    let mut seen = 0usize;
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        seen = seen.saturating_add(batch.num_rows());
        if seen > max_keys {
            return Ok(None);
        }
        let (rows, nulls) = encode(&converter, &batch, &cols)?;
        // Each key's bytes, its box and the set's slot for it.
        let bytes = rows.size() + batch.num_rows() * 3 * std::mem::size_of::<usize>();
        if reservation.try_grow(bytes).is_err() {
            return Ok(None);
        }
        for (r, null) in rows.iter().zip(nulls) {
            if nulls_equal || !null {
                set.insert(r.as_ref().to_vec().into_boxed_slice());
            }
        }
    }
    Ok(Some(Arc::new(Keys {
        set,
        _reservation: reservation,
    })))
}

impl DisplayAs for KeyFilterExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let input = self.input.schema();
        let names: Vec<&str> = self
            .input_columns
            .iter()
            .map(|c| input.field(*c).name().as_str())
            .collect();
        write!(
            f,
            "KeyFilterExec: keep rows whose ({}) the keys side holds (at most {} keys{})",
            names.join(", "),
            self.max_keys,
            if self.nulls_equal {
                ", NULLs equal"
            } else {
                ""
            }
        )
    }
}

impl ExecutionPlan for KeyFilterExec {
    fn name(&self) -> &str {
        "KeyFilterExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.keys, &self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false, true]
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::Skip, ChildStats::At(partition)]
    }

    /// The input's, inexact: a join above still sees the rows it would without the filter.
    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        match input_stats.get(1) {
            Some(s) => Ok(Arc::new(s.as_ref().clone().to_inexact())),
            None => Ok(Arc::new(Statistics::new_unknown(&self.schema()))),
        }
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [keys, input]: [Arc<dyn ExecutionPlan>; 2] = children
            .try_into()
            .map_err(|_| DataFusionError::Plan("key filter: two children".into()))?;
        Ok(Arc::new(KeyFilterExec::try_new(
            keys,
            input,
            self.key_columns.clone(),
            self.input_columns.clone(),
            self.nulls_equal,
            self.max_keys,
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context.clone())?;
        let schema = self.schema();
        let (set, keys) = (self.set.clone(), self.keys.clone());
        let (key_cols, cols) = (self.key_columns.clone(), self.input_columns.clone());
        let (nulls_equal, max_keys) = (self.nulls_equal, self.max_keys);
        let converter = converter_for(&self.input.schema(), &cols)?;
        let filtered = async move {
            let set = set
                .get_or_try_init(|| collect_keys(keys, context, key_cols, nulls_equal, max_keys))
                .await?
                .clone();
            Ok::<_, DataFusionError>(input.map(move |batch| {
                let batch = batch?;
                let Some(keys) = &set else {
                    return Ok(batch);
                };
                let set = &keys.set;
                let (rows, nulls) = encode(&converter, &batch, &cols)?;
                let keep: BooleanArray = rows
                    .iter()
                    .zip(nulls)
                    .map(|(r, null)| Some((nulls_equal || !null) && set.contains(r.as_ref())))
                    .collect();
                Ok(filter_record_batch(&batch, &keep)?)
            }))
        };
        let stream = futures::stream::once(filtered).try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;

    fn table(parts: Vec<Vec<Option<i64>>>) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let parts: Vec<Vec<RecordBatch>> = parts
            .into_iter()
            .map(|p| {
                let col: ArrayRef = Arc::new(Int64Array::from(p));
                vec![RecordBatch::try_new(schema.clone(), vec![col]).unwrap()]
            })
            .collect();
        MemorySourceConfig::try_new_exec(&parts, schema, None).unwrap()
    }

    async fn run(filter: KeyFilterExec) -> Vec<Option<i64>> {
        run_in(filter, Arc::new(TaskContext::default())).await
    }

    async fn run_in(filter: KeyFilterExec, ctx: Arc<TaskContext>) -> Vec<Option<i64>> {
        let mut out = Vec::new();
        for p in 0..filter.properties().output_partitioning().partition_count() {
            let batches: Vec<RecordBatch> = filter
                .execute(p, ctx.clone())
                .unwrap()
                .try_collect()
                .await
                .unwrap();
            for b in batches {
                let a = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                out.extend(a.iter());
            }
        }
        out.sort();
        out
    }

    fn filter(nulls_equal: bool, max_keys: usize) -> KeyFilterExec {
        let keys = table(vec![vec![Some(1), Some(3), None, Some(3)]]);
        let input = table(vec![
            vec![Some(1), Some(2), None, Some(3)],
            vec![Some(3), Some(4), None],
        ]);
        KeyFilterExec::try_new(keys, input, vec![0], vec![0], nulls_equal, max_keys).unwrap()
    }

    #[tokio::test]
    async fn keeps_the_rows_whose_keys_the_keys_side_holds() {
        // Every partition, duplicates kept; NULL meets nothing unless NULLs are equal.
        assert_eq!(
            run(filter(false, 10)).await,
            vec![Some(1), Some(3), Some(3)]
        );
        let with_nulls = vec![None, None, Some(1), Some(3), Some(3)];
        assert_eq!(run(filter(true, 10)).await, with_nulls);
    }

    #[tokio::test]
    async fn more_keys_than_allowed_let_every_row_through() {
        assert_eq!(run(filter(false, 4)).await.len(), 3);
        let all = vec![None, None, Some(1), Some(2), Some(3), Some(3), Some(4)];
        assert_eq!(run(filter(false, 3)).await, all);
    }

    #[tokio::test]
    async fn a_memory_pool_that_refuses_the_keys_lets_every_row_through() {
        use datafusion::execution::memory_pool::GreedyMemoryPool;
        use datafusion::execution::runtime_env::RuntimeEnvBuilder;
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::new(GreedyMemoryPool::new(8)))
            .build_arc()
            .unwrap();
        let ctx = Arc::new(TaskContext::default().with_runtime(runtime));
        assert_eq!(run_in(filter(false, 10), ctx).await.len(), 7);
    }

    #[test]
    fn mismatched_keys_are_refused() {
        let keys = table(vec![vec![Some(1)]]);
        let input = table(vec![vec![Some(1)]]);
        assert!(
            KeyFilterExec::try_new(keys.clone(), input.clone(), vec![1], vec![0], false, 1)
                .is_err()
        );
        assert!(KeyFilterExec::try_new(keys, input, vec![0], vec![], false, 1).is_err());
        let two = table(vec![vec![Some(1)], vec![Some(2)]]);
        assert!(
            KeyFilterExec::try_new(two, table(vec![vec![None]]), vec![0], vec![0], false, 1)
                .is_err()
        );
    }
}
