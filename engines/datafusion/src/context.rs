//! `DistributedContext`: a DataFusion session whose queries run on a flightshuffle cluster.
//! `sql()` plans with DataFusion, cuts the plan into stages, runs every producing stage as map
//! tasks on the workers (pull strategy), then runs the final single-partition step on the
//! driver, reading the last exchange. `EXPLAIN` / `EXPLAIN ANALYZE` print the stages.

use crate::codec::ExchangeCodec;
use crate::planner::{plan_stages, StagedPlan};
use crate::source::StageTask;
use crate::{ExchangeContext, Result, STAGE_SOURCE};
use arrow::array::{RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use datafusion_proto::bytes::physical_plan_to_bytes_with_extension_codec;
use exchange::driver::{Driver, MapInput, ShuffleSpec};
use exchange::proto;
use exchange::strategy::{pull, Strategy, StrategyOptions};
use prost::Message;
use std::sync::Arc;
use std::time::Instant;

/// What one exchange moved.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageMetrics {
    pub stage: u32,
    pub exchange: String,
    pub tasks: usize,
    pub rows: u64,
    pub bytes: u64,
    pub blocks: usize,
    pub spilled_bytes: u64,
    pub seconds: f64,
}

/// A query's rows and how its exchanges went.
#[derive(Debug, Clone)]
pub struct QueryResult {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
    pub stages: Vec<StageMetrics>,
    pub seconds: f64,
}

pub struct DistributedContext {
    ctx: SessionContext,
    driver: Arc<Driver>,
}

impl DistributedContext {
    /// Session settings for a cluster of `workers`: two partitions per worker (so scans split
    /// into that many file groups), no round-robin repartitioning (file groups already spread
    /// the work; each repartition is a network exchange here), plus
    /// [`crate::distributed_options`].
    pub fn default_config(workers: usize) -> SessionConfig {
        let mut config = SessionConfig::new().with_target_partitions((2 * workers).max(2));
        config
            .options_mut()
            .optimizer
            .enable_round_robin_repartition = false;
        crate::distributed_options(config)
    }

    pub fn new(driver: Arc<Driver>, config: SessionConfig) -> Result<Self> {
        let ectx = ExchangeContext::new(
            driver.addresses(),
            driver.token(),
            driver.config().rpc_timeout,
        )?;
        let config = crate::distributed_options(config).with_extension(Arc::new(ectx));
        let ctx = SessionContext::new_with_config(config);
        Ok(DistributedContext { ctx, driver })
    }

    /// The DataFusion session (register tables and functions here).
    pub fn session(&self) -> &SessionContext {
        &self.ctx
    }

    pub fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }

    /// Register a Parquet file or directory as a table. Workers read the same path, so it must
    /// be visible to them (always true on a local cluster).
    pub async fn register_parquet(&self, name: &str, path: &str) -> Result<()> {
        self.ctx
            .register_parquet(name, path, ParquetReadOptions::default())
            .await?;
        Ok(())
    }

    /// Plan `sql` and cut it into stages.
    pub async fn plan(&self, sql: &str) -> Result<StagedPlan> {
        let df = self.ctx.sql(sql).await?;
        let plan = df.create_physical_plan().await?;
        Ok(plan_stages(plan)?)
    }

    /// Run `sql` on the cluster. `EXPLAIN [ANALYZE] <query>` returns the staged plan as text.
    pub async fn sql(&self, sql: &str) -> Result<QueryResult> {
        let trimmed = sql.trim_start();
        let lower = trimmed.to_ascii_lowercase();
        for (prefix, analyze) in [("explain analyze ", true), ("explain ", false)] {
            if lower.starts_with(prefix) {
                let start = Instant::now();
                let text = self.explain(&trimmed[prefix.len()..], analyze).await?;
                return Ok(text_result(&text, start.elapsed().as_secs_f64()));
            }
        }
        let start = Instant::now();
        let staged = self.plan(sql).await?;
        let (batches, stages) = self.execute(&staged).await?;
        Ok(QueryResult {
            schema: staged.root.schema(),
            batches,
            stages,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// The stages of `sql`; with `analyze`, run it and add rows, bytes, blocks, spill and
    /// time per exchange.
    pub async fn explain(&self, sql: &str, analyze: bool) -> Result<String> {
        let staged = self.plan(sql).await?;
        let mut out = staged.display();
        if analyze {
            let start = Instant::now();
            let (batches, stages) = self.execute(&staged).await?;
            out.push_str("\nExchanges:\n");
            for s in &stages {
                out.push_str(&format!(
                    "  stage {}: {} — {} tasks, {} rows, {} bytes, {} blocks, {} bytes spilled, {:.3} s\n",
                    s.stage, s.exchange, s.tasks, s.rows, s.bytes, s.blocks, s.spilled_bytes, s.seconds
                ));
            }
            let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
            out.push_str(&format!(
                "Result: {rows} rows in {:.3} s\n",
                start.elapsed().as_secs_f64()
            ));
        }
        Ok(out)
    }

    fn task_ctx(&self) -> Arc<TaskContext> {
        self.ctx.task_ctx()
    }

    /// Run every stage in dependency order, then the driver's part; frees every shuffle.
    pub async fn execute(
        &self,
        staged: &StagedPlan,
    ) -> Result<(Vec<RecordBatch>, Vec<StageMetrics>)> {
        let result = async {
            let mut metrics = Vec::new();
            for stage in &staged.stages {
                metrics.push(self.run_stage(stage).await?);
            }
            let batches = self
                .driver
                .watch(async {
                    collect(staged.root.clone(), self.task_ctx())
                        .await
                        .map_err(|e| exchange::Error::Task(e.to_string()))
                })
                .await?;
            Ok::<_, crate::Error>((batches, metrics))
        }
        .await;
        for stage in &staged.stages {
            let _ = self.driver.drop_shuffle(stage.writer.shuffle).await;
        }
        result
    }

    async fn run_stage(&self, stage: &crate::planner::Stage) -> Result<StageMetrics> {
        let writer = &stage.writer;
        let spec = ShuffleSpec {
            id: writer.shuffle,
            schema: writer.input().schema(),
            partitions: writer.partitions,
            partitioner: writer.partitioner(),
            checksum_inputs: false,
        };
        self.driver.create_shuffle(&spec).await?;
        let plan = physical_plan_to_bytes_with_extension_codec(
            writer.clone() as Arc<dyn ExecutionPlan>,
            &ExchangeCodec,
        )?
        .to_vec();
        let workers = self.driver.addresses();
        let timeout_secs = self.driver.config().rpc_timeout.as_secs();
        let batch_size = self.ctx.copied_config().batch_size() as u32;
        let inputs = (0..writer.tasks()).map(move |p| {
            let task = StageTask {
                plan: plan.clone(),
                partition: p as u32,
                workers: workers.clone(),
                timeout_secs,
                batch_size,
            };
            MapInput::Source(proto::TaskSource {
                kind: STAGE_SOURCE.into(),
                payload: task.encode_to_vec(),
            })
        });
        tracing::info!(stage = writer.stage, tasks = writer.tasks(), exchange = %writer.describe(), "stage starts");
        let spilled_before = self.spilled().await?;
        let start = Instant::now();
        let inputs = futures::stream::iter(inputs);
        let mapped = match writer.strategy {
            Strategy::Pull => {
                pull::map_side(&self.driver, &spec, inputs, StrategyOptions::default()).await?
            }
        };
        let seconds = start.elapsed().as_secs_f64();
        tracing::info!(
            stage = writer.stage,
            seconds,
            rows = mapped.input.rows,
            "stage done"
        );
        Ok(StageMetrics {
            stage: writer.stage,
            exchange: writer.describe(),
            tasks: mapped.maps.len(),
            rows: mapped.input.rows,
            bytes: mapped
                .maps
                .iter()
                .flat_map(|m| &m.blocks)
                .map(|b| b.meta.bytes)
                .sum(),
            blocks: mapped.maps.iter().map(|m| m.blocks.len()).sum(),
            spilled_bytes: self.spilled().await?.saturating_sub(spilled_before),
            seconds,
        })
    }

    async fn spilled(&self) -> Result<u64> {
        Ok(self
            .driver
            .stats()
            .await?
            .iter()
            .map(|s| s.spilled_bytes)
            .sum())
    }
}

fn text_result(text: &str, seconds: f64) -> QueryResult {
    let schema = Arc::new(Schema::new(vec![Field::new("plan", DataType::Utf8, false)]));
    let lines: StringArray = text.lines().map(Some).collect();
    let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(lines)]);
    QueryResult {
        schema,
        batches: batch.into_iter().collect(),
        stages: vec![],
        seconds,
    }
}
