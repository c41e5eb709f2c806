//! Online aggregation of SQL with the native map side (`exchange_datafusion::online`): the
//! statistics query is planned once here and its fact stage streams, one split per map task.

use crate::sql::{df_err, register};
use crate::stage::NativeStream;
use exchange::driver::Driver;
use exchange::strategy::StrategyOptions;
use exchange_datafusion::online::{self, EmitTop, FactSplit};
use exchange_datafusion::DistributedContext;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;

/// A split as Python gives it: path, file size, file rows, first row, rows.
pub type SplitTuple = (String, u64, u64, u64, u64);

/// The first ordering key and LIMIT as Python gives them (see [`EmitTop`]): column, divisor,
/// null as zero, descending, k.
pub type TopTuple = (u32, Option<u32>, bool, bool, u64);

/// A cluster's context for online SQL (every join planned as a broadcast), made once, with
/// the tables registered so far (name to path and version): a table is registered again
/// only under a new path or when its files changed. Registering (which reads the Parquet
/// footers) and making the context took about half of the driver's 15 ms per query before
/// the first split could start.
#[derive(Default)]
pub struct Sessions {
    ctx: std::sync::Mutex<Option<Arc<DistributedContext>>>,
    /// Held while a query registers its tables and plans, so it plans over its own tables.
    tables: tokio::sync::Mutex<HashMap<String, (String, String)>>,
}

impl Sessions {
    fn context(
        &self,
        rt: &Arc<crate::Rt>,
        driver: &Arc<Driver>,
        opts: StrategyOptions,
    ) -> PyResult<Arc<DistributedContext>> {
        let mut slot = self.ctx.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ctx) = slot.as_ref() {
            return Ok(ctx.clone());
        }
        let _runtime = rt.enter();
        let config = DistributedContext::online_config(driver.num_workers());
        let ctx = Arc::new(
            DistributedContext::new(driver.clone(), config)
                .map_err(df_err)?
                .with_strategy_options(StrategyOptions { parity: 0, ..opts }),
        );
        *slot = Some(ctx.clone());
        Ok(ctx)
    }
}

/// Plan `sql` over `tables` (name, Parquet path, a version of its files) with the fact table cut into `splits` (in
/// the order they are read), the folds sending only candidates for `top`, and start it;
/// returns the stream of folded statistics and the staged plan's text.
#[allow(clippy::too_many_arguments)]
pub fn start(
    py: Python<'_>,
    rt: &Arc<crate::Rt>,
    sessions: &Sessions,
    driver: Arc<Driver>,
    opts: StrategyOptions,
    sql: String,
    tables: Vec<(String, String, String)>,
    splits: Vec<SplitTuple>,
    rounds: usize,
    top: Option<TopTuple>,
) -> PyResult<(NativeStream, String)> {
    let top = top.map(|(column, divisor, null_as_zero, descending, k)| EmitTop {
        column,
        divisor,
        null_as_zero,
        descending,
        k,
    });
    let weights: Vec<u64> = splits.iter().map(|s| s.4).collect();
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
    let ctx = sessions.context(rt, &driver, opts)?;
    let planned = crate::wait(py, rt, async {
        let mut registered = sessions.tables.lock().await;
        for (name, path, version) in &tables {
            let now = (path.clone(), version.clone());
            if registered.get(name) != Some(&now) {
                registered.remove(name);
                register(&ctx, name, path).await?;
                registered.insert(name.clone(), now);
            }
        }
        online::plan(&ctx, &sql, splits, top).await.map_err(df_err)
    })??;
    let explain = planned.explain.clone();
    let mut ids: Vec<_> = planned.dims.iter().map(|s| s.writer.shuffle).collect();
    ids.push(planned.fact.writer.shuffle);
    let (tx, rx) = mpsc::channel(2);
    let task = rt.spawn(async move {
        online::run(&ctx, planned, rounds, weights, tx).await;
    });
    Ok((NativeStream::new(rt, &driver, ids, rx, task), explain))
}
