//! `DistributedContext`: a DataFusion session whose queries run on a flightshuffle cluster.
//! `sql()` plans with DataFusion, cuts the plan into stages and runs them all at once on the
//! workers, pipelined (a consumer stage reads each committed map output of its producers as it
//! arrives; see `flightshuffle::scheduler`), together with the final single-partition step on the
//! driver, which reads the last exchange. `EXPLAIN` / `EXPLAIN ANALYZE` print the stages.

use crate::broadcast::BroadcastJoins;
use crate::codec::ExchangeCodec;
use crate::planner::{plan_stages_with, StagedPlan, SMALL_GATHER_ROWS};
use crate::result::text_result;
pub use crate::result::{QueryResult, StageMetrics};
use crate::skew::{self, SkewConfig};
use crate::source::StageTask;
use crate::writer::ShuffleWriterExec;
use crate::{Error, ExchangeContext, Result, STAGE_SOURCE};
use arrow::array::RecordBatch;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::execution::TaskContext;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use datafusion_proto::bytes::physical_plan_to_bytes_with_extension_codec;
use flightshuffle::driver::{Driver, MapInput, ShuffleSpec};
use flightshuffle::proto;
use flightshuffle::scheduler::{run_pipelined, Deferred, StageRun};
use flightshuffle::strategy::{Strategy, StrategyOptions};
use prost::Message;
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

/// A DataFusion session whose queries run on a flightshuffle cluster through its driver.
pub struct DistributedContext {
    ctx: SessionContext,
    driver: Arc<Driver>,
    last_rpcs: std::sync::Mutex<u64>,
    small_gather_rows: usize,
    /// Every query's work on the workers, the driver only reading the last stage.
    all_on_workers: bool,
    strategy_options: StrategyOptions,
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
        config
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
        let strategy = match strategy {
            Some(s) => s,
            None => self.session_strategy()?,
        };
        let df = self.ctx.sql(sql).await?;
        let plan = df.create_physical_plan().await?;
        let mut staged = match self.all_on_workers {
            true => crate::planner::on_workers(plan_stages_with(plan.clone(), 0)?),
            false => plan_stages_with(plan.clone(), self.small_gather_rows)?,
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
            return self.run_query(sql, strategy, start).await;
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
        let result = self.run_query(sql, strategy, start).await;
        match &result {
            Ok(r) => {
                for s in &r.stages {
                    log.write("stage", serde_json::to_value(s).unwrap_or_default());
                }
                let rows: usize = r.batches.iter().map(|b| b.num_rows()).sum();
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
    ) -> Result<QueryResult> {
        // A worker lost while the stages run is recovered by the scheduler (only the missing
        // maps run again, see `flightshuffle::scheduler`). If that fails too (lost again and
        // again, or while planning), the query runs again, whole, once the lost worker's
        // replacement is up: it reads its inputs again, so nothing is counted twice. At most
        // QUERY_RETRIES times.
        let mut retries = 0;
        let (staged, batches, stages) = loop {
            // Plans and tasks name the workers' addresses: a lost worker's replacement (found
            // lost after the last query, say) must be in place before they are made.
            self.driver
                .wait_all_live(flightshuffle::driver::REPLACE_TIMEOUT)
                .await?;
            let replacements = self.driver.replacements();
            let run = async {
                let staged = self.plan_with(sql, strategy).await?;
                let (batches, stages) = self.execute(&staged).await?;
                Ok::<_, Error>((staged, batches, stages))
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
    fn session_storage(&self) -> Result<Option<Option<flightshuffle::StorageConfig>>> {
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

    /// Run every stage and the driver's part at once (pipelined, see
    /// [`flightshuffle::scheduler`]); frees every shuffle, whatever the outcome.
    pub async fn execute(
        &self,
        staged: &StagedPlan,
    ) -> Result<(Vec<RecordBatch>, Vec<StageMetrics>)> {
        // `auto` calibrates the machine once, before any stage of the query runs (a
        // calibration taken under a running stage's load would be kept for good).
        if staged
            .stages
            .iter()
            .any(|s| s.writer.strategy == flightshuffle::strategy::Strategy::Auto)
        {
            self.driver.calibration().await?;
        }
        let started = Instant::now();
        let rpcs_before = self.rpcs().await;
        let skew = self.skew_config();
        let combine = self.options().combine;
        let shuffle_of = |stage: &u32| {
            staged
                .stages
                .iter()
                .find(|s| s.id() == *stage)
                .map(|s| s.writer.shuffle)
        };
        let runs = staged
            .stages
            .iter()
            .map(|s| {
                let mut run = self.stage_run(s, &skew, combine)?;
                run.reads = s.inputs.iter().filter_map(shuffle_of).collect();
                Ok(run)
            })
            .collect::<Result<Vec<_>>>()?;
        let root_reads: Vec<_> = staged.root_inputs.iter().filter_map(shuffle_of).collect();
        if let Some(store) = self.session_storage()? {
            for run in &runs {
                self.driver.use_storage(run.spec.id, store.as_ref())?;
            }
        }
        // Made again when a lost worker's stages were finished (the first one's rows dropped).
        let root = || async {
            collect(staged.root.clone(), self.task_ctx())
                .await
                .map_err(root_error)
        };
        let result = run_pipelined(
            &self.driver,
            runs,
            &root_reads,
            root,
            started,
            self.strategy_options,
        )
        .await;
        let drops = staged
            .stages
            .iter()
            .map(|s| self.driver.drop_shuffle(s.writer.shuffle));
        let _ = futures::future::join_all(drops).await;
        let (batches, reports) = result?;
        let rpcs = match (rpcs_before, self.rpcs().await) {
            (Some(a), Some(b)) => b.saturating_sub(a + self.driver.num_workers() as u64),
            _ => 0,
        };
        *self.last_rpcs.lock().unwrap_or_else(|p| p.into_inner()) = rpcs;
        let metrics = staged
            .stages
            .iter()
            .zip(reports)
            .map(|(s, r)| StageMetrics {
                stage: s.writer.stage,
                shuffle: r.shuffle.clone(),
                exchange: s.writer.describe(),
                tasks: r.tasks,
                rows: r.rows,
                bytes: r.bytes,
                blocks: r.blocks,
                spilled_bytes: r.spilled_bytes,
                max_partition_bytes: r.max_partition_bytes,
                strategy: r.strategy.clone(),
                median_partition_bytes: r.median_partition_bytes,
                seconds: r.end_s - r.start_s,
                start_s: r.start_s,
                first_commit_s: r.first_commit_s,
                end_s: r.end_s,
                stored_objects: r.stored_objects,
                stored_bytes: r.stored_bytes,
                store_gets: r.store_gets,
            })
            .collect();
        Ok((batches, metrics))
    }

    /// Flight calls the workers served so far (None if stats are unavailable).
    async fn rpcs(&self) -> Option<u64> {
        let stats = self.driver.stats().await.ok()?;
        Some(stats.iter().map(|s| s.rpcs).sum())
    }

    /// Flight calls the last query made (driver to workers and between workers).
    pub fn last_rpcs(&self) -> u64 {
        *self.last_rpcs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One stage as the scheduler runs it: its shuffle and its map tasks, one per worker
    /// ([`crate::writer::ShuffleWriterExec::task_groups`]). A stage that can split a skewed
    /// probe side ([`crate::skew`]) is deferred until its probe producer is sealed.
    fn stage_run(
        &self,
        stage: &crate::planner::Stage,
        skew: &SkewConfig,
        combine: bool,
    ) -> Result<StageRun> {
        let writer = &stage.writer;
        let spec = ShuffleSpec {
            id: writer.shuffle,
            schema: writer.input().schema(),
            partitions: writer.partitions,
            partitioner: writer.partitioner(),
            checksum_inputs: false,
            combine: match combine {
                true => crate::combine::spec_for(writer)?,
                false => None,
            },
        };
        let tasks = TaskBuilder {
            workers: self.driver.addresses(),
            timeout_secs: self.driver.config().rpc_timeout.as_secs(),
            batch_size: self.ctx.copied_config().batch_size() as u32,
        };
        // A sorted-run exchange's readers read each map output as one run: merging runs would
        // break them, so such an exchange moves its blocks with pull whatever it asks for.
        let strategy = match writer.kind {
            crate::writer::WriterKind::Merge => flightshuffle::strategy::Strategy::Pull,
            _ => writer.strategy,
        };
        let split = skew.enabled().then(|| skew::candidate(writer)).flatten();
        let Some((probe_stage, probe)) = split else {
            return Ok(StageRun {
                spec,
                inputs: tasks.inputs(writer)?,
                strategy,
                deferred: None,
                reads: Vec::new(),
                refresh: Some(Arc::new(refresh_workers)),
            });
        };
        let (writer, skew) = (writer.clone(), *skew);
        let decide = move |bytes: &[u64]| {
            let task_err = |e: Error| flightshuffle::Error::Task(e.to_string());
            match skew::decide(bytes, &skew) {
                None => Ok((tasks.inputs(&writer).map_err(task_err)?, String::new())),
                Some((layout, note)) => {
                    let split =
                        skew::apply(&writer, probe, &layout).map_err(|e| task_err(e.into()))?;
                    let inputs = tasks.inputs(&split).map_err(task_err)?;
                    Ok((inputs, format!("{note}, reading stage {probe_stage}")))
                }
            }
        };
        Ok(StageRun {
            spec,
            inputs: vec![],
            strategy,
            deferred: Some(Deferred {
                after: probe,
                decide: Box::new(decide),
            }),
            reads: Vec::new(),
            refresh: Some(Arc::new(refresh_workers)),
        })
    }

    /// [`Self::stage_run`] without skew splits or combining: a stage of an online query.
    pub(crate) fn stage_run_plain(&self, stage: &crate::planner::Stage) -> Result<StageRun> {
        let off = SkewConfig {
            factor: 0.0,
            min_bytes: u64::MAX,
            max_splits: 1,
        };
        self.stage_run(stage, &off, self.options().combine)
    }

    /// The knobs stages run with.
    pub(crate) fn strategy_options(&self) -> StrategyOptions {
        self.strategy_options
    }

    /// Skew-split settings of the session (`SET flightshuffle.skew_factor` and
    /// `flightshuffle.skew_min_bytes`).
    pub fn skew_config(&self) -> SkewConfig {
        let o = self.options();
        SkewConfig {
            factor: o.skew_factor,
            min_bytes: o.skew_min_bytes,
            max_splits: 2 * self.driver.num_workers() as u32,
        }
    }
}

impl DistributedContext {
    /// The session's `flightshuffle.*` settings.
    fn options(&self) -> crate::FlightshuffleOptions {
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

/// Builds a stage's map tasks: one per worker, each running a group of the stage's partitions.
#[derive(Clone)]
struct TaskBuilder {
    workers: Vec<String>,
    timeout_secs: u64,
    batch_size: u32,
}

impl TaskBuilder {
    fn inputs(&self, writer: &Arc<ShuffleWriterExec>) -> Result<Vec<MapInput>> {
        let plan = physical_plan_to_bytes_with_extension_codec(
            writer.clone() as Arc<dyn ExecutionPlan>,
            &ExchangeCodec,
        )?
        .to_vec();
        Ok(writer
            .task_groups(self.workers.len())
            .into_iter()
            .map(|partitions| {
                let task = StageTask {
                    plan: plan.clone(),
                    partitions,
                    workers: self.workers.clone(),
                    timeout_secs: self.timeout_secs,
                    batch_size: self.batch_size,
                };
                MapInput::Source(proto::TaskSource {
                    kind: STAGE_SOURCE.into(),
                    payload: task.encode_to_vec(),
                })
            })
            .collect())
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

/// A failure of the driver's part as an exchange error: a lost worker, a failed call or a
/// timeout underneath stays one (so the scheduler can tell a loss and recover); anything
/// else is a task error.
fn root_error(e: datafusion::error::DataFusionError) -> flightshuffle::Error {
    use flightshuffle::Error as X;
    let text = e.to_string();
    let e = Error::from(e);
    match e.exchange() {
        Some(X::WorkerLost {
            worker,
            addr,
            reason,
            lost_blocks,
        }) => X::WorkerLost {
            worker: *worker,
            addr: addr.clone(),
            reason: reason.clone(),
            lost_blocks: *lost_blocks,
        },
        Some(X::Remote {
            worker,
            addr,
            code,
            message,
        }) => X::Remote {
            worker: *worker,
            addr: addr.clone(),
            code: *code,
            message: message.clone(),
        },
        Some(X::Timeout { what, seconds }) => X::Timeout {
            what: what.clone(),
            seconds: *seconds,
        },
        _ => X::Task(text),
    }
}

/// A stage task made for the workers' addresses now (a lost worker's replacement has
/// another); any other input as it is.
fn refresh_workers(input: MapInput, workers: &[String]) -> MapInput {
    let MapInput::Source(mut source) = input else {
        return input;
    };
    if source.kind == STAGE_SOURCE {
        if let Ok(mut task) = StageTask::decode(source.payload.as_slice()) {
            task.workers = workers.to_vec();
            source.payload = task.encode_to_vec();
        }
    }
    MapInput::Source(source)
}
