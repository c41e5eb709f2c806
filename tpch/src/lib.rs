//! TPC-H for flightshuffle: Parquet data generation with `tpchgen-arrow`, the 22 queries,
//! answer comparison, and the distributed-vs-single-process benchmark.

pub mod check;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use indicatif::{ProgressBar, ProgressStyle};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use std::path::{Path, PathBuf};

pub const TABLES: [&str; 8] = [
    "lineitem", "orders", "partsupp", "part", "customer", "supplier", "nation", "region",
];

const QUERIES: [&str; 22] = [
    include_str!("../queries/q01.sql"),
    include_str!("../queries/q02.sql"),
    include_str!("../queries/q03.sql"),
    include_str!("../queries/q04.sql"),
    include_str!("../queries/q05.sql"),
    include_str!("../queries/q06.sql"),
    include_str!("../queries/q07.sql"),
    include_str!("../queries/q08.sql"),
    include_str!("../queries/q09.sql"),
    include_str!("../queries/q10.sql"),
    include_str!("../queries/q11.sql"),
    include_str!("../queries/q12.sql"),
    include_str!("../queries/q13.sql"),
    include_str!("../queries/q14.sql"),
    include_str!("../queries/q15.sql"),
    include_str!("../queries/q16.sql"),
    include_str!("../queries/q17.sql"),
    include_str!("../queries/q18.sql"),
    include_str!("../queries/q19.sql"),
    include_str!("../queries/q20.sql"),
    include_str!("../queries/q21.sql"),
    include_str!("../queries/q22.sql"),
];

/// Query `n` (1..=22) for scale factor `sf`. Q11's fraction is 0.0001 / SF, as the spec says.
pub fn query(n: usize, sf: f64) -> Option<String> {
    let text = QUERIES.get(n.checked_sub(1)?)?;
    let text = text.trim().trim_end_matches(';').to_string();
    Some(if n == 11 {
        text.replace("* 0.0001", &format!("* {}", 0.0001 / sf))
    } else {
        text
    })
}

/// True when the query's result order is fully fixed by its ORDER BY (ties aside, which the
/// comparison tolerates by sorting rows that compare equal on the ordering).
pub fn is_ordered(n: usize) -> bool {
    query(n, 1.0).is_some_and(|q| q.to_ascii_lowercase().contains("order by"))
}

/// Files per table at scale factor `sf`: several for the large tables so scans split.
fn files_for(table: &str, sf: f64) -> i32 {
    let by = |per_sf: f64, min: i32| ((per_sf * sf).ceil() as i32).max(min);
    match table {
        "lineitem" => by(4.0, 4),
        "orders" => by(2.0, 4),
        "partsupp" | "part" | "customer" => by(1.0, 2),
        _ => 1,
    }
}

type Batches = Box<dyn Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>>>;

fn generator(table: &str, sf: f64, part: i32, parts: i32) -> Option<(SchemaRef, Batches)> {
    use tpchgen::generators::*;
    use tpchgen_arrow::*;
    macro_rules! gen {
        ($arrow:ident, $gen:ident) => {{
            let g = $arrow::new($gen::new(sf, part, parts)).with_batch_size(64 * 1024);
            ($arrow::schema_ref(), Box::new(g) as Batches)
        }};
    }
    Some(match table {
        "lineitem" => gen!(LineItemArrow, LineItemGenerator),
        "orders" => gen!(OrderArrow, OrderGenerator),
        "partsupp" => gen!(PartSuppArrow, PartSuppGenerator),
        "part" => gen!(PartArrow, PartGenerator),
        "customer" => gen!(CustomerArrow, CustomerGenerator),
        "supplier" => gen!(SupplierArrow, SupplierGenerator),
        "nation" => gen!(NationArrow, NationGenerator),
        "region" => gen!(RegionArrow, RegionGenerator),
        _ => return None,
    })
}

/// The directory of one table.
pub fn table_dir(root: &Path, table: &str) -> PathBuf {
    root.join(table)
}

/// True when every table of `root` has at least one Parquet file.
pub fn is_generated(root: &Path) -> bool {
    TABLES.iter().all(|t| {
        std::fs::read_dir(table_dir(root, t))
            .map(|d| {
                d.flatten()
                    .any(|e| e.path().extension().is_some_and(|x| x == "parquet"))
            })
            .unwrap_or(false)
    })
}

/// Write the 8 tables at scale factor `sf` under `root/<table>/part-<i>.parquet`.
pub fn generate(sf: f64, root: &Path, progress: bool) -> Result<(), String> {
    if sf.is_nan() || sf <= 0.0 {
        return Err(format!("scale factor must be positive, not {sf}"));
    }
    let jobs: Vec<(&str, i32, i32)> = TABLES
        .iter()
        .flat_map(|t| {
            let n = files_for(t, sf);
            (1..=n).map(move |p| (*t, p, n))
        })
        .collect();
    let bar = if progress {
        ProgressBar::new(jobs.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} files {elapsed}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    for (table, part, parts) in jobs {
        bar.set_message(table.to_string());
        let dir = table_dir(root, table);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("part-{part:03}.parquet"));
        let tmp = dir.join(format!(".part-{part:03}.parquet.tmp"));
        let (schema, batches) =
            generator(table, sf, part, parts).ok_or_else(|| format!("unknown table {table}"))?;
        let file = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(
                ZstdLevel::try_new(1).map_err(|e| e.to_string())?,
            ))
            .set_max_row_group_row_count(Some(256 * 1024))
            .build();
        let mut w = ArrowWriter::try_new(file, schema, Some(props)).map_err(|e| e.to_string())?;
        for b in batches {
            w.write(&b.map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        }
        w.close().map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}

/// Register the 8 tables of `root` in a DataFusion session.
pub async fn register(ctx: &SessionContext, root: &Path) -> datafusion::error::Result<()> {
    for t in TABLES {
        let dir = table_dir(root, t);
        ctx.register_parquet(t, &dir.to_string_lossy(), ParquetReadOptions::default())
            .await?;
    }
    Ok(())
}
