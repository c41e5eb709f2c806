//! Skew splits of join probe sides (Spark AQE's skew join, per stage).
//!
//! A hash exchange sends every row of a key to one reduce partition; a key holding a large
//! share of the rows makes that partition, and the one task that joins it, far larger than
//! the others. When a stage's partition p is the probe side of a join that emits each probe
//! row on its own (inner, right, right semi/anti/mark: DataFusion builds the left side and
//! probes with the right), p can be split: each of k tasks reads one slice of p's blocks
//! ([`flightshuffle::block::Slice`]) and joins it with the *whole* build partition p, which every
//! split reads. The union of the splits' outputs is the join's output, and no key is split on
//! the build side, so the result is exact.
//!
//! Which stages can split ([`candidate`]): from the stage's root down, only nodes that work
//! row by row or batch by batch (projection, filter, partial aggregation,
//! a partition-preserving sort) and joins entered on their probe side; the path ends at a
//! partition reader, and every other partition-dependent leaf of the stage is a partition
//! reader of the same width. A final aggregate or a join entered on its build side stops the
//! search: they need all of a partition in one task. Sorted-run stages never split.
//!
//! The decision needs the probe producer's partition sizes, so a stage that can split starts
//! once that producer is sealed (see `flightshuffle::scheduler::Deferred`) instead of pipelining
//! with it; splits are then made where a partition is over `factor` × the median and over
//! `min_bytes` ([`decide`]). A factor of 3 suits, not Spark's 5: a stage has only two
//! partitions per worker here, so the median is a large share of the total (one key on half
//! the rows of 4 partitions is exactly 5× the median). Splits are off by default
//! (`SET flightshuffle.skew_factor = 3` turns them on): the deferral costs the stage its
//! pipelining, and on 2 cores that cost more than the balance won (`flightshuffle skew-bench`).

use crate::reader::{Layout, ReadMode, ShuffleReaderExec};
use crate::writer::{ShuffleWriterExec, WriterKind};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::JoinType;
use datafusion::error::Result;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use flightshuffle::block::Slice;
use flightshuffle::ShuffleId;
use std::sync::Arc;

/// When a partition is skewed.
#[derive(Debug, Clone, Copy)]
pub struct SkewConfig {
    /// A partition over this many times the median partition is skewed (0: never split).
    pub factor: f64,
    /// ... and only if it is over this many bytes.
    pub min_bytes: u64,
    /// At most this many splits of one partition.
    pub max_splits: u32,
}

impl SkewConfig {
    /// Whether skewed partitions are split at all (`factor` above 0).
    pub fn enabled(&self) -> bool {
        self.factor > 0.0
    }
}

/// The stage a skew split of this stage would read in slices: (its stage id, its shuffle).
pub fn candidate(writer: &ShuffleWriterExec) -> Option<(u32, ShuffleId)> {
    if writer.kind == WriterKind::Merge {
        return None;
    }
    let width = writer.tasks();
    if width < 2 {
        return None;
    }
    let probe = probe_reader(writer.input())?;
    let (shuffle, stage) = (probe.shuffle, probe.stage);
    // Every partition-dependent leaf is a partition reader of the stage's width, and the
    // probe producer is read once (else its other reader would be sliced too).
    let mut readers_of_probe = 0;
    let mut ok = true;
    visit_partitioned_leaves(writer.input(), &mut |leaf| match leaf
        .downcast_ref::<ShuffleReaderExec>()
    {
        Some(r) if r.mode == ReadMode::Partition && r.partitions() == width => {
            readers_of_probe += usize::from(r.shuffle == shuffle);
        }
        _ => ok = false,
    });
    (ok && readers_of_probe == 1).then_some((stage, shuffle))
}

/// Follow the probe path from `plan` down to a partition reader (see module doc).
fn probe_reader(plan: &Arc<dyn ExecutionPlan>) -> Option<&ShuffleReaderExec> {
    let splits_rows = |t: &JoinType| {
        matches!(
            t,
            JoinType::Inner
                | JoinType::Right
                | JoinType::RightSemi
                | JoinType::RightAnti
                | JoinType::RightMark
        )
    };
    let p = plan.as_ref();
    if let Some(r) = p.downcast_ref::<ShuffleReaderExec>() {
        return (r.mode == ReadMode::Partition).then_some(r);
    }
    let next = if let Some(j) = p.downcast_ref::<HashJoinExec>() {
        let modes = matches!(
            j.partition_mode(),
            PartitionMode::Partitioned | PartitionMode::CollectLeft
        );
        (modes && splits_rows(j.join_type())).then(|| j.right())
    } else if let Some(j) = p.downcast_ref::<NestedLoopJoinExec>() {
        splits_rows(j.join_type()).then(|| j.right())
    } else if let Some(j) = p.downcast_ref::<CrossJoinExec>() {
        Some(j.right())
    } else if let Some(a) = p.downcast_ref::<AggregateExec>() {
        (*a.mode() == AggregateMode::Partial).then(|| a.input())
    } else if let Some(s) = p.downcast_ref::<SortExec>() {
        s.preserve_partitioning().then(|| s.input())
    } else if p.downcast_ref::<ProjectionExec>().is_some()
        || p.downcast_ref::<FilterExec>().is_some()
    {
        p.children().first().copied()
    } else {
        None
    };
    probe_reader(next?)
}

/// Call `f` on every leaf whose partitions are the stage's (not below a gather or a merge,
/// whose input is read whole).
fn visit_partitioned_leaves(plan: &Arc<dyn ExecutionPlan>, f: &mut dyn FnMut(&dyn ExecutionPlan)) {
    let p = plan.as_ref();
    if p.downcast_ref::<CoalescePartitionsExec>().is_some()
        || p.downcast_ref::<SortPreservingMergeExec>().is_some()
    {
        return;
    }
    let children = p.children();
    if children.is_empty() {
        f(p);
    }
    for c in children {
        visit_partitioned_leaves(c, f);
    }
}

/// The layout of a split from the probe producer's partition sizes, or `None` when no
/// partition is skewed; with a note for the report.
pub fn decide(bytes: &[u64], cfg: &SkewConfig) -> Option<(Vec<(u32, Slice)>, String)> {
    if !cfg.enabled() || bytes.len() < 2 {
        return None;
    }
    let mut sorted = bytes.to_vec();
    sorted.sort_unstable();
    let median = sorted[sorted.len() / 2].max(1);
    let threshold = (cfg.factor * median as f64).max(cfg.min_bytes as f64);
    let target = median.max(cfg.min_bytes).max(1);
    let mut layout = Vec::new();
    let mut notes = Vec::new();
    for (p, &b) in bytes.iter().enumerate() {
        let p = p as u32;
        let k = if (b as f64) > threshold {
            b.div_ceil(target).clamp(2, cfg.max_splits.max(2) as u64) as u32
        } else {
            1
        };
        if k > 1 {
            notes.push(format!("partition {p} ({b} bytes) in {k}"));
        }
        layout.extend((0..k).map(|i| (p, Slice { index: i, count: k })));
    }
    if notes.is_empty() {
        return None;
    }
    let note = format!(
        "skew split of the probe side (median partition {median} bytes): {}",
        notes.join(", ")
    );
    Some((layout, note))
}

/// The stage's writer with its partitions laid out by `layout`: the probe producer's reader
/// reads slices, every other partition reader reads the whole partition each split needs.
pub fn apply(
    writer: &Arc<ShuffleWriterExec>,
    probe: ShuffleId,
    layout: &[(u32, Slice)],
) -> Result<Arc<ShuffleWriterExec>> {
    let sliced: Layout = Arc::new(layout.to_vec());
    let whole: Layout = Arc::new(layout.iter().map(|(p, _)| (*p, Slice::WHOLE)).collect());
    let width = writer.tasks();
    // A reader under a gather or a merge is read whole by every partition (a build side):
    // laid out, a split partition would be read once per split.
    let mut gathered = std::collections::HashSet::new();
    let mut todo = vec![writer.input().clone()];
    while let Some(p) = todo.pop() {
        let gathers = p.downcast_ref::<CoalescePartitionsExec>().is_some()
            || p.downcast_ref::<SortPreservingMergeExec>().is_some();
        for c in p.children() {
            if gathers {
                gathered.insert(Arc::as_ptr(c) as *const () as usize);
            }
            todo.push(c.clone());
        }
    }
    let input = writer.input().clone().transform_up(|node| {
        let Some(r) = node.downcast_ref::<ShuffleReaderExec>() else {
            return Ok(Transformed::no(node));
        };
        let under_gather = gathered.contains(&(Arc::as_ptr(&node) as *const () as usize));
        if r.mode != ReadMode::Partition || r.partitions() != width || under_gather {
            return Ok(Transformed::no(node));
        }
        let layout = if r.shuffle == probe { &sliced } else { &whole };
        Ok(Transformed::yes(
            Arc::new(r.with_layout(layout.clone())?) as Arc<dyn ExecutionPlan>
        ))
    })?;
    let input = input.data;
    debug_assert_eq!(input.output_partitioning().partition_count(), layout.len());
    Ok(Arc::new(writer.with_input(input)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SkewConfig {
        SkewConfig {
            factor: 5.0,
            min_bytes: 100,
            max_splits: 8,
        }
    }

    #[test]
    fn only_partitions_far_above_the_median_and_the_floor_split() {
        assert!(
            decide(&[10, 10, 10, 49], &cfg()).is_none(),
            "under 5x median"
        );
        assert!(decide(&[1, 1, 1, 90], &cfg()).is_none(), "under min_bytes");
        let (layout, note) = decide(&[100, 100, 100, 1000], &cfg()).unwrap();
        // 1000 bytes at a target of 100 per split, capped at 8.
        assert_eq!(layout.len(), 3 + 8);
        assert!(layout[3..].iter().all(|(p, s)| *p == 3 && s.count == 8));
        assert!(note.contains("partition 3"));
        let off = SkewConfig {
            factor: 0.0,
            ..cfg()
        };
        assert!(decide(&[100, 100, 100, 1000], &off).is_none());
    }
}
