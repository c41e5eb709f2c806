//! `ShuffleWriterExec`: the root of a producing stage. Executing partition i runs the stage's
//! partition i; the worker's map task then partitions those rows into the stage's shuffle.
//! For a hash exchange the exchange hashes the named key columns: plain columns of the input,
//! or key expressions the planner evaluated into trailing `__fs_key_<k>` columns (which
//! readers strip).

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use flightshuffle::strategy::Strategy;
use flightshuffle::{partitioner, proto, ShuffleId};
use std::fmt;
use std::sync::Arc;

/// Prefix of the key columns a hash exchange appends to its rows.
pub const KEY_PREFIX: &str = "__fs_key_";

/// How a stage's rows are spread over its shuffle's partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriterKind {
    /// Hash of the key columns into R partitions (a hash repartition boundary).
    Hash = 0,
    /// Dealt in turn into R partitions (a round-robin repartition boundary).
    RoundRobin = 1,
    /// Everything into one partition, read whole by one consumer (coalesce / broadcast).
    Gather = 2,
    /// One partition; consumers read each map task's sorted output apart (sort-preserving merge).
    Merge = 3,
}

impl WriterKind {
    /// The kind with this number (its protobuf encoding), if any.
    pub fn from_u32(v: u32) -> Option<Self> {
        [Self::Hash, Self::RoundRobin, Self::Gather, Self::Merge]
            .into_iter()
            .find(|k| *k as u32 == v)
    }
}

/// The root of a producing stage: its rows go into the stage's shuffle.
#[derive(Debug)]
pub struct ShuffleWriterExec {
    input: Arc<dyn ExecutionPlan>,
    /// The stage this writer is the root of (stage ids start at 1).
    pub stage: u32,
    /// The shuffle the stage's map tasks write.
    pub shuffle: ShuffleId,
    /// How the rows are spread over the shuffle's partitions.
    pub kind: WriterKind,
    /// Reduce partitions of the shuffle.
    pub partitions: u32,
    /// Key columns a hash exchange hashes (input columns or appended `__fs_key_<k>` ones).
    pub keys: Vec<String>,
    /// How this exchange moves its blocks (a per-exchange setting).
    pub strategy: Strategy,
}

impl ShuffleWriterExec {
    /// A writer of `input`'s rows into `shuffle`, with the pull strategy.
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        stage: u32,
        shuffle: ShuffleId,
        kind: WriterKind,
        partitions: u32,
        keys: Vec<String>,
    ) -> Self {
        ShuffleWriterExec {
            input,
            stage,
            shuffle,
            kind,
            partitions,
            keys,
            strategy: Strategy::Pull,
        }
    }

    /// The same writer with another exchange strategy.
    pub fn with_strategy(&self, strategy: Strategy) -> Self {
        ShuffleWriterExec {
            input: self.input.clone(),
            keys: self.keys.clone(),
            strategy,
            ..*self
        }
    }

    /// This writer over another input (same stage, shuffle and strategy).
    pub fn with_input(&self, input: Arc<dyn ExecutionPlan>) -> Self {
        ShuffleWriterExec {
            input,
            keys: self.keys.clone(),
            ..*self
        }
    }

    /// The stage plan under the writer.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// Partitions of the stage plan (its input's partitions).
    pub fn tasks(&self) -> usize {
        self.input.properties().partitioning.partition_count()
    }

    /// The stage's map tasks on a cluster of `workers`: the partitions each task runs. One
    /// task per worker (partition p in task p mod W), so a stage costs one task call and one
    /// commit per worker; a sorted-run exchange keeps one task per partition, because its
    /// readers merge each map output as one sorted run.
    pub fn task_groups(&self, workers: usize) -> Vec<Vec<u32>> {
        let partitions = self.tasks() as u32;
        if self.kind == WriterKind::Merge {
            return (0..partitions).map(|p| vec![p]).collect();
        }
        let groups = (workers.max(1) as u32).min(partitions);
        (0..groups)
            .map(|g| (g..partitions).step_by(groups as usize).collect())
            .collect()
    }

    /// The shuffle's partitioner: hash of `keys` for a hash exchange, else round-robin.
    pub fn partitioner(&self) -> proto::Partitioner {
        match self.kind {
            WriterKind::Hash => {
                partitioner::hash(&self.keys.iter().map(|s| s.as_str()).collect::<Vec<_>>())
            }
            _ => partitioner::round_robin(),
        }
    }

    /// How the exchange spreads its rows, e.g. `hash(a, b) into 8`.
    pub fn describe(&self) -> String {
        match self.kind {
            WriterKind::Hash => format!("hash({}) into {}", self.keys.join(", "), self.partitions),
            WriterKind::RoundRobin => format!("round-robin into {}", self.partitions),
            WriterKind::Gather => "gather into 1".to_string(),
            WriterKind::Merge => "sorted runs into 1 (merged by the reader)".to_string(),
        }
    }
}

impl DisplayAs for ShuffleWriterExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ShuffleWriterExec: stage={}, {}, partitions={}, strategy={}",
            self.stage,
            self.describe(),
            self.tasks(),
            self.strategy
        )
    }
}

impl ExecutionPlan for ShuffleWriterExec {
    fn name(&self) -> &str {
        "ShuffleWriterExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
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
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = children.swap_remove(0);
        Ok(Arc::new(
            ShuffleWriterExec::new(
                input,
                self.stage,
                self.shuffle,
                self.kind,
                self.partitions,
                self.keys.clone(),
            )
            .with_strategy(self.strategy),
        ))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        self.input.execute(partition, context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_plan::empty::EmptyExec;
    use datafusion::physical_plan::repartition::RepartitionExec;
    use datafusion::physical_plan::Partitioning;

    fn writer(kind: WriterKind, partitions: usize) -> ShuffleWriterExec {
        let schema = Arc::new(arrow::datatypes::Schema::empty());
        let input = Arc::new(
            RepartitionExec::try_new(
                Arc::new(EmptyExec::new(schema)),
                Partitioning::RoundRobinBatch(partitions),
            )
            .unwrap(),
        );
        ShuffleWriterExec::new(input, 1, ShuffleId::random(), kind, 4, vec![])
    }

    #[test]
    fn one_task_per_worker_except_sorted_runs() {
        let w = writer(WriterKind::Hash, 4);
        assert_eq!(w.task_groups(2), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(w.task_groups(3), vec![vec![0, 3], vec![1], vec![2]]);
        assert_eq!(w.task_groups(1), vec![vec![0, 1, 2, 3]]);
        assert_eq!(w.task_groups(8).len(), 4, "no empty task on a spare worker");
        let merge = writer(WriterKind::Merge, 4);
        assert_eq!(
            merge.task_groups(2),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
    }
}
