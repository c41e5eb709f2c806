//! Online aggregation: a broadcast build side read per split, only the rows the split can meet.
//!
//! An online query's fact stage joins each split (sampling unit) of the fact table with the
//! broadcast build sides, stages run to completion before the first split ([`crate::online`]):
//! the first estimate waits for them, and every worker hashes each of them whole. Tables are
//! often stored in the order of the key they join on: TPC-H's `orders` and `lineitem` both by
//! order key, so the `orders` rows one split of `lineitem` can meet are a few pages of
//! `orders`. The pages' key statistics (the Parquet page index, else the row groups') say
//! which.
//!
//! [`apply`] finds a `CollectLeft` join of the fact stage, keyed on a column of the fact
//! table on its probe side and, on its build side, on a column of a Parquet table `T` read by
//! a gathered stage (or by a plan each worker runs in place) that makes each of its rows from
//! one row of `T` (through filters, projections and the probe sides of broadcast joins, or
//! a build side turned into a probe side, [`crate::key_trace`]). It
//! replaces the join by a partitioned one whose build side is that plan reading, in
//! partition i, only the pages of `T` whose key statistics meet split i's key range; the
//! stage is no longer run. Every row of
//! `T` with a key split i holds is among them, so partition i joins exactly as before; the
//! extra rows of those pages meet no row of split i.
//!
//! Applied only where the pages are few: when the ranges together read at most
//! [`MAX_READS`] times `T`'s rows and each at most half of them (a table not stored in key
//! order keeps its stage), to inner, right, right-semi and right-anti joins (the output rows
//! come from the probe side's rows and their matches; a null-aware anti join, `NOT IN`, whose
//! one NULL anywhere in the build side decides, is a left anti join and never taken), not to
//! a join with a limit, a build side with a volatile expression, or keys without an order
//! that Parquet's statistics share ([`crate::build_bounds::ordered`]).

use crate::context::DistributedContext;
use crate::key_trace::{reorient, trace};
use crate::planner::Stage;
use crate::reader::ShuffleReaderExec;
use crate::split::{FactSplit, SplitScanExec};
use crate::writer::WriterKind;
use arrow::array::Array;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinType, NullEquality, ScalarValue};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::DefaultParquetFileReaderFactory;
use datafusion::datasource::physical_plan::{ParquetFileReaderFactory, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use datafusion::parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use datafusion::parquet::file::metadata::PageIndexPolicy;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use futures::{StreamExt, TryStreamExt};
use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

/// The most rows of `T` the splits' ranges may read together, in multiples of `T`'s rows
/// (several splits may read a page on their ranges' edges). Over it, `T` is not stored in
/// the key's order, and its stage stays.
pub const MAX_READS: f64 = 2.0;

/// The most (split, page) pairs compared for one join: a bound on the driver's planning time.
const MAX_COMPARISONS: usize = 50_000_000;

/// Files whose footers are read at once.
const FOOTER_READS: usize = 8;

/// The fact stage's input with every join whose build side could be cut per split cut so,
/// and the stages it no longer reads (their plans are now inside it). `splits` are the fact
/// table's, in the order of the fact scan's partitions; `stages` every other stage of the
/// query.
pub async fn apply(
    ctx: &DistributedContext,
    input: Arc<dyn ExecutionPlan>,
    splits: &[FactSplit],
    stages: &[Stage],
) -> Result<(Arc<dyn ExecutionPlan>, Vec<u32>)> {
    let mut input = input;
    let mut inlined = Vec::new();
    let mut footers = Footers::new(ctx);
    for c in candidates(&input, stages) {
        let Some(parts) = parts(&mut footers, &c, splits).await else {
            continue;
        };
        let table_scan = c
            .table_scan
            .downcast_ref::<DataSourceExec>()
            .ok_or_else(|| DataFusionError::Internal("a table scan is a data source".into()))?;
        let cut: Arc<dyn ExecutionPlan> = Arc::new(
            SplitScanExec::try_grouped(table_scan, parts, true)
                .map_err(|e| DataFusionError::Plan(e.to_string()))?,
        );
        let Some(body) = replace(&c.body, &c.table_scan, &cut)? else {
            continue;
        };
        let join = c
            .join
            .downcast_ref::<HashJoinExec>()
            .ok_or_else(|| DataFusionError::Internal("a candidate is a join".into()))?;
        if body.output_partitioning().partition_count() != splits.len()
            || join.right().output_partitioning().partition_count() != splits.len()
        {
            continue;
        }
        let cut_join = join
            .builder()
            .with_new_children(vec![body, join.right().clone()])?
            .with_partition_mode(PartitionMode::Partitioned)
            .reset_state()
            .build_exec()?;
        // Not found: under a join replaced before (not met: joins come outermost first).
        let Some(replaced) = replace(&input, &c.join, &cut_join)? else {
            continue;
        };
        input = replaced;
        tracing::debug!(stage = ?c.stage, column = %c.table_column, "online: a build side is read per split");
        inlined.extend(c.stage);
        inlined.extend(c.nested);
    }
    Ok((input, inlined))
}

/// `plan` with the node `old` replaced by `new`; None when `old` is not in it.
fn replace(
    plan: &Arc<dyn ExecutionPlan>,
    old: &Arc<dyn ExecutionPlan>,
    new: &Arc<dyn ExecutionPlan>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let out = plan.clone().transform_up(|node| {
        Ok(if Arc::ptr_eq(&node, old) {
            Transformed::yes(new.clone())
        } else {
            Transformed::no(node)
        })
    })?;
    Ok(out.transformed.then_some(out.data))
}

/// How many times `node` sits in `plan` (a node may be shared).
fn occurrences(plan: &Arc<dyn ExecutionPlan>, node: &Arc<dyn ExecutionPlan>) -> usize {
    let mut n = 0;
    let _ = plan.apply(|p| {
        n += usize::from(Arc::ptr_eq(p, node));
        Ok(TreeNodeRecursion::Continue)
    });
    n
}

/// A join of the fact stage whose build side might be cut per split.
struct Candidate {
    /// The `HashJoinExec`.
    join: Arc<dyn ExecutionPlan>,
    /// The gathered stage that is its build side (none: a build side each worker computes
    /// in place), and the plan that computes it (that stage's, below its writer).
    stage: Option<u32>,
    body: Arc<dyn ExecutionPlan>,
    /// The gathered stages `body` now computes itself ([`reorient`]).
    nested: Vec<u32>,
    /// The scan of `T` in `body`, and its key column there.
    table_scan: Arc<dyn ExecutionPlan>,
    table_column: String,
    /// The fact table's key column.
    fact_column: String,
    /// The fact scan (a [`SplitScanExec`]), to read its files' footers.
    fact_scan: Arc<dyn ExecutionPlan>,
}

/// The joins of `input` whose build side is a gathered stage read by nothing else (or
/// computed in place), and whose keys include a column of the fact table on the probe side and of a scanned table on the
/// build side, each row of either side made from one row of its table.
fn candidates(input: &Arc<dyn ExecutionPlan>, stages: &[Stage]) -> Vec<Candidate> {
    let mut readers: HashMap<u32, usize> = HashMap::new();
    for plan in std::iter::once(input).chain(stages.iter().map(|s| s.writer.input())) {
        let _ = plan.apply(|node| {
            if let Some(r) = node.downcast_ref::<ShuffleReaderExec>() {
                *readers.entry(r.stage).or_default() += 1;
            }
            Ok(TreeNodeRecursion::Continue)
        });
    }
    let mut found = Vec::new();
    let _ = input.apply(|node| {
        if let Some(c) = candidate(node, stages, &readers) {
            found.push(c);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

fn candidate(
    node: &Arc<dyn ExecutionPlan>,
    stages: &[Stage],
    readers: &HashMap<u32, usize>,
) -> Option<Candidate> {
    let j = node.downcast_ref::<HashJoinExec>()?;
    let kept = matches!(
        j.join_type(),
        JoinType::Inner | JoinType::Right | JoinType::RightSemi | JoinType::RightAnti
    );
    if *j.partition_mode() != PartitionMode::CollectLeft
        || !kept
        || j.null_equality() != NullEquality::NullEqualsNothing
        || j.null_aware
        || j.fetch().is_some()
    {
        return None;
    }
    let mut left = j.left().clone();
    while let Some(c) = left.downcast_ref::<CoalescePartitionsExec>() {
        if c.fetch().is_some() {
            return None;
        }
        left = c.input().clone();
    }
    // The build side is a gathered stage, or computed in place by each worker.
    let (stage, body) = match left.downcast_ref::<ShuffleReaderExec>() {
        Some(reader) => {
            if reader.layout.is_some() || readers.get(&reader.stage) != Some(&1) {
                return None;
            }
            let stage = stages.iter().find(|s| s.id() == reader.stage)?;
            let read_elsewhere = stages.iter().any(|s| s.inputs.contains(&reader.stage));
            if stage.writer.kind != WriterKind::Gather || read_elsewhere {
                return None;
            }
            (Some(stage.id()), stage.writer.input().clone())
        }
        None => (None, left),
    };
    let (build_schema, probe_schema) = (j.left().schema(), j.right().schema());
    for (l, r) in j.on() {
        let (Some(l), Some(r)) = (l.downcast_ref::<Column>(), r.downcast_ref::<Column>()) else {
            continue;
        };
        let t = build_schema.field(l.index()).data_type();
        if t != probe_schema.field(r.index()).data_type() || !crate::build_bounds::ordered(t) {
            continue;
        }
        let mut nested = Vec::new();
        let Ok(body) = reorient(&body, l.index(), stages, readers, &mut nested) else {
            continue;
        };
        let Some((table_scan, table_column)) = trace(&body, l.index()) else {
            continue;
        };
        let Some((fact_scan, fact_column)) = trace(j.right(), r.index()) else {
            continue;
        };
        // The scan is replaced where it sits, once; a volatile expression (`random()`)
        // would pass an edge page's row for one split and drop it for another.
        if table_scan.downcast_ref::<DataSourceExec>().is_none()
            || fact_scan.downcast_ref::<SplitScanExec>().is_none()
            || occurrences(&body, &table_scan) != 1
            || crate::subtree::volatile(&body)
        {
            continue;
        }
        return Some(Candidate {
            join: node.clone(),
            stage,
            body,
            nested,
            table_scan,
            table_column,
            fact_column,
            fact_scan,
        });
    }
    None
}

/// Row ranges of `T` for each split (`parts[i]`: split i's), or None when the statistics do
/// not say, or say the ranges would read more than [`MAX_READS`] times `T`.
async fn parts(
    footers: &mut Footers<'_>,
    c: &Candidate,
    splits: &[FactSplit],
) -> Option<Vec<Vec<FactSplit>>> {
    let fact = c.fact_scan.downcast_ref::<SplitScanExec>()?.scan();
    let fact = fact.downcast_ref::<DataSourceExec>()?;
    let table = c.table_scan.downcast_ref::<DataSourceExec>()?;
    let (config, _) = table.downcast_to_file_source::<ParquetSource>()?;
    let mut table_files: Vec<(String, u64)> = Vec::new();
    for f in config.file_groups.iter().flat_map(|g| g.iter()) {
        let path = f.path().to_string();
        if !table_files.iter().any(|(p, _)| *p == path) {
            table_files.push((path, f.object_meta.size));
        }
    }
    let mut fact_files: Vec<(String, u64)> = Vec::new();
    for s in splits {
        let path = PartitionedFile::new(s.path.clone(), s.size)
            .path()
            .to_string();
        if !fact_files.iter().any(|(p, _)| *p == path) {
            fact_files.push((path, s.size));
        }
    }
    let fact_meta = footers.load(fact, &fact_files).await?;
    let table_meta = footers.load(table, &table_files).await?;
    let mut fact_pages = HashMap::new();
    for (path, meta) in &fact_meta {
        fact_pages.insert(path.clone(), pages(meta, &c.fact_column)?);
    }
    let mut table_pages = Vec::new();
    let mut table_rows = 0u64;
    for ((path, size), (_, meta)) in table_files.iter().zip(&table_meta) {
        let file_rows = u64::try_from(meta.metadata().file_metadata().num_rows()).ok()?;
        table_rows += file_rows;
        table_pages.push((
            path.clone(),
            *size,
            file_rows,
            pages(meta, &c.table_column)?,
        ));
    }
    let compared = splits.len() * table_pages.iter().map(|t| t.3.len()).sum::<usize>();
    if compared > MAX_COMPARISONS {
        return None;
    }
    let budget = MAX_READS * table_rows as f64;
    let mut read = 0u64;
    let mut out = Vec::with_capacity(splits.len());
    for s in splits {
        let path = PartitionedFile::new(s.path.clone(), s.size)
            .path()
            .to_string();
        let range = key_range(fact_pages.get(&path)?, s.start, s.rows)?;
        let mut part = Vec::new();
        if let Some((lo, hi)) = range {
            for (path, size, file_rows, pages) in &table_pages {
                for (start, rows) in meeting(pages, &lo, &hi) {
                    read += rows;
                    part.push(FactSplit {
                        path: path.clone(),
                        size: *size,
                        file_rows: *file_rows,
                        start,
                        rows,
                    });
                }
            }
        }
        let part_rows: u64 = part.iter().map(|r| r.rows).sum();
        if read as f64 > budget || 2 * part_rows > table_rows {
            return None;
        }
        out.push(part);
    }
    Some(out)
}

/// The key statistics of a run of rows of one file (a data page, or a row group without a
/// page index): rows `start..start + rows` of the file, counted in row-group order.
#[derive(Debug, Clone)]
struct Page {
    start: u64,
    rows: u64,
    /// Bounds of its non-NULL keys; a NULL scalar when unknown.
    min: ScalarValue,
    max: ScalarValue,
    /// NULL keys, when known.
    nulls: Option<u64>,
}

impl Page {
    fn all_null(&self) -> bool {
        self.nulls == Some(self.rows)
    }

    fn known(&self) -> bool {
        !self.min.is_null() && !self.max.is_null()
    }
}

/// The pages of `column` in a file, with their key statistics, in row order; None when the
/// file has no such column.
fn pages(meta: &ArrowReaderMetadata, column: &str) -> Option<Vec<Page>> {
    let md = meta.metadata();
    let conv =
        StatisticsConverter::try_new(column, meta.schema(), md.file_metadata().schema_descr())
            .ok()?;
    conv.parquet_column_index()?;
    let groups = md.row_groups();
    let mut out = Vec::new();
    let mut base = 0u64;
    for (g, group) in groups.iter().enumerate() {
        let rows = u64::try_from(group.num_rows()).ok()?;
        let of_pages = md
            .column_index()
            .zip(md.offset_index())
            .and_then(|(ci, oi)| {
                let at = [g];
                let mins = conv.data_page_mins(ci, oi, &at).ok()?;
                let maxes = conv.data_page_maxes(ci, oi, &at).ok()?;
                let nulls = conv.data_page_null_counts(ci, oi, &at).ok()?;
                let counts = conv.data_page_row_counts(oi, groups, &at).ok()??;
                let mut start = base;
                let mut found = Vec::with_capacity(counts.len());
                for k in 0..counts.len() {
                    let n = counts.is_valid(k).then(|| counts.value(k))?;
                    found.push(Page {
                        start,
                        rows: n,
                        min: ScalarValue::try_from_array(&mins, k).ok()?,
                        max: ScalarValue::try_from_array(&maxes, k).ok()?,
                        nulls: nulls.is_valid(k).then(|| nulls.value(k)),
                    });
                    start += n;
                }
                (start == base + rows).then_some(found)
            });
        match of_pages {
            Some(p) => out.extend(p),
            None => {
                let one = || std::iter::once(group);
                let nulls = conv.row_group_null_counts(one()).ok()?;
                out.push(Page {
                    start: base,
                    rows,
                    min: ScalarValue::try_from_array(&conv.row_group_mins(one()).ok()?, 0).ok()?,
                    max: ScalarValue::try_from_array(&conv.row_group_maxes(one()).ok()?, 0).ok()?,
                    nulls: nulls.is_valid(0).then(|| nulls.value(0)),
                });
            }
        }
        base += rows;
    }
    Some(out)
}

/// The key range of rows `start..start + rows` by the pages they touch: `Some(None)` when
/// every key there is NULL; None when a page's statistics are missing or do not compare.
fn key_range(pages: &[Page], start: u64, rows: u64) -> Option<Option<(ScalarValue, ScalarValue)>> {
    let end = start.checked_add(rows)?;
    let mut range: Option<(ScalarValue, ScalarValue)> = None;
    for p in pages
        .iter()
        .filter(|p| p.start < end && p.start + p.rows > start)
    {
        if p.all_null() {
            continue;
        }
        if !p.known() {
            return None;
        }
        range = Some(match range {
            None => (p.min.clone(), p.max.clone()),
            Some((lo, hi)) => {
                let lo = match lo.partial_cmp(&p.min)? {
                    Ordering::Greater => p.min.clone(),
                    _ => lo,
                };
                let hi = match hi.partial_cmp(&p.max)? {
                    Ordering::Less => p.max.clone(),
                    _ => hi,
                };
                (lo, hi)
            }
        });
    }
    Some(range)
}

/// The row ranges of the pages that may hold a key in `lo..=hi` (those without statistics
/// included), adjacent pages merged.
fn meeting(pages: &[Page], lo: &ScalarValue, hi: &ScalarValue) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for p in pages {
        if p.all_null() {
            continue;
        }
        let outside = p.known()
            && (matches!(p.max.partial_cmp(lo), Some(Ordering::Less))
                || matches!(p.min.partial_cmp(hi), Some(Ordering::Greater)));
        if outside {
            continue;
        }
        match out.last_mut() {
            Some((start, rows)) if *start + *rows == p.start => *rows += p.rows,
            _ => out.push((p.start, p.rows)),
        }
    }
    out
}

/// Footers (with page indexes) read once per planning, through the scans' own readers.
struct Footers<'a> {
    ctx: &'a DistributedContext,
    /// By object store and path.
    read: HashMap<(String, String), Arc<ArrowReaderMetadata>>,
}

impl<'a> Footers<'a> {
    fn new(ctx: &'a DistributedContext) -> Self {
        Footers {
            ctx,
            read: HashMap::new(),
        }
    }

    /// The footers of `files` (path, size) as `scan` reads them, in order; None when one
    /// cannot be read in time (the rewrite is then left out: the scan itself reports it).
    async fn load(
        &mut self,
        scan: &DataSourceExec,
        files: &[(String, u64)],
    ) -> Option<Vec<(String, Arc<ArrowReaderMetadata>)>> {
        let (config, source) = scan.downcast_to_file_source::<ParquetSource>()?;
        let factory: Arc<dyn ParquetFileReaderFactory> = match source.parquet_file_reader_factory()
        {
            Some(f) => f.clone(),
            None => {
                let store = self
                    .ctx
                    .session()
                    .runtime_env()
                    .object_store(&config.object_store_url)
                    .ok()?;
                Arc::new(DefaultParquetFileReaderFactory::new(store))
            }
        };
        let timeout = self.ctx.driver().config().rpc_timeout;
        let store = config.object_store_url.to_string();
        let key = |p: &String| (store.clone(), p.clone());
        let missing: Vec<(String, u64)> = files
            .iter()
            .filter(|(p, _)| !self.read.contains_key(&key(p)))
            .cloned()
            .collect();
        let loaded: Vec<(String, Arc<ArrowReaderMetadata>)> = futures::stream::iter(missing)
            .map(|(path, size)| {
                let factory = factory.clone();
                async move {
                    let file = PartitionedFile::new(path.clone(), size);
                    let metrics = ExecutionPlanMetricsSet::new();
                    let mut reader = factory.create_reader(0, file, None, &metrics)?;
                    let options =
                        ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
                    let footer = tokio::time::timeout(timeout, reader.get_metadata(Some(&options)))
                        .await
                        .map_err(|_| {
                            DataFusionError::Execution(format!("footer of {path}: timed out"))
                        })??;
                    let meta = ArrowReaderMetadata::try_new(footer, options)?;
                    Ok::<_, DataFusionError>((path, Arc::new(meta)))
                }
            })
            .buffer_unordered(FOOTER_READS)
            .try_collect()
            .await
            .map_err(|e| tracing::debug!(error = %e, "online: footers not read"))
            .ok()?;
        self.read
            .extend(loaded.into_iter().map(|(p, m)| (key(&p), m)));
        files
            .iter()
            .map(|(p, _)| Some((p.clone(), self.read.get(&key(p))?.clone())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(start: u64, rows: u64, min: i64, max: i64) -> Page {
        Page {
            start,
            rows,
            min: ScalarValue::Int64(Some(min)),
            max: ScalarValue::Int64(Some(max)),
            nulls: Some(0),
        }
    }

    fn int(v: i64) -> ScalarValue {
        ScalarValue::Int64(Some(v))
    }

    #[test]
    fn a_range_covers_the_pages_its_rows_touch() {
        let pages = vec![page(0, 10, 1, 5), page(10, 10, 6, 9), page(20, 10, 10, 30)];
        assert_eq!(key_range(&pages, 0, 10), Some(Some((int(1), int(5)))));
        assert_eq!(key_range(&pages, 5, 10), Some(Some((int(1), int(9)))));
        assert_eq!(key_range(&pages, 19, 2), Some(Some((int(6), int(30)))));
        // All-NULL pages add nothing; a page without statistics makes the range unknown.
        let mut nulls = page(30, 10, 0, 0);
        nulls.nulls = Some(10);
        nulls.min = ScalarValue::Int64(None);
        nulls.max = ScalarValue::Int64(None);
        let with_nulls = [pages.clone(), vec![nulls.clone()]].concat();
        assert_eq!(key_range(&with_nulls, 30, 10), Some(None));
        assert_eq!(
            key_range(&with_nulls, 25, 10),
            Some(Some((int(10), int(30))))
        );
        nulls.nulls = None;
        let unknown = [pages, vec![nulls]].concat();
        assert_eq!(key_range(&unknown, 25, 10), None);
    }

    /// Pages of `keys`, `per` rows each, with their statistics.
    fn pages_of(keys: &[Option<i64>], per: usize) -> Vec<Page> {
        keys.chunks(per)
            .enumerate()
            .map(|(i, c)| {
                let present: Vec<i64> = c.iter().flatten().copied().collect();
                Page {
                    start: (i * per) as u64,
                    rows: c.len() as u64,
                    min: ScalarValue::Int64(present.iter().min().copied()),
                    max: ScalarValue::Int64(present.iter().max().copied()),
                    nulls: Some((c.len() - present.len()) as u64),
                }
            })
            .collect()
    }

    proptest::proptest! {
        /// Every row of the build table whose key a split's rows hold is in the pages that
        /// meet the split's key range, whatever the order of either table.
        #[test]
        fn no_build_row_a_split_meets_is_left_out(
            fact in proptest::collection::vec(proptest::option::weighted(0.9, 0i64..60), 1..300),
            build in proptest::collection::vec(proptest::option::weighted(0.9, 0i64..60), 1..200),
            sorted in proptest::bool::ANY,
            fact_page in 1usize..20,
            build_page in 1usize..20,
            cut in (0usize..300, 1usize..300),
        ) {
            let mut fact = fact;
            if sorted {
                fact.sort();
            }
            let start = cut.0 % fact.len();
            let rows = cut.1.min(fact.len() - start).max(1);
            let held: std::collections::HashSet<i64> =
                fact[start..start + rows].iter().flatten().copied().collect();
            let range = key_range(&pages_of(&fact, fact_page), start as u64, rows as u64);
            let Some(range) = range else {
                return Err(proptest::test_runner::TestCaseError::fail("known statistics"));
            };
            let Some((lo, hi)) = range else {
                proptest::prop_assert!(held.is_empty());
                return Ok(());
            };
            let read = meeting(&pages_of(&build, build_page), &lo, &hi);
            for (j, key) in build.iter().enumerate() {
                if key.is_some_and(|k| held.contains(&k)) {
                    let j = j as u64;
                    proptest::prop_assert!(
                        read.iter().any(|(s, n)| *s <= j && j < s + n),
                        "build row {} (key {:?}) left out of {:?}", j, key, read
                    );
                }
            }
            // The ranges are disjoint and in order.
            for w in read.windows(2) {
                proptest::prop_assert!(w[0].0 + w[0].1 < w[1].0);
            }
        }
    }

    #[test]
    fn the_pages_meeting_a_range_include_its_edges_and_unknown_pages() {
        let mut pages = vec![
            page(0, 10, 1, 5),
            page(10, 10, 6, 9),
            page(20, 10, 10, 30),
            page(30, 10, 31, 40),
        ];
        assert_eq!(meeting(&pages, &int(5), &int(6)), vec![(0, 20)]);
        assert_eq!(meeting(&pages, &int(10), &int(10)), vec![(20, 10)]);
        assert_eq!(meeting(&pages, &int(41), &int(50)), vec![]);
        pages[1].max = ScalarValue::Int64(None);
        assert_eq!(
            meeting(&pages, &int(31), &int(31)),
            vec![(10, 10), (30, 10)]
        );
    }
}
