//! The fact table of an online query cut into splits ([`FactSplit`]: rows of one Parquet
//! file) and the scan that reads exactly them ([`SplitScanExec`]), a plan node the codec sends
//! to workers. The same scan reads a build side cut per split ([`crate::unit_builds`]): its
//! partition i reads several row ranges, of one file or more.

use crate::{Error, Result};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetRowSelection;
use datafusion::datasource::physical_plan::{
    FileGroup, FileScanConfigBuilder, ParquetFileReaderFactory, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::DataFusionError;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::parquet::arrow::arrow_reader::ArrowReaderOptions;
use datafusion::parquet::arrow::arrow_reader::{RowSelection, RowSelector};
use datafusion::parquet::arrow::async_reader::AsyncFileReader;
use datafusion::parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::future::BoxFuture;
use std::fmt;
use std::sync::Arc;

/// One split of the fact table: rows `start..start + rows` of one Parquet file, counted over
/// the whole file in row-group order.
#[derive(Clone, PartialEq, prost::Message)]
pub struct FactSplit {
    /// The Parquet file's path.
    #[prost(string, tag = "1")]
    pub path: String,
    /// The file's size in bytes.
    #[prost(uint64, tag = "2")]
    pub size: u64,
    /// Rows in the whole file.
    #[prost(uint64, tag = "3")]
    pub file_rows: u64,
    /// The split's first row, counted over the whole file in row-group order.
    #[prost(uint64, tag = "4")]
    pub start: u64,
    /// Rows in the split.
    #[prost(uint64, tag = "5")]
    pub rows: u64,
}

pub(crate) fn plan_err(what: impl fmt::Display) -> Error {
    Error::DataFusion(DataFusionError::Plan(format!("online aggregation: {what}")))
}

/// A Parquet scan whose partition i reads the row ranges of part i only (split i of the fact
/// table, or the rows of a build side that split i can meet). It wraps the `DataSourceExec`
/// that does the reading because `datafusion-proto` does not carry a file's row selection:
/// the parts travel beside the scan and are attached again where the plan is decoded.
#[derive(Debug)]
pub struct SplitScanExec {
    scan: Arc<DataSourceExec>,
    /// The row ranges output partition i reads: `parts[i]`.
    pub parts: Arc<Vec<Vec<FactSplit>>>,
    /// Whether the parts are a build side's rows each split can meet
    /// ([`crate::unit_builds`]), not the fact table's splits.
    pub build: bool,
}

impl SplitScanExec {
    /// `template` (a Parquet scan of the split files) reading one split per partition.
    pub fn try_new(template: &DataSourceExec, splits: Vec<FactSplit>) -> Result<Self> {
        let parts = splits.into_iter().map(|s| vec![s]).collect();
        Self::try_grouped(template, parts, false)
    }

    /// `template` (a Parquet scan of the parts' files) reading part i's row ranges (none, or
    /// disjoint ones) in partition i; `build`: they are a build side's rows each split can
    /// meet.
    pub fn try_grouped(
        template: &DataSourceExec,
        parts: Vec<Vec<FactSplit>>,
        build: bool,
    ) -> Result<Self> {
        let (config, source) = template
            .downcast_to_file_source::<ParquetSource>()
            .ok_or_else(|| plan_err("the scan of a table read in splits is not a Parquet scan"))?;
        let groups = parts
            .iter()
            .map(|ranges| Ok(FileGroup::new(ranges_files(ranges)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut builder = FileScanConfigBuilder::from(config.clone()).with_file_groups(groups);
        if let Some(factory) = source.parquet_file_reader_factory() {
            let source = source
                .clone()
                .with_parquet_file_reader_factory(Arc::new(WithPageIndex(factory.clone())));
            builder = builder.with_source(Arc::new(source));
        }
        let config = builder.build();
        Ok(SplitScanExec {
            scan: DataSourceExec::from_data_source(config),
            parts: Arc::new(parts),
            build,
        })
    }

    /// The wrapped scan (to encode it).
    pub fn scan(&self) -> Arc<dyn ExecutionPlan> {
        self.scan.clone()
    }
}

/// Opens a split's file with its page index, whatever the scan's predicate. DataFusion loads
/// the page index only where a predicate could prune pages; without its offset index the
/// reader cannot go straight to a split's pages, and every split of a row group fetched and
/// decompressed the column chunks up to its rows (online TPC-H Q1 at SF1: about 2 ms a split).
#[derive(Debug)]
struct WithPageIndex(Arc<dyn ParquetFileReaderFactory>);

impl ParquetFileReaderFactory for WithPageIndex {
    fn create_reader(
        &self,
        partition_index: usize,
        file: PartitionedFile,
        metadata_size_hint: Option<usize>,
        metrics: &ExecutionPlanMetricsSet,
    ) -> datafusion::error::Result<Box<dyn AsyncFileReader + Send>> {
        let inner = self
            .0
            .create_reader(partition_index, file, metadata_size_hint, metrics)?;
        Ok(Box::new(PageIndexReader(inner)))
    }
}

/// A file reader whose metadata includes the page index when the file has one.
struct PageIndexReader(Box<dyn AsyncFileReader + Send>);

impl AsyncFileReader for PageIndexReader {
    fn get_bytes(
        &mut self,
        range: std::ops::Range<u64>,
    ) -> BoxFuture<'_, datafusion::parquet::errors::Result<bytes::Bytes>> {
        self.0.get_bytes(range)
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<std::ops::Range<u64>>,
    ) -> BoxFuture<'_, datafusion::parquet::errors::Result<Vec<bytes::Bytes>>> {
        self.0.get_byte_ranges(ranges)
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, datafusion::parquet::errors::Result<Arc<ParquetMetaData>>> {
        let options = options
            .cloned()
            .unwrap_or_default()
            .with_page_index_policy(PageIndexPolicy::Optional);
        Box::pin(async move { self.0.get_metadata(Some(&options)).await })
    }
}

/// Row ranges as files of a scan: one per file (in the order the files first appear), each
/// the whole file with a row selection of its ranges, which must be disjoint.
fn ranges_files(ranges: &[FactSplit]) -> Result<Vec<PartitionedFile>> {
    let mut paths: Vec<&str> = Vec::new();
    for r in ranges {
        if !paths.contains(&r.path.as_str()) {
            paths.push(&r.path);
        }
    }
    paths
        .into_iter()
        .map(|p| {
            let of_file: Vec<FactSplit> = ranges.iter().filter(|r| r.path == p).cloned().collect();
            file_ranges(&of_file)
        })
        .collect()
}

/// Ranges of one file (a split: one range) as that file with a row selection of them.
fn file_ranges(ranges: &[FactSplit]) -> Result<PartitionedFile> {
    let Some(first) = ranges.first() else {
        return Err(plan_err("a file read with no row ranges"));
    };
    let mut sorted = ranges.to_vec();
    sorted.sort_by_key(|r| r.start);
    let mut selectors = Vec::with_capacity(2 * sorted.len() + 1);
    let mut at = 0u64;
    for s in &sorted {
        let end = s.start.checked_add(s.rows).filter(|&e| e <= s.file_rows);
        let Some(end) = end else {
            return Err(plan_err(format!(
                "split rows {}+{} are outside the {} rows of {}",
                s.start, s.rows, s.file_rows, s.path
            )));
        };
        if s.start < at || s.file_rows != first.file_rows || s.size != first.size {
            return Err(plan_err(format!(
                "row ranges of {} overlap or disagree on the file",
                s.path
            )));
        }
        selectors.push(RowSelector::skip((s.start - at) as usize));
        selectors.push(RowSelector::select(s.rows as usize));
        at = end;
    }
    selectors.push(RowSelector::skip((first.file_rows - at) as usize));
    selectors.retain(|r| r.row_count > 0);
    let selection = ParquetRowSelection::new(RowSelection::from(selectors));
    Ok(PartitionedFile::new(first.path.clone(), first.size).with_extension(selection))
}

impl DisplayAs for SplitScanExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let rows: u64 = self.parts.iter().flatten().map(|r| r.rows).sum();
        let n = self.parts.len();
        if self.build {
            let ranges: usize = self.parts.iter().map(Vec::len).sum();
            write!(
                f,
                "SplitScanExec: {n} parts (the rows each split can meet), {rows} rows in \
                 {ranges} row ranges, "
            )?;
        } else {
            write!(f, "SplitScanExec: {n} splits of {rows} rows, ")?;
        }
        self.scan.fmt_as(t, f)
    }
}

impl ExecutionPlan for SplitScanExec {
    fn name(&self) -> &str {
        "SplitScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.scan.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> datafusion::error::Result<TreeNodeRecursion>,
    ) -> datafusion::error::Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> datafusion::error::Result<SendableRecordBatchStream> {
        self.scan.execute(partition, context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(start: u64, rows: u64, file_rows: u64) -> FactSplit {
        FactSplit {
            path: "/data/t/part-0.parquet".into(),
            size: 100,
            file_rows,
            start,
            rows,
        }
    }

    #[test]
    fn a_split_selects_exactly_its_rows_of_the_whole_file() {
        for (start, rows, file_rows) in [(0, 10, 10), (0, 3, 10), (7, 3, 10), (4, 2, 10)] {
            let f = file_ranges(&[split(start, rows, file_rows)]).unwrap();
            let sel = f
                .extensions
                .get::<ParquetRowSelection>()
                .unwrap()
                .selection();
            let selectors: Vec<RowSelector> = sel.iter().copied().collect();
            let total: usize = selectors.iter().map(|s| s.row_count).sum();
            let selected: usize = selectors
                .iter()
                .filter(|s| !s.skip)
                .map(|s| s.row_count)
                .sum();
            assert_eq!((total, selected), (file_rows as usize, rows as usize));
            let first = selectors.iter().position(|s| !s.skip).unwrap();
            let before: usize = selectors[..first].iter().map(|s| s.row_count).sum();
            assert_eq!(before, start as usize);
        }
    }

    #[test]
    fn a_part_of_several_ranges_selects_each_once_per_file() {
        let mut other = split(2, 3, 10);
        other.path = "/data/t/part-1.parquet".into();
        let files =
            ranges_files(&[split(6, 2, 10), other, split(0, 3, 10), split(3, 1, 10)]).unwrap();
        assert_eq!(files.len(), 2);
        let selected = |f: &PartitionedFile| -> Vec<(bool, usize)> {
            let sel = f.extensions.get::<ParquetRowSelection>().unwrap();
            sel.selection()
                .iter()
                .map(|r| (r.skip, r.row_count))
                .collect()
        };
        // part-0: rows 0..4 and 6..8 of 10 (adjacent ranges merge).
        assert_eq!(
            selected(&files[0]),
            vec![(false, 4), (true, 2), (false, 2), (true, 2)]
        );
        assert_eq!(selected(&files[1]), vec![(true, 2), (false, 3), (true, 5)]);
        // Overlapping ranges, or one file given two sizes, are refused.
        let e = ranges_files(&[split(0, 3, 10), split(2, 3, 10)]).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
    }

    #[test]
    fn a_split_outside_its_file_is_a_clear_error() {
        for (start, rows) in [(8, 3), (11, 0), (u64::MAX, 2)] {
            let e = file_ranges(&[split(start, rows, 10)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("outside the 10 rows"), "{e}");
        }
    }
}
