//! `DistributedContext`: a DataFusion session whose queries run on a flightshuffle cluster.
//! `sql()` plans with DataFusion, cuts the plan into stages and runs them all at once on the
//! workers, pipelined (a consumer stage reads each committed map output of its producers as it
//! arrives; see `flightshuffle::scheduler`), together with the final single-partition step on the
//! driver, which reads the last exchange. `EXPLAIN` / `EXPLAIN ANALYZE` print the stages.

use crate::broadcast::BroadcastJoins;
use crate::join_order::SelectiveJoinsFirst;
use crate::planner::{StagedPlan, SMALL_GATHER_ROWS};
use crate::result::text_result;
pub use crate::result::{QueryResult, StageMetrics};
use crate::{Error, ExchangeContext, Result};
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::execution::TaskContext;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use flightshuffle::driver::Driver;
use flightshuffle::strategy::{Strategy, StrategyOptions};
use std::sync::Arc;
use std::time::Instant;

/// Build sides estimated under this many bytes are broadcast (DataFusion's `CollectLeft`):
/// every worker reads the whole build side instead of both sides being hash-exchanged.
/// DataFusion's single-process default is 1 MiB, set for a repartition that costs a memory
/// copy; here the alternative moves the probe side over the network, so a broadcast pays off
/// for far larger build sides (Spark's `autoBroadcastJoinThreshold` is 10 MB). Measured on
/// TPC-H SF1, 2 workers: 1 MiB 1.38x single-process, 8 MiB 1.31x on the join-heavy queries,
/// 32 MiB 1.17x (q03, q05, q07 shuffle 3-26 MB instead of 130-300 MB). Larger build sides are
/// still broadcast when they are small next to the probe side ([`crate::broadcast`]). Set
/// `datafusion.optimizer.hash_join_single_partition_threshold` in the session config passed to
/// [`DistributedContext::new`] to choose otherwise (0: no broadcasts at all).
pub const BROADCAST_JOIN_BYTES: usize = 32 << 20;
/// Row threshold for a broadcast when a build side has no byte estimate.
pub const BROADCAST_JOIN_ROWS: usize = 1 << 20;

/// How many times a query runs again whole after losing a worker its scheduler could not
/// recover from (each time once the lost worker's replacement is up).
pub const QUERY_RETRIES: u32 = 2;

tokio::task_local! {
    /// The values of the placeholders (`$1`, ...) of the query planned in this task
    /// ([`DistributedContext::sql_held_with`], `sql_params`); read where it is planned.
    pub(crate) static PARAMS: Option<datafusion::common::ParamValues>;
}

/// A DataFusion session whose queries run on a flightshuffle cluster through its driver.
pub struct DistributedContext {
    pub(crate) ctx: SessionContext,
    pub(crate) driver: Arc<Driver>,
    pub(crate) last_rpcs: std::sync::Mutex<u64>,
    small_gather_rows: usize,
    /// Every query's work on the workers, the driver only reading the last stage.
    all_on_workers: bool,
    pub(crate) strategy_options: StrategyOptions,
    /// Where each query writes its event log ([`flightshuffle::events`]), if anywhere.
    event_log: Option<std::path::PathBuf>,
    /// Queries logged so far, and the last one's log.
    logged: std::sync::Mutex<(u64, Option<std::path::PathBuf>)>,
}

impl DistributedContext {
    /// Session settings for a cluster of `workers`: two partitions per worker (so scans split
    /// into that many file groups), no round-robin repartitioning (file groups already spread
    /// the work; each repartition is a network exchange here), hash joins whose build side is
    /// estimated under [`BROADCAST_JOIN_BYTES`] (or, without a byte estimate,
    /// [`BROADCAST_JOIN_ROWS`]) planned as broadcasts, plus [`crate::distributed_options`].
    pub fn default_config(workers: usize) -> SessionConfig {
        let mut config = SessionConfig::new().with_target_partitions((2 * workers).max(2));
        let opts = &mut config.options_mut().optimizer;
        opts.enable_round_robin_repartition = false;
        opts.hash_join_single_partition_threshold = BROADCAST_JOIN_BYTES;
        opts.hash_join_single_partition_threshold_rows = BROADCAST_JOIN_ROWS;
        crate::distributed_options(config)
    }

    /// [`Self::default_config`] for online aggregation ([`crate::online`]): every join whose
    /// smaller side has a size estimate is a broadcast, so the fact table's scan, its joins
    /// and the partial aggregate stay in one stage.
    pub fn online_config(workers: usize) -> SessionConfig {
        let mut config = Self::default_config(workers);
        let opts = &mut config.options_mut().optimizer;
        opts.hash_join_single_partition_threshold = usize::MAX;
        opts.hash_join_single_partition_threshold_rows = usize::MAX;
        // Every join is in the fact table's stage anyway; the written order keeps the fact
        // table on the probe side of the chain (moved, a filtered join could make the chain
        // the smaller side, a build side cut into a stage of its own).
        config.with_option_extension(Self::online_options(Default::default()))
    }

    /// `settings` (a session's `flightshuffle.*`) as online queries take them: with the join
    /// order as written, every query streamed and no semi join copied below a join.
    pub fn online_options(settings: crate::FlightshuffleOptions) -> crate::FlightshuffleOptions {
        crate::FlightshuffleOptions {
            selective_joins_first: false,
            // The fact table streams however small it is (a small query runs whole, exactly,
            // when the planner leaves no stage to stream; see `crate::online`).
            small_query_rows: 0,
            // Every online join is a broadcast, with no exchange below it for a copy of a
            // semi join to cut down: a copy would only build the same keys again on every
            // worker (and keep the build side from being read per unit).
            push_semi_joins: false,
            ..settings
        }
    }

    /// Replace the session's `flightshuffle.*` settings (an online context taking the SQL
    /// session's, see [`Self::online_options`]).
    pub fn set_options(&self, settings: crate::FlightshuffleOptions) {
        let state = self.ctx.state_ref();
        let mut state = state.write();
        state.config_mut().options_mut().extensions.insert(settings);
    }

    /// A context whose queries run on `driver`'s workers, with the session settings in `config`.
    pub fn new(driver: Arc<Driver>, config: SessionConfig) -> Result<Self> {
        let ectx = ExchangeContext::of_driver(driver.clone());
        let mut config = crate::distributed_options(config).with_extension(Arc::new(ectx));
        if config
            .options()
            .extensions
            .get::<crate::FlightshuffleOptions>()
            .is_none()
        {
            config = config.with_option_extension(crate::FlightshuffleOptions::default());
        }
        // Relative broadcasts are decided right after DataFusion's own join selection, before
        // it plans the exchanges (see `crate::broadcast`).
        let mut rules = PhysicalOptimizer::new().rules;
        if let Some(i) = rules.iter().position(|r| r.name() == "join_selection") {
            rules.insert(i + 1, Arc::new(BroadcastJoins::new(driver.num_workers())));
        }
        let state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features()
            .with_physical_optimizer_rules(rules)
            .with_optimizer_rule(Arc::new(SelectiveJoinsFirst))
            .build();
        let ctx = SessionContext::new_with_state(state);
        ctx.register_udf(crate::double::udf());
        Ok(DistributedContext {
            ctx,
            driver,
            last_rpcs: std::sync::Mutex::new(0),
            small_gather_rows: SMALL_GATHER_ROWS,
            all_on_workers: false,
            strategy_options: StrategyOptions::default(),
            event_log: None,
            logged: Default::default(),
        })
    }

    /// Gathers of exchange-free subtrees whose every node has at most `rows` rows (DataFusion's
    /// estimate) run inside their consumers instead of as a stage; 0 cuts every gather.
    /// Default [`SMALL_GATHER_ROWS`].
    pub fn with_small_gather_rows(mut self, rows: usize) -> Self {
        self.small_gather_rows = rows;
        self
    }

    /// Run every query's work on the workers: every gather is cut into a stage, and a plan
    /// without any exchange (a query over small tables, which by default runs whole on the
    /// driver, where it costs least) runs as one task on a worker, the driver only reading its
    /// output. For checking answers of the distributed path (the sqllogictest runner).
    pub fn with_all_on_workers(mut self, on: bool) -> Self {
        self.all_on_workers = on;
        self
    }

    /// Knobs every stage's strategy runs with (e.g. speculative execution); each exchange's
    /// strategy itself comes from its plan.
    pub fn with_strategy_options(mut self, opts: StrategyOptions) -> Self {
        self.strategy_options = opts;
        self
    }

    /// Write one event log per query under `dir` (`query-<n>-<random>.jsonl`, owner-only):
    /// its tasks, exchanges, recovery and stages ([`flightshuffle::events`]).
    pub fn with_event_log(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.event_log = Some(dir.into());
        self
    }

    /// The event log of the last query run with one.
    pub fn last_event_log(&self) -> Option<std::path::PathBuf> {
        self.logged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clone()
    }

    /// The DataFusion session (register tables and functions here).
    pub fn session(&self) -> &SessionContext {
        &self.ctx
    }

    /// The driver of the cluster the queries run on.
    pub fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }

    /// Register a Parquet file or directory as a table; a table of the same name is replaced.
    /// Workers read the same path, so it must be visible to them (always true on a local
    /// cluster).
    pub async fn register_parquet(&self, name: &str, path: &str) -> Result<()> {
        replace_parquet(&self.ctx, name, path).await
    }

    /// Plan `sql` and cut it into stages; every exchange gets the session's strategy.
    pub async fn plan(&self, sql: &str) -> Result<StagedPlan> {
        self.plan_with(sql, None).await
    }

    /// [`Self::plan`], with every exchange using `strategy` when given.
    pub async fn plan_with(&self, sql: &str, strategy: Option<Strategy>) -> Result<StagedPlan> {
        self.plan_rewritten(sql, strategy, Ok).await
    }

    /// [`Self::plan_with`], with DataFusion's physical plan passed through `rewrite` before it
    /// is cut into stages (online aggregation keeps its fact table on the probe side).
    pub async fn plan_rewritten(
        &self,
        sql: &str,
        strategy: Option<Strategy>,
        rewrite: impl FnOnce(Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>>,
    ) -> Result<StagedPlan> {
        let strategy = match strategy {
            Some(s) => s,
            None => self.session_strategy()?,
        };
        let mut df = self.ctx.sql(sql).await?;
        if let Ok(Some(params)) = PARAMS.try_with(Clone::clone) {
            df = df.with_param_values(params)?;
        }
        let plan = rewrite(df.create_physical_plan().await?)?;
        let small = self.options().small_query_rows;
        let scanned = match self.all_on_workers || small == 0 {
            true => None,
            false => crate::planner::scanned_rows(&plan).filter(|rows| *rows <= small),
        };
        let mut staged = match (self.all_on_workers, scanned) {
            (true, _) => {
                let options = self.options();
                crate::planner::on_workers(crate::planner::plan_stages_reducing(
                    plan.clone(),
                    0,
                    join_rewrites(&options),
                )?)
            }
            // A small query: stages would cost more than they spread.
            (false, Some(rows)) => StagedPlan {
                stages: Vec::new(),
                root: plan.clone(),
                root_inputs: Vec::new(),
                on_driver: Some(format!(
                    "it reads {rows} rows, at most flightshuffle.small_query_rows ({small})"
                )),
            },
            (false, None) => {
                let options = self.options();
                crate::planner::plan_stages_reducing(
                    plan.clone(),
                    self.small_gather_rows,
                    join_rewrites(&options),
                )?
            }
        };
        // A stage that would not reach the workers as planned: the query runs whole here.
        let task_ctx = self.task_ctx();
        let unsendable = staged.stages.iter().find_map(|s| {
            let writer = s.writer.clone() as Arc<dyn ExecutionPlan>;
            crate::sendable::check(&writer, &task_ctx)
                .err()
                .map(|why| format!("stage {} cannot be sent to the workers: {why}", s.id()))
        });
        if let Some(why) = unsendable {
            tracing::warn!(%why, "running a query on the driver");
            staged = StagedPlan {
                stages: Vec::new(),
                root: plan,
                root_inputs: Vec::new(),
                on_driver: Some(why),
            };
        }
        self.driver.progress().planned.fetch_add(
            staged.stages.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let ids: Vec<u32> = staged.stages.iter().map(|s| s.id()).collect();
        for id in ids {
            staged.set_strategy(id, strategy)?;
        }
        Ok(staged)
    }

    /// The strategy exchanges use: `SET flightshuffle.strategy` if set, else the context's.
    pub fn session_strategy(&self) -> Result<Strategy> {
        let state = self.ctx.state();
        match state
            .config()
            .options()
            .extensions
            .get::<crate::FlightshuffleOptions>()
        {
            Some(o) if !o.strategy.trim().is_empty() => Ok(o.strategy.parse()?),
            _ => Ok(self.strategy_options.strategy),
        }
    }

    /// Run `sql` on the cluster. `EXPLAIN [ANALYZE] <query>` returns the staged plan as text;
    /// `SET flightshuffle.strategy = '...'` sets the strategy of the queries that follow.
    pub async fn sql(&self, sql: &str) -> Result<QueryResult> {
        self.sql_with(sql, None).await
    }

    /// [`Self::sql`], with every exchange of this query using `strategy` when given.
    pub async fn sql_with(&self, sql: &str, strategy: Option<Strategy>) -> Result<QueryResult> {
        self.sql_hold(sql, strategy, false).await
    }

    /// [`Self::sql_with`]; with `hold`, a query's rows stay on the workers where they can
    /// ([`crate::held`]): the result then has no batches, and says where its rows are.
    pub(crate) async fn sql_hold(
        &self,
        sql: &str,
        strategy: Option<Strategy>,
        hold: bool,
    ) -> Result<QueryResult> {
        let trimmed = sql.trim_start();
        let lower = trimmed.to_ascii_lowercase();
        for (prefix, analyze) in [("explain analyze ", true), ("explain ", false)] {
            if lower.starts_with(prefix) {
                let start = Instant::now();
                let text = self
                    .explain_with(&trimmed[prefix.len()..], analyze, strategy)
                    .await?;
                return Ok(text_result(&text, start.elapsed().as_secs_f64()));
            }
        }
        let start = Instant::now();
        if lower.starts_with("set ") {
            return self.set(sql, start).await;
        }
        let Some(dir) = &self.event_log else {
            return self.run_query(sql, strategy, start, hold).await;
        };
        let path = {
            let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
            logged.0 += 1;
            let path = dir.join(format!(
                "query-{:04}-{:08x}.jsonl",
                logged.0,
                rand::random::<u32>()
            ));
            logged.1 = Some(path.clone());
            path
        };
        let log = Arc::new(flightshuffle::events::EventLog::create(&path)?);
        let before = self.driver.log_events(Some(log.clone()));
        log.write(
            "query_start",
            serde_json::json!({"sql": sql, "workers": self.driver.num_workers()}),
        );
        let result = self.run_query(sql, strategy, start, hold).await;
        match &result {
            Ok(r) => {
                for s in &r.stages {
                    log.write("stage", serde_json::to_value(s).unwrap_or_default());
                }
                let rows = match &r.held {
                    Some(h) => h.rows as usize,
                    None => r.batches.iter().map(|b| b.num_rows()).sum(),
                };
                log.write(
                    "query_end",
                    serde_json::json!({"ok": true, "rows": rows, "seconds": r.seconds}),
                );
            }
            Err(e) => log.write(
                "query_end",
                serde_json::json!({"ok": false, "error": e.to_string()}),
            ),
        }
        self.driver.log_events(before);
        log.flush()?;
        result
    }

    /// Plan and run a query (not `EXPLAIN` or `SET`), again whole after a lost worker.
    async fn run_query(
        &self,
        sql: &str,
        strategy: Option<Strategy>,
        start: Instant,
        hold: bool,
    ) -> Result<QueryResult> {
        // A worker lost while the stages run is recovered by the scheduler (only the missing
        // maps run again, see `flightshuffle::scheduler`). If that fails too (lost again and
        // again, or while planning), the query runs again, whole, once the lost worker's
        // replacement is up: it reads its inputs again, so nothing is counted twice. At most
        // QUERY_RETRIES times.
        let mut retries = 0;
        let (staged, batches, stages, held) = loop {
            // Plans and tasks name the workers' addresses: a lost worker's replacement (found
            // lost after the last query, say) must be in place before they are made.
            self.driver
                .wait_all_live(flightshuffle::driver::REPLACE_TIMEOUT)
                .await?;
            let replacements = self.driver.replacements();
            let run = async {
                let staged = self.plan_with(sql, strategy).await?;
                if hold {
                    if let Some((staged, shuffle)) = self.to_hold(&staged)? {
                        let (batches, stages) = self.run_stages(&staged, Some(shuffle)).await?;
                        let held = self.held(shuffle, &stages);
                        return Ok::<_, Error>((staged, batches, stages, Some(held)));
                    }
                }
                let (batches, stages) = self.execute(&staged).await?;
                Ok::<_, Error>((staged, batches, stages, None))
            };
            match run.await {
                Ok(done) => break done,
                Err(e) if retries < QUERY_RETRIES && self.recoverable(&e, replacements) => {
                    retries += 1;
                    self.driver.note_rerun();
                    self.driver.event(
                        "query_rerun",
                        || serde_json::json!({"retry": retries, "error": e.to_string()}),
                    );
                    tracing::warn!(error = %e, retries, "worker lost during a query: running it again");
                }
                Err(e) => return Err(e),
            }
        };
        Ok(QueryResult {
            schema: staged.root.schema(),
            batches,
            stages,
            seconds: start.elapsed().as_secs_f64(),
            rpcs: self.last_rpcs(),
            on_driver: staged.on_driver.clone(),
            held,
        })
    }

    /// Whether a failed query can run again: the driver replaces lost workers, and a worker
    /// was lost (the error says so, or a replacement started while the query ran: the error
    /// may be a peer's that could not reach the lost worker, and the replacement may be up
    /// before the failure is looked at).
    fn recoverable(&self, e: &Error, replacements_before: u64) -> bool {
        self.driver.replaces_workers()
            && (matches!(e.exchange(), Some(flightshuffle::Error::WorkerLost { .. }))
                || self.driver.replacements() != replacements_before)
    }

    /// A `SET` statement: run by the session; a bad `flightshuffle.strategy`, or a
    /// `flightshuffle.storage` the driver cannot write to, is refused and the previous value
    /// kept.
    async fn set(&self, sql: &str, start: Instant) -> Result<QueryResult> {
        let before = self.session_strategy()?;
        let storage_before = self.options().storage;
        self.ctx.sql(sql).await?.collect().await?;
        if let Err(e) = self.session_strategy() {
            let restore = format!("SET flightshuffle.strategy = '{before}'");
            self.ctx.sql(&restore).await?.collect().await?;
            return Err(e);
        }
        if self.options().storage != storage_before {
            let checked = match self.session_storage() {
                Ok(Some(Some(cfg))) => self.driver.check_store(&cfg).await.map_err(Error::from),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = checked {
                let restore = format!(
                    "SET flightshuffle.storage = '{}'",
                    storage_before.replace('\'', "''")
                );
                self.ctx.sql(&restore).await?.collect().await?;
                return Err(e);
            }
        }
        Ok(text_result("", start.elapsed().as_secs_f64()))
    }

    /// Where this session's exchanges are durable (`SET flightshuffle.storage`): None for the
    /// cluster's store, `Some(None)` for none (`off`), or the store a URL names, with the
    /// cluster's storage options.
    pub(crate) fn session_storage(&self) -> Result<Option<Option<flightshuffle::StorageConfig>>> {
        let url = self.options().storage.trim().to_string();
        match url.as_str() {
            "" => Ok(None),
            "off" => Ok(Some(None)),
            _ => {
                let options = self
                    .driver
                    .storage_config()
                    .map(|c| c.options.clone())
                    .unwrap_or_default();
                Ok(Some(Some(flightshuffle::StorageConfig::new(url, options)?)))
            }
        }
    }

    /// The stages of `sql`; with `analyze`, run it and add rows, bytes, blocks, spill and
    /// time per exchange.
    pub async fn explain(&self, sql: &str, analyze: bool) -> Result<String> {
        self.explain_with(sql, analyze, None).await
    }

    /// [`Self::explain`], with every exchange using `strategy` when given.
    pub async fn explain_with(
        &self,
        sql: &str,
        analyze: bool,
        strategy: Option<Strategy>,
    ) -> Result<String> {
        let staged = self.plan_with(sql, strategy).await?;
        let mut out = staged.display();
        if analyze {
            let start = Instant::now();
            let (batches, stages) = self.execute(&staged).await?;
            out.push_str("\nExchanges:\n");
            for s in &stages {
                let stored = match (s.stored_objects, s.store_gets) {
                    (0, _) => String::new(),
                    (n, 0) => format!(", {n} objects ({} bytes) to the store", s.stored_bytes),
                    (n, g) => format!(
                        ", {n} objects ({} bytes) to the store, {g} ranged GETs",
                        s.stored_bytes
                    ),
                };
                out.push_str(&format!(
                    "  stage {}: {} — {} tasks, {} rows, {} bytes, {} blocks, {} bytes spilled, \
                     largest partition {} bytes (median {}), {:.3}-{:.3} s (first output \
                     {:.3} s); strategy {}{stored}\n",
                    s.stage,
                    s.exchange,
                    s.tasks,
                    s.rows,
                    s.bytes,
                    s.blocks,
                    s.spilled_bytes,
                    s.max_partition_bytes,
                    s.median_partition_bytes,
                    s.start_s,
                    s.end_s,
                    s.first_commit_s,
                    s.strategy
                ));
            }
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            out.push_str(&format!(
                "Result: {rows} rows in {:.3} s, {} Flight calls\n",
                start.elapsed().as_secs_f64(),
                self.last_rpcs()
            ));
        }
        Ok(out)
    }

    pub(crate) fn task_ctx(&self) -> Arc<TaskContext> {
        self.ctx.task_ctx()
    }
}

impl DistributedContext {
    /// The session's `flightshuffle.*` settings.
    pub fn options(&self) -> crate::FlightshuffleOptions {
        let state = self.ctx.state();
        state
            .config()
            .options()
            .extensions
            .get::<crate::FlightshuffleOptions>()
            .cloned()
            .unwrap_or_default()
    }
}

/// Register the Parquet file or directory `path` as table `name` of `ctx`, in place of a
/// table of that name: queries planned meanwhile on other threads see the old table or the
/// new one, never none (the files are listed and their schema read before the swap).
pub async fn replace_parquet(ctx: &SessionContext, name: &str, path: &str) -> Result<()> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let staging = format!("__flightshuffle_staging_{n}");
    ctx.register_parquet(&staging, path, ParquetReadOptions::default())
        .await?;
    let table = ctx.deregister_table(&staging)?.ok_or_else(|| {
        Error::Exchange(flightshuffle::Error::Cluster(format!(
            "table {name} vanished while it was registered"
        )))
    })?;
    ctx.deregister_table(name)?;
    ctx.register_table(name, table)?;
    Ok(())
}

/// The join rewrites the session's settings ask for.
fn join_rewrites(options: &crate::FlightshuffleOptions) -> crate::planner::JoinRewrites {
    crate::planner::JoinRewrites {
        reduce_probe_sides: options.reduce_probe_sides,
        reduce_large_sides: options.reduce_large_sides,
        push_semi_joins: options.push_semi_joins,
        plain_build_rows: options.plain_build_rows,
        small_build_stages_in_place: options.small_build_stages_in_place,
    }
}
