//! `flightshuffle-slt`: DataFusion's own sqllogictest files run through the distributed
//! exchange on a local cluster, each file also on single-process DataFusion in the same run.
//!
//! Every file gets a fresh session on each side. Queries (`SELECT`, `WITH`, `VALUES`) go
//! through [`DistributedContext::sql`] with every query's work on the workers
//! ([`DistributedContext::with_all_on_workers`]): the plan is cut into stages that run on the
//! workers (in-memory tables travel inside the stage plans), every gather is a stage, and a
//! plan without any exchange runs as one task on a worker; the driver only reads the last
//! stage and runs what is above it. Queries counted "on the driver" ran whole there because a
//! stage plan would not reach the workers unchanged (`flightshuffle_datafusion::sendable`); the
//! report gives the reasons (`on_driver_why`). Other statements (`CREATE TABLE`, `INSERT`, `SET`)
//! define the session and run on the driver's session. `EXPLAIN` records differ by design
//! and are skipped and counted, as are records a `skipif`/`onlyif` condition leaves out for
//! DataFusion.
//!
//! Both sides format results the same way ([`cell`]), a simplified form of the formatting
//! DataFusion's own runner uses; a record that fails on both sides is not the exchange's
//! doing. The report per file: records passed, failed and skipped, the same file's passes
//! and failures on one process, the queries run distributed and on the driver, and the
//! first failures only the distributed side has.
//!
//! `flightshuffle-slt worker ...` runs a worker process (how the local cluster starts it).

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use clap::Parser;
use datafusion::prelude::SessionContext;
use flightshuffle::cluster::{LocalCluster, LocalClusterConfig};
use flightshuffle_datafusion::DistributedContext;
use sqllogictest::{AsyncDB, Condition, DBOutput, Record};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "flightshuffle-slt",
    about = "DataFusion's sqllogictest files, distributed and on one process"
)]
struct Args {
    /// The datafusion-sqllogictest package directory (holding `test_files/`); the files'
    /// relative paths to data resolve from there.
    #[arg(long)]
    dir: PathBuf,
    /// Files under `test_files/` (e.g. `aggregate.slt`); none: every file there.
    files: Vec<String>,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Also write the report (one object per file) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seconds a file may take on one side before its remaining records count as failed.
    #[arg(long, default_value_t = 300)]
    file_timeout: u64,
    /// A report of an earlier run: fail if a file has more records failing only distributed,
    /// or fewer passing, than there.
    #[arg(long)]
    baseline: Option<PathBuf>,
}

/// A result column type as the file spells it (the check compares values, not types).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Col(char);

impl sqllogictest::ColumnType for Col {
    fn from_char(value: char) -> Option<Self> {
        Some(Col(value))
    }
    fn to_char(&self) -> char {
        self.0
    }
}

#[derive(Debug)]
struct SltError(String);

impl std::fmt::Display for SltError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SltError {}

fn err(e: impl std::fmt::Display) -> SltError {
    SltError(e.to_string())
}

/// One value as the files write it: `NULL`, `(empty)`, floats rounded to 12 decimals.
fn cell(col: &ArrayRef, row: usize) -> Result<String, SltError> {
    if col.is_null(row) {
        return Ok("NULL".into());
    }
    let float = match col.data_type() {
        DataType::Float64 => {
            Some(arrow::array::as_primitive_array::<arrow::datatypes::Float64Type>(col).value(row))
        }
        DataType::Float32 => Some(f64::from(
            arrow::array::as_primitive_array::<arrow::datatypes::Float32Type>(col).value(row),
        )),
        _ => None,
    };
    if let Some(v) = float {
        return Ok(float_text(v));
    }
    let options = FormatOptions::default().with_null("NULL");
    let text = ArrayFormatter::try_new(col.as_ref(), &options)
        .map_err(err)?
        .value(row)
        .to_string();
    Ok(if text.is_empty() {
        "(empty)".into()
    } else {
        text
    })
}

fn float_text(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let mut s = format!("{v:.12}");
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    if s == "-0" {
        s = "0".into();
    }
    s
}

fn output(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<DBOutput<Col>, SltError> {
    let mut rows = Vec::new();
    for b in batches {
        for r in 0..b.num_rows() {
            rows.push(
                b.columns()
                    .iter()
                    .map(|c| cell(c, r))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
    }
    if rows.is_empty() && schema.fields().is_empty() {
        return Ok(DBOutput::StatementComplete(0));
    }
    let types = schema.fields().iter().map(|_| Col('?')).collect();
    Ok(DBOutput::Rows { types, rows })
}

fn is_query(sql: &str) -> bool {
    let lower = sql.trim_start().to_ascii_lowercase();
    ["select", "with", "values", "("]
        .iter()
        .any(|k| lower.starts_with(k))
}

/// Single-process DataFusion.
struct Local(SessionContext);

#[async_trait::async_trait]
impl AsyncDB for Local {
    type Error = SltError;
    type ColumnType = Col;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<Col>, SltError> {
        let df = self.0.sql(sql).await.map_err(err)?;
        let schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
        let batches = df.collect().await.map_err(err)?;
        output(&schema, &batches)
    }

    async fn shutdown(&mut self) {}

    async fn sleep(dur: Duration) {
        tokio::time::sleep(dur).await;
    }
}

/// The distributed context: queries on the cluster, the rest on the driver's session.
struct Distributed {
    ctx: Arc<DistributedContext>,
    staged: Arc<AtomicU64>,
    on_driver: Arc<AtomicU64>,
    /// Why queries ran on the driver, with how many did.
    why: Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>,
}

#[async_trait::async_trait]
impl AsyncDB for Distributed {
    type Error = SltError;
    type ColumnType = Col;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<Col>, SltError> {
        if !is_query(sql) {
            return Local(self.ctx.session().clone()).run(sql).await;
        }
        let r = self.ctx.sql(sql).await.map_err(err)?;
        let counter = match r.stages.is_empty() {
            true => &self.on_driver,
            false => &self.staged,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if r.stages.is_empty() {
            let why = r.on_driver.as_deref().unwrap_or("its plan has no stage");
            let why: String = why.chars().take(200).collect();
            *self
                .why
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(why)
                .or_default() += 1;
        }
        output(&r.schema, &r.batches)
    }

    async fn shutdown(&mut self) {}

    async fn sleep(dur: Duration) {
        tokio::time::sleep(dur).await;
    }
}

#[derive(Default)]
struct Side {
    passed: u64,
    failed: BTreeSet<usize>,
    skipped: u64,
    errors: Vec<(usize, String)>,
}

/// Run `records` through `db`, counting each statement and query.
async fn run_records<D: AsyncDB<ColumnType = Col> + Send + 'static>(
    db: D,
    records: &[Record<Col>],
    timeout: Duration,
) -> Side {
    let mut slot = Some(db);
    let mut runner = sqllogictest::Runner::new(move || {
        let db = slot.take();
        async move { db.ok_or_else(|| panic!("one connection per file")) }
    });
    runner.add_label("Datafusion");
    runner.with_column_validator(|_, _| true);
    runner.with_normalizer(|s: &String| s.trim_end().to_string());
    let labels = ["Datafusion".to_string()];
    let mut side = Side::default();
    let deadline = Instant::now() + timeout;
    for (i, record) in records.iter().enumerate() {
        let (sql, conditions) = match record {
            Record::Halt { .. } => break,
            Record::Statement {
                sql, conditions, ..
            }
            | Record::Query {
                sql, conditions, ..
            } => (sql, conditions),
            other => {
                let _ = runner.run_async(other.clone()).await;
                continue;
            }
        };
        let skip = conditions.iter().any(|c| match c {
            Condition::SkipIf { label } => labels.contains(label),
            Condition::OnlyIf { label } => !labels.contains(label),
        });
        if skip || sql.trim_start().to_ascii_lowercase().starts_with("explain") {
            side.skipped += 1;
            continue;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, runner.run_async(record.clone())).await {
            Ok(Ok(_)) => side.passed += 1,
            Ok(Err(e)) => {
                side.failed.insert(i);
                side.errors.push((i, e.to_string()));
            }
            Err(_) => {
                side.failed.insert(i);
                side.errors.push((i, "the file ran out of time".into()));
            }
        }
    }
    side
}

fn main() -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("worker") {
        let worker = flightshuffle::worker::main_with_args(
            argv[1..].to_vec(),
            flightshuffle_datafusion::worker_sources(),
        );
        return match worker {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("worker: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start a runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flightshuffle-slt: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn files(dir: &Path, names: &[String]) -> Result<Vec<PathBuf>, SltError> {
    let root = dir.join("test_files");
    if !names.is_empty() {
        return Ok(names.iter().map(|n| root.join(n)).collect());
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(err)? {
            let p = e.map_err(err)?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "slt") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

async fn run(mut args: Args) -> Result<(), SltError> {
    // Paths given relative to where we were started, before moving to the package directory.
    let here = std::env::current_dir().map_err(err)?;
    args.dir = here.join(&args.dir);
    args.json = args.json.map(|p| here.join(p));
    args.baseline = args.baseline.map(|p| here.join(p));
    let paths = files(&args.dir, &args.files)?;
    // The files name their data relative to the package directory.
    std::env::set_current_dir(&args.dir).map_err(err)?;
    let exe = std::env::current_exe().map_err(err)?;
    let cfg = LocalClusterConfig::new(
        args.workers,
        vec![exe.display().to_string(), "worker".into()],
    );
    let cluster = LocalCluster::start(cfg).await.map_err(err)?;
    let timeout = Duration::from_secs(args.file_timeout);
    let mut report = Vec::new();
    let (mut total_ours, mut total_dist, mut total_single) = (0, 0, 0);
    for path in &paths {
        let name = path
            .strip_prefix(args.dir.join("test_files"))
            .unwrap_or(path)
            .display()
            .to_string();
        let records = match sqllogictest::parse_file::<Col>(path) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("{name}: cannot parse: {e}");
                continue;
            }
        };
        let started = Instant::now();
        scratch(path)?;
        let single = run_records(Local(SessionContext::new()), &records, timeout).await;
        // Files the single-process run wrote (COPY, INSERT) must not be read again.
        scratch(path)?;
        let config = DistributedContext::default_config(args.workers);
        let ctx = DistributedContext::new(cluster.driver.clone(), config)
            .map_err(err)?
            .with_all_on_workers(true);
        let (staged, on_driver) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let why = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
        let db = Distributed {
            ctx: Arc::new(ctx),
            staged: staged.clone(),
            on_driver: on_driver.clone(),
            why: why.clone(),
        };
        let dist = run_records(db, &records, timeout).await;
        let ours: Vec<&(usize, String)> = dist
            .errors
            .iter()
            .filter(|(i, _)| !single.failed.contains(i))
            .collect();
        total_ours += ours.len();
        total_dist += dist.passed;
        total_single += single.passed;
        let line = serde_json::json!({
            "file": name,
            "passed": dist.passed,
            "failed": dist.failed.len(),
            "skipped": dist.skipped,
            "single_passed": single.passed,
            "single_failed": single.failed.len(),
            "failed_only_distributed": ours.len(),
            "queries_distributed": staged.load(Ordering::Relaxed),
            "queries_on_driver": on_driver.load(Ordering::Relaxed),
            "on_driver_why": why.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            "seconds": started.elapsed().as_secs_f64(),
            "first_failures_only_distributed": ours
                .iter()
                .take(5)
                .map(|(i, e)| format!("record {i}: {}", e.chars().take(600).collect::<String>()))
                .collect::<Vec<_>>(),
        });
        eprintln!(
            "{name}: distributed {} passed / {} failed, single-process {} / {}, {} failed only \
             distributed, {} skipped; queries {} distributed, {} on the driver",
            dist.passed,
            dist.failed.len(),
            single.passed,
            single.failed.len(),
            ours.len(),
            dist.skipped,
            staged.load(Ordering::Relaxed),
            on_driver.load(Ordering::Relaxed)
        );
        report.push(line);
    }
    let regressions = match &args.baseline {
        Some(b) => regressions(b, &report)?,
        None => Vec::new(),
    };
    let text = serde_json::to_string_pretty(&report).map_err(err)?;
    if let Some(out) = &args.json {
        std::fs::write(out, &text).map_err(err)?;
    }
    println!("{text}");
    eprintln!(
        "{} files: {total_dist} records passed distributed, {total_single} on one process; \
         {total_ours} failed only distributed",
        paths.len()
    );
    if !regressions.is_empty() {
        return Err(SltError(format!(
            "worse than the baseline: {}",
            regressions.join("; ")
        )));
    }
    Ok(())
}

/// An empty `test_files/scratch/<stem>` for the file at `path` (what its statements write).
fn scratch(path: &Path) -> Result<(), SltError> {
    let stem = path.file_stem().unwrap_or_default();
    let dir = Path::new("test_files").join("scratch").join(stem);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(err)?;
    }
    std::fs::create_dir_all(&dir).map_err(err)
}

/// How `report` is worse than the report in `baseline`, file by file.
fn regressions(baseline: &Path, report: &[serde_json::Value]) -> Result<Vec<String>, SltError> {
    let text = std::fs::read_to_string(baseline).map_err(err)?;
    let base: Vec<serde_json::Value> = serde_json::from_str(&text).map_err(err)?;
    let mut worse = Vec::new();
    for now in report {
        let Some(before) = base.iter().find(|b| b["file"] == now["file"]) else {
            continue;
        };
        let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
        for (key, more_is_worse) in [("failed_only_distributed", true), ("passed", false)] {
            let (b, a) = (n(before, key), n(now, key));
            if (more_is_worse && a > b) || (!more_is_worse && a < b) {
                worse.push(format!("{} {key} {b} -> {a}", now["file"]));
            }
        }
    }
    Ok(worse)
}
