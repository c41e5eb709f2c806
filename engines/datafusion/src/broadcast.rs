//! `BroadcastJoins`: a physical optimizer rule, run right after DataFusion's join selection,
//! that turns a hash-exchanged (`Partitioned`) hash join into a broadcast (`CollectLeft`) when
//! its build side is small *relative to its probe side*.
//!
//! DataFusion decides with absolute thresholds (see [`crate::context::BROADCAST_JOIN_BYTES`]).
//! On a cluster the trade is relative: a broadcast sends the build side to every worker,
//! about `build × (W − 1)` bytes over the network plus a hash table built on each worker; a
//! hash exchange moves both sides, about `(build + probe) × (W − 1) / W`. So a 50 MB build
//! side against a 2 GB probe side (TPC-H q05 at SF10) is far cheaper to broadcast, though it
//! is over any fixed threshold. The rule broadcasts when
//! `build × (W − 1) × BROADCAST_RATIO ≤ probe` and the build side is at most
//! [`BROADCAST_MAX_BYTES`] (it is held whole on every worker), by DataFusion's estimates (bytes,
//! or rows times an estimated row width); without estimates it leaves the join alone.
//!
//! A session whose `hash_join_single_partition_threshold` is 0 asks for no broadcasts: the rule
//! then does nothing either. One whose threshold is `usize::MAX` asks for every join as a
//! broadcast (online aggregation's): there a left semi or anti join (`[NOT] EXISTS`) is also
//! turned around, so that the subquery's side is built and the outer query's rows stream. Only join types that never emit build-side rows at their end qualify (the planner would
//! re-plan those `Partitioned` anyway, see [`crate::planner`]). Running before DataFusion's
//! distribution enforcement means the exchanges the new plan needs are planned as usual.

use arrow::datatypes::{DataType, Schema};
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::JoinType;
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;

/// The probe side must be this many times `build × (W − 1)` for a broadcast.
pub const BROADCAST_RATIO: usize = 4;
/// Largest build side (estimated bytes) the rule broadcasts.
pub const BROADCAST_MAX_BYTES: usize = 256 << 20;

/// The physical optimizer rule that plans a hash-exchanged join as a broadcast when
/// its build side is small next to its probe side (see the module docs).
#[derive(Debug)]
pub struct BroadcastJoins {
    workers: usize,
}

impl BroadcastJoins {
    /// The rule for a cluster of `workers` workers.
    pub fn new(workers: usize) -> Self {
        BroadcastJoins { workers }
    }

    /// Whether a join with these estimated input sizes (bytes) is cheaper broadcast.
    pub fn worth_it(&self, build: usize, probe: usize) -> bool {
        let copies = self.workers.saturating_sub(1).max(1);
        build <= BROADCAST_MAX_BYTES
            && build.saturating_mul(copies).saturating_mul(BROADCAST_RATIO) <= probe
    }
}

/// DataFusion's estimate of `plan`'s output in bytes: its byte size, or else its row count
/// times a row width guessed from the schema.
fn estimated_bytes(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let stats = StatisticsContext::new()
        .compute(plan.as_ref(), &StatisticsArgs::new())
        .ok()?;
    if let Some(b) = stats.total_byte_size.get_value() {
        return Some(*b);
    }
    let rows = stats.num_rows.get_value()?;
    Some(rows.saturating_mul(row_width(&plan.schema())))
}

fn row_width(schema: &Schema) -> usize {
    schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => 24,
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView => 24,
            t => t.primitive_width().unwrap_or(16),
        })
        .sum::<usize>()
        .max(1)
}

/// Join types whose build-side rows are all known once the build side is read.
fn probe_only_output(t: &JoinType) -> bool {
    matches!(
        t,
        JoinType::Inner | JoinType::Right | JoinType::RightSemi | JoinType::RightAnti
    )
}

/// A semi or anti join that emits its left side (the outer query of `[NOT] EXISTS`), which a
/// broadcast would have to build on: DataFusion keeps it so when the left side looks smaller.
fn outer_on_the_left(j: &HashJoinExec) -> bool {
    matches!(j.join_type(), JoinType::LeftSemi | JoinType::LeftAnti)
        && !j.null_aware
        && j.join_type().supports_swap()
}

impl PhysicalOptimizerRule for BroadcastJoins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        // A zero broadcast threshold means no broadcasts at all.
        if config.optimizer.hash_join_single_partition_threshold == 0 {
            return Ok(plan);
        }
        // Every join a broadcast (online aggregation's session, see `context`).
        let every = config.optimizer.hash_join_single_partition_threshold == usize::MAX;
        plan.transform_up(|p| {
            let Some(j) = p.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(p));
            };
            if every && outer_on_the_left(j) {
                // The subquery's side becomes the build side: the outer query's rows (the
                // fact table's, online) stream through, each kept or dropped.
                return Ok(Transformed::yes(j.swap_inputs(PartitionMode::CollectLeft)?));
            }
            if *j.partition_mode() != PartitionMode::Partitioned
                || !probe_only_output(j.join_type())
            {
                return Ok(Transformed::no(p));
            }
            let Some((left, right)) = estimated_bytes(j.left()).zip(estimated_bytes(j.right()))
            else {
                return Ok(Transformed::no(p));
            };
            if self.worth_it(left, right) {
                let new = j
                    .builder()
                    .with_partition_mode(PartitionMode::CollectLeft)
                    .reset_state()
                    .build_exec()?;
                Ok(Transformed::yes(new))
            } else if *j.join_type() == JoinType::Inner && self.worth_it(right, left) {
                Ok(Transformed::yes(j.swap_inputs(PartitionMode::CollectLeft)?))
            } else {
                Ok(Transformed::no(p))
            }
        })
        .data()
    }

    fn name(&self) -> &str {
        "flightshuffle_broadcast_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_rule() {
        let two = BroadcastJoins::new(2);
        assert!(two.worth_it(50 << 20, 2 << 30));
        assert!(!two.worth_it(50 << 20, 100 << 20));
        assert!(!two.worth_it(300 << 20, 100 << 30), "over the cap");
        let eight = BroadcastJoins::new(8);
        assert!(!eight.worth_it(50 << 20, 1 << 30), "7 copies x 4 > probe");
        assert!(BroadcastJoins::new(1).worth_it(1, 4));
    }
}
