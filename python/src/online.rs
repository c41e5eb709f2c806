//! Online aggregation of SQL with the native map side (`flightshuffle_datafusion::online`): the
//! statistics query is planned once here and its fact stage streams, one split per map task.

use crate::sql::df_err;
use crate::stage::NativeStream;
use flightshuffle::driver::Driver;
use flightshuffle::strategy::StrategyOptions;
use flightshuffle_datafusion::online::{self, DistinctCounts, EmitTop, FactSplit, FoldEmit, Term};
use flightshuffle_datafusion::{DistributedContext, FlightshuffleOptions};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;

/// A split as Python gives it: path, file size, file rows, first row, rows.
pub type SplitTuple = (String, u64, u64, u64, u64);

/// The first ordering key and LIMIT as Python gives them (see [`EmitTop`]): column, divisor,
/// null as zero, descending, k.
pub type TopTuple = (u32, Option<u32>, bool, bool, u64);

/// A table as Python gives it: name, Parquet path, a version of its files.
pub type TableTuple = (String, String, String);

/// A cluster's context for online SQL (every join planned as a broadcast), made once, with
/// the tables registered so far (name to path and version): a table is registered again
/// only under a new path or when its files changed. Registering (which reads the Parquet
/// footers) and making the context took about half of the driver's 15 ms per query before
/// the first split could start.
#[derive(Default)]
pub struct Sessions {
    /// Held while a query registers its tables and plans, so it plans over its own tables.
    state: tokio::sync::Mutex<Option<Session>>,
}

struct Session {
    ctx: Arc<DistributedContext>,
    tables: HashMap<String, (String, String)>,
}

impl Sessions {
    /// Plan `sql` over `tables` on the cluster's online context (made on first use).
    #[allow(clippy::too_many_arguments)]
    async fn plan(
        &self,
        driver: &Arc<Driver>,
        opts: StrategyOptions,
        tables: &[TableTuple],
        sql: &str,
        splits: Vec<FactSplit>,
        emit: FoldEmit,
        terms: Vec<Term>,
        per_task: Vec<u32>,
        settings: &Option<FlightshuffleOptions>,
    ) -> flightshuffle_datafusion::Result<(Arc<DistributedContext>, online::OnlinePlan)> {
        let mut state = self.state.lock().await;
        let session = match state.take() {
            Some(session) => state.insert(session),
            None => {
                let config = DistributedContext::online_config(driver.num_workers());
                let ctx = DistributedContext::new(driver.clone(), config)?
                    .with_strategy_options(StrategyOptions { parity: 0, ..opts });
                state.insert(Session {
                    ctx: Arc::new(ctx),
                    tables: HashMap::new(),
                })
            }
        };
        if let Some(settings) = settings {
            session
                .ctx
                .set_options(DistributedContext::online_options(settings.clone()));
        }
        for (name, path, version) in tables {
            let now = (path.clone(), version.clone());
            if session.tables.get(name) != Some(&now) {
                session.tables.remove(name);
                session.ctx.register_parquet(name, path).await?;
                session.tables.insert(name.clone(), now);
            }
        }
        let planned = online::plan(&session.ctx, sql, splits, emit, terms, per_task).await?;
        Ok((session.ctx.clone(), planned))
    }

    /// Forget the context (the cluster is closing); a query planning now keeps its own.
    pub fn close(&self) {
        if let Ok(mut state) = self.state.try_lock() {
            state.take();
        }
    }
}

/// Plan `sql` over `tables` with the fact table cut into `splits` (in the order they are
/// read; `per_task[i]` consecutive splits per map task), each split's `terms` appended to its
/// totals (see `flightshuffle_datafusion::split_totals`), the folds sending only candidates
/// for `top` (or `distinct`'s counts per group), and start it; returns the stream of folded
/// statistics and the staged plan's text.
#[allow(clippy::too_many_arguments)]
pub fn start(
    py: Python<'_>,
    rt: &Arc<crate::Rt>,
    sessions: &Arc<Sessions>,
    driver: Arc<Driver>,
    opts: StrategyOptions,
    sql: String,
    tables: Vec<TableTuple>,
    splits: Vec<SplitTuple>,
    rounds: usize,
    top: Option<TopTuple>,
    distinct: Option<(u32, u32, u32)>,
    terms: Vec<(u32, u32)>,
    per_task: Vec<u32>,
    settings: Option<FlightshuffleOptions>,
) -> PyResult<(NativeStream, String)> {
    let terms: Vec<Term> = terms.into_iter().map(|(a, b)| Term(a, b)).collect();
    let top = top.map(|(column, divisor, null_as_zero, descending, k)| EmitTop {
        column,
        divisor,
        null_as_zero,
        descending,
        k,
    });
    let emit = FoldEmit {
        top,
        distinct: distinct.map(|(keys, value, rows)| DistinctCounts { keys, value, rows }),
    };
    let splits: Vec<FactSplit> = splits
        .into_iter()
        .map(|(path, size, file_rows, start, rows)| FactSplit {
            path,
            size,
            file_rows,
            start,
            rows,
        })
        .collect();
    for (name, path, _) in &tables {
        if !std::path::Path::new(path).exists() {
            return Err(pyo3::exceptions::PyFileNotFoundError::new_err(format!(
                "table {name}: no such file or directory: {path}"
            )));
        }
    }
    let planning = sessions.plan(
        &driver,
        opts,
        &tables,
        &sql,
        splits.clone(),
        emit.clone(),
        terms.clone(),
        per_task.clone(),
        &settings,
    );
    let (ctx, planned) = crate::wait(py, rt, planning)?.map_err(df_err)?;
    // A run after a lost worker plans again over the same tables, under the same lock.
    let replan: online::Replan = {
        let (sessions, driver) = (sessions.clone(), driver.clone());
        Arc::new(move || {
            let (sessions, driver, tables, sql) = (
                sessions.clone(),
                driver.clone(),
                tables.clone(),
                sql.clone(),
            );
            let (splits, emit) = (splits.clone(), emit.clone());
            let (terms, per_task) = (terms.clone(), per_task.clone());
            let settings = settings.clone();
            Box::pin(async move {
                let planned = sessions.plan(
                    &driver, opts, &tables, &sql, splits, emit, terms, per_task, &settings,
                );
                planned.await.map(|(_, p)| p)
            })
        })
    };
    let explain = planned.explain.clone();
    let mut ids: Vec<_> = planned.dims.iter().map(|s| s.writer.shuffle).collect();
    ids.push(planned.fact.writer.shuffle);
    let (tx, rx) = mpsc::channel(2);
    let task = rt.spawn(async move {
        online::run(&ctx, planned, rounds, tx, replan).await;
    });
    Ok((NativeStream::new(rt, &driver, ids, rx, task), explain))
}
