#![warn(missing_docs)]
//! `flightshuffle-datafusion`: flightshuffle as the distributed exchange of Apache DataFusion.
//!
//! The physical plan DataFusion makes for one process is cut into a DAG of stages at every
//! boundary where rows move between partitions ([`planner`]); each producing stage is rooted at a
//! [`writer::ShuffleWriterExec`] and each consuming stage reads through
//! [`reader::ShuffleReaderExec`] leaves. Stage plans travel to workers with `datafusion-proto`
//! and [`codec::ExchangeCodec`]; workers run stage partitions as map tasks through the
//! exchange's `BatchSource` ([`source::StageSource`]). [`context::DistributedContext`] is the
//! entry point: `sql()` runs distributed, `explain()` shows the stages.

pub mod broadcast;
pub mod build_bounds;
pub mod build_keys;
pub mod codec;
pub mod combine;
pub mod context;
pub mod distinct_counts;
pub mod double;
pub mod execute;
pub mod fact_side;
pub mod flight_sql;
pub mod fold;
pub mod gathers;
pub mod held;
pub mod join_order;
pub mod key_filter;
pub mod key_trace;
pub mod online;
pub mod planner;
pub mod pool;
pub mod reader;
pub mod result;
pub mod running;
pub mod semi_pushdown;
pub mod sendable;
pub mod side_reduction;
pub mod skew;
pub mod source;
pub mod split;
pub mod split_totals;
pub mod subtree;
pub mod unit_builds;
pub mod writer;

use datafusion::prelude::SessionConfig;
use flightshuffle::source::{ShuffleReader, SourceRegistry};
use std::sync::Arc;

pub use context::{DistributedContext, QueryResult, StageMetrics};

/// Task source kind of a DataFusion stage partition.
pub const STAGE_SOURCE: &str = "datafusion-stage";

/// Errors of the distributed SQL layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error from DataFusion (planning or executing a plan).
    #[error(transparent)]
    DataFusion(#[from] datafusion::error::DataFusionError),
    /// An error from the exchange (driver, workers, transport).
    #[error(transparent)]
    Exchange(#[from] flightshuffle::Error),
}

/// The result type of the distributed SQL layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The exchange error underneath, if this came out of the exchange.
    pub fn exchange(&self) -> Option<&flightshuffle::Error> {
        match self {
            Error::Exchange(e) => Some(e),
            Error::DataFusion(e) => match e.find_root() {
                datafusion::error::DataFusionError::External(inner) => inner.downcast_ref(),
                _ => None,
            },
        }
    }
}

/// Settings every session taking part in a distributed query needs, on the driver and on the
/// workers alike. Each stage partition runs as an isolated task, so nothing may coordinate
/// sibling partitions inside one plan instance: scans must not steal sibling file groups and
/// joins must not wait at the dynamic-filter barrier for siblings that run elsewhere.
pub fn distributed_options(mut config: SessionConfig) -> SessionConfig {
    let opts = config.options_mut();
    opts.execution.enable_file_stream_work_stealing = false;
    opts.optimizer.enable_dynamic_filter_pushdown = false;
    opts.optimizer.enable_join_dynamic_filter_pushdown = false;
    opts.optimizer.enable_topk_dynamic_filter_pushdown = false;
    opts.optimizer.enable_aggregate_dynamic_filter_pushdown = false;
    // Uncorrelated scalar subqueries become joins rather than a ScalarSubqueryExec whose
    // expressions could land in another stage than the node that fills them.
    opts.optimizer.enable_physical_uncorrelated_scalar_subquery = false;
    config
}

datafusion::common::extensions_options! {
    /// flightshuffle's session settings, set with `SET flightshuffle.<name> = '<value>'`.
    pub struct FlightshuffleOptions {
        /// Strategy of every exchange of the following queries: `pull`, `merged`, `push`,
        /// `two-level` or `auto` (empty: the cluster's default).
        pub strategy: String, default = String::new()
        /// Skew splits of join probe sides: a partition over this many times the median
        /// (and over `skew_min_bytes`) is split across several tasks (3 is a good value);
        /// 0, the default, turns them off. A stage that could split waits for its probe
        /// side's producer to finish instead of pipelining with it, which cost more than the
        /// split saved in `flightshuffle skew-bench` on 2 cores (docs/bench/strategies.md).
        pub skew_factor: f64, default = 0.0
        /// Partitions under this many bytes are never split.
        pub skew_min_bytes: u64, default = 64 * 1024 * 1024
        /// In-exchange combining: exchanges of partial aggregates combine rows with equal
        /// group keys in map buffers and merges (`crate::combine`).
        pub combine: bool, default = true
        /// Where the exchanges of the following queries are durable: an object store URL
        /// (`s3://bucket/prefix`, `file:///dir`; it takes the cluster's storage options),
        /// `off` for none, or empty (the default) for the cluster's `storage=`.
        pub storage: String, default = String::new()
        /// Inner joins with filtered inputs join a chain's first input before the joins that
        /// do not reduce it ([`crate::join_order`]), so a stage's scan is reduced by them
        /// where no dynamic filter from another stage can reach it.
        pub selective_joins_first: bool, default = true
        /// A query whose scans together read at most this many rows (DataFusion's
        /// statistics, from the Parquet footers) runs whole on the driver, as one process:
        /// below it, the stages, their calls and the hops cost more than spreading the work
        /// saves (`docs/bench/small-queries.md`). 0 distributes every query.
        pub small_query_rows: u64, default = 2_000_000
        /// A broadcast join that emits its build side's rows (`EXISTS`, `NOT EXISTS`, a
        /// left join with the small side first) is hash-partitioned to run as independent
        /// tasks; its probe side is first cut down to the rows that meet the build side (a
        /// broadcast semi join), so only those cross the network (`crate::planner`).
        pub reduce_probe_sides: bool, default = true
        /// A partitioned join whose one side is much larger than the other (by DataFusion's
        /// estimates) and never emits its unmatched rows (`NOT EXISTS`'s subquery side, a
        /// semi join's) has that side cut down to the rows meeting the other's keys before
        /// its exchange (`crate::side_reduction`); where the estimates are too close to tell
        /// and the smaller side filters rows, by a key filter decided when the task runs
        /// (`crate::key_filter`).
        pub reduce_large_sides: bool, default = true
        /// A broadcast semi join (`IN (subquery)`) over an inner join is copied below it onto
        /// both of its inputs, so only rows that can meet the subquery's keys are exchanged
        /// (`crate::semi_pushdown`).
        pub push_semi_joins: bool, default = true
        /// A broadcast join's build-side key bounds go to the scans below its probe side in
        /// the same stage, placed by each worker, so they skip the row groups no key can meet
        /// (`crate::build_bounds`; one process does this with DataFusion's dynamic filters).
        pub build_bounds: bool, default = true
        /// A broadcast join's build side that only reads columns of a table, every row (no
        /// filter, limit, computed expression, join or aggregate), at most this many rows, is
        /// read by each of its consumers (each worker) from the files instead of being cut into
        /// a stage of its own (0: only build sides of at most 128 Ki rows are).
        pub plain_build_rows: u64, default = crate::planner::PLAIN_SCAN_GATHER_ROWS
        /// A broadcast join's build side with exchanges inside (an aggregate: a scalar
        /// subquery's value) whose every node DataFusion estimates at most 128 Ki rows, its
        /// scans too, is computed whole by each worker instead of cut into stages.
        pub small_build_stages_in_place: bool, default = true
        /// Online aggregation: a broadcast join's build side over a table stored in the
        /// order of its join key with the sampled table is read per sampling unit, only the
        /// pages whose key statistics meet the unit's, instead of built whole before the
        /// first estimate (`crate::unit_builds`).
        pub unit_builds: bool, default = true
        /// Online aggregation: a broadcast build side is cut down to the keys a filtered
        /// join below it on the fact table's path already allows (TPC-H Q9's `partsupp` to
        /// its green parts' keys; `crate::build_keys`).
        pub narrow_builds: bool, default = true
    }
}

impl datafusion::config::ConfigExtension for FlightshuffleOptions {
    const PREFIX: &'static str = "flightshuffle";
}

/// A worker's task sources: the exchange's built-ins plus DataFusion stages.
pub fn worker_sources() -> SourceRegistry {
    let mut r = flightshuffle::worker::builtin_sources();
    r.register(STAGE_SOURCE, Arc::new(source::StageSource::default()));
    r.register_reducer(online::PARTIAL_FOLD, Arc::new(online::PartialFold));
    r.register_combiner(
        combine::PARTIAL_REDUCE,
        Arc::new(combine::PartialReduceKind),
    );
    r
}

/// What a shuffle reader needs at execution time (a DataFusion session-config extension):
/// the workers to read from and the process's pooled reader (on a worker, blocks it holds
/// itself are read from its store).
pub struct ExchangeContext {
    workers: Vec<String>,
    /// On the driver: the workers are the driver's now (a lost worker's slot gets its
    /// replacement's address), not a list fixed when the session was made.
    driver: Option<Arc<flightshuffle::driver::Driver>>,
    /// The reader that fetches blocks (on a worker, its own blocks come from its store).
    pub reader: Arc<dyn ShuffleReader>,
}

impl ExchangeContext {
    /// On a worker: the peers a task was given.
    pub fn new(workers: Vec<String>, reader: Arc<dyn ShuffleReader>) -> Self {
        ExchangeContext {
            workers,
            driver: None,
            reader,
        }
    }

    /// On the driver: the driver's workers at each use.
    pub fn of_driver(driver: Arc<flightshuffle::driver::Driver>) -> Self {
        ExchangeContext {
            workers: Vec::new(),
            reader: driver.reader(),
            driver: Some(driver),
        }
    }

    /// The workers' addresses, by slot.
    pub fn workers(&self) -> Vec<String> {
        match &self.driver {
            Some(d) => d.addresses(),
            None => self.workers.clone(),
        }
    }
}

impl std::fmt::Debug for ExchangeContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExchangeContext")
            .field("workers", &self.workers())
            .finish()
    }
}

/// DataFusion errors from exchange errors, keeping the original for callers to inspect.
pub(crate) fn df_err(e: flightshuffle::Error) -> datafusion::error::DataFusionError {
    datafusion::error::DataFusionError::External(Box::new(e))
}
