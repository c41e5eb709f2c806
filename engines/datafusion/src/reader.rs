//! `ShuffleReaderExec`: a leaf of a consuming stage. Output partition p is reduce partition p
//! pulled from every worker (`Partition` mode), or the whole output of map task p — one sorted
//! run of a sort-preserving merge — (`MapOutput` mode). Key columns a hash writer appended are
//! stripped. Workers come from the session's [`crate::ExchangeContext`].

use crate::{df_err, ExchangeContext};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use flightshuffle::block::Slice;
use flightshuffle::ShuffleId;
use futures::StreamExt;
use std::fmt;
use std::sync::Arc;

/// What each output partition of a shuffle reader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMode {
    /// Output partition p reads reduce partition p from every worker.
    Partition = 0,
    /// Output partition p reads the whole output of map task p (one sorted run).
    MapOutput = 1,
}

/// Which part of the producer's output each output partition of a reader reads, when a skew
/// split changed the stage's partitions ([`crate::skew`]): output partition i reads reduce
/// partition `layout[i].0`, only the blocks of slice `layout[i].1`.
pub type Layout = Arc<Vec<(u32, Slice)>>;

/// A leaf of a consuming stage that reads one exchange's blocks from the workers.
#[derive(Debug)]
pub struct ShuffleReaderExec {
    /// The producing stage whose exchange it reads.
    pub stage: u32,
    /// The shuffle the producing stage wrote.
    pub shuffle: ShuffleId,
    /// What each output partition reads.
    pub mode: ReadMode,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    /// `None`: output partition p reads reduce partition p whole.
    pub layout: Option<Layout>,
    /// The key columns (name, index) its producer hashed rows on, when it reports hash
    /// partitioning ([`Self::with_hash_keys`]).
    pub hash_keys: Option<Vec<(String, usize)>>,
}

impl ShuffleReaderExec {
    /// A reader of `shuffle` (written by `stage`) with `partitions` output partitions of `schema`.
    pub fn new(
        stage: u32,
        shuffle: ShuffleId,
        mode: ReadMode,
        schema: SchemaRef,
        partitions: usize,
    ) -> Self {
        let properties = PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        ShuffleReaderExec {
            stage,
            shuffle,
            mode,
            schema,
            properties: Arc::new(properties),
            layout: None,
            hash_keys: None,
        }
    }

    /// This reader reporting its partitions as hashed on `keys` (columns of its schema, by
    /// name and index), as the repartition it replaced did: equal keys are in the same output
    /// partition, so operators that combine partitions index by index (a union's
    /// `InterleaveExec`) keep working on it. Keys that are not columns of its schema, or a
    /// reader of whole map outputs or split partitions, keep unknown partitioning.
    pub fn with_hash_keys(mut self, keys: Vec<(String, usize)>) -> Self {
        let fits = !keys.is_empty()
            && self.mode == ReadMode::Partition
            && self.layout.is_none()
            && keys.iter().all(|(name, i)| {
                self.schema
                    .fields()
                    .get(*i)
                    .is_some_and(|f| f.name() == name)
            });
        if !fits {
            return self;
        }
        let exprs: Vec<Arc<dyn datafusion::physical_plan::PhysicalExpr>> = keys
            .iter()
            .map(|(name, i)| {
                Arc::new(datafusion::physical_expr::expressions::Column::new(
                    name, *i,
                )) as Arc<dyn datafusion::physical_plan::PhysicalExpr>
            })
            .collect();
        let n = self.partitions();
        let properties = PlanProperties::new(
            EquivalenceProperties::new(self.schema.clone()),
            Partitioning::Hash(exprs, n),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        self.properties = Arc::new(properties);
        self.hash_keys = Some(keys);
        self
    }

    /// This reader with its output partitions laid out by `layout` (a `Partition`-mode reader
    /// only; the partition count becomes the layout's length).
    pub fn with_layout(&self, layout: Layout) -> Result<Self> {
        if self.mode != ReadMode::Partition {
            return Err(DataFusionError::Internal(
                "only a partition reader can be split".into(),
            ));
        }
        let mut r = ShuffleReaderExec::new(
            self.stage,
            self.shuffle,
            self.mode,
            self.schema.clone(),
            layout.len(),
        );
        r.layout = Some(layout);
        Ok(r)
    }

    /// The reduce partition and slice output partition `i` reads.
    fn part(&self, i: usize) -> Result<(u32, Slice)> {
        match &self.layout {
            None => u32::try_from(i)
                .map(|p| (p, Slice::WHOLE))
                .map_err(|_| DataFusionError::Execution(format!("partition {i} too large"))),
            Some(l) => l.get(i).copied().ok_or_else(|| {
                DataFusionError::Execution(format!(
                    "partition {i} out of range: the reader has {}",
                    l.len()
                ))
            }),
        }
    }

    /// The reader's output partitions.
    pub fn partitions(&self) -> usize {
        self.properties.partitioning.partition_count()
    }
}

impl DisplayAs for ShuffleReaderExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let mode = match self.mode {
            ReadMode::Partition => "partition from every worker",
            ReadMode::MapOutput => "one sorted run per map task",
        };
        write!(
            f,
            "ShuffleReaderExec: stage={}, partitions={}, {mode}",
            self.stage,
            self.partitions()
        )?;
        if let Some(l) = &self.layout {
            let split: Vec<String> = l
                .iter()
                .filter(|(_, s)| s.index == 0 && !s.is_whole())
                .map(|(p, s)| format!("{p} in {}", s.count))
                .collect();
            if split.is_empty() {
                write!(f, ", skew layout (whole partitions)")?;
            } else {
                write!(f, ", skew split: partition {}", split.join(", "))?;
            }
        }
        Ok(())
    }
}

/// Keep the reader's columns (drop trailing key columns) under the reader's schema.
fn reader_columns(batch: RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    let n = schema.fields().len();
    let cols = batch.columns().get(..n).ok_or_else(|| {
        DataFusionError::Execution(format!(
            "shuffle rows have {} columns, the reader expects at least {n}",
            batch.num_columns()
        ))
    })?;
    Ok(flightshuffle::block::batch_with(
        schema.clone(),
        cols.to_vec(),
        batch.num_rows(),
    )?)
}

impl ExecutionPlan for ShuffleReaderExec {
    fn name(&self) -> &str {
        "ShuffleReaderExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
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
        if children.is_empty() {
            Ok(self)
        } else {
            Err(DataFusionError::Internal(
                "ShuffleReaderExec has no children".into(),
            ))
        }
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let ectx = context
            .session_config()
            .get_extension::<ExchangeContext>()
            .ok_or_else(|| {
                DataFusionError::Execution(
                    "ShuffleReaderExec runs only in a flightshuffle session (no ExchangeContext)"
                        .into(),
                )
            })?;
        let (p, slice) = self.part(partition)?;
        let stream = match self.mode {
            ReadMode::Partition => {
                ectx.reader
                    .read_partition_slice(&ectx.workers(), self.shuffle, p, slice)
            }
            ReadMode::MapOutput => ectx
                .reader
                .read_map_output(&ectx.workers(), self.shuffle, p),
        };
        let schema = self.schema.clone();
        let batches =
            stream.map(move |b| b.map_err(df_err).and_then(|b| reader_columns(b, &schema)));
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            batches,
        )))
    }
}
