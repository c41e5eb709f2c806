//! What a distributed query returns: its rows and how each of its exchanges went
//! ([`QueryResult`], [`StageMetrics`], also what the event log records per stage), and the
//! one-column text result of `EXPLAIN` and `SET`.

use arrow::array::{RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use std::sync::Arc;

/// What one exchange moved.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageMetrics {
    /// The stage whose exchange this is.
    pub stage: u32,
    /// The exchange's shuffle id (as the event log names it).
    pub shuffle: String,
    /// How the exchange spreads its rows, e.g. `hash(a, b) into 8`.
    pub exchange: String,
    /// Map tasks the stage ran.
    pub tasks: usize,
    /// Rows the stage wrote into the exchange (its map tasks' input rows).
    pub rows: u64,
    /// Bytes of the blocks the stage's map tasks wrote.
    pub bytes: u64,
    /// Blocks the stage's map tasks wrote.
    pub blocks: usize,
    /// Bytes of those blocks that went to spill files rather than memory.
    pub spilled_bytes: u64,
    /// Bytes of the largest reduce partition and of the median one: a largest partition far
    /// above the median is skew.
    pub max_partition_bytes: u64,
    /// The strategy that ran the exchange; for `auto`, its pick and the predicted times.
    pub strategy: String,
    /// Bytes of the median reduce partition.
    pub median_partition_bytes: u64,
    /// `end_s - start_s`.
    pub seconds: f64,
    /// Seconds since the query started: first task submitted, first map output committed,
    /// last map output committed (sealed). Overlapping intervals are stages that pipelined.
    pub start_s: f64,
    /// Seconds since the query started when the first map output was committed.
    pub first_commit_s: f64,
    /// Seconds since the query started when the last map output was committed.
    pub end_s: f64,
    /// A durable exchange (a cluster with `storage=`): objects written to the store, one per
    /// committed map (0 otherwise).
    pub stored_objects: u64,
    /// Bytes of those objects.
    pub stored_bytes: u64,
    /// Read through the store (strategy `store` or `store-two-level`): the ranged GETs its
    /// readers (and the second level) make, one per object and partition it holds.
    pub store_gets: u64,
}

/// A query's rows and how its exchanges went.
#[derive(Debug, Clone)]
pub struct QueryResult {
    /// The schema of the result rows.
    pub schema: SchemaRef,
    /// The result rows.
    pub batches: Vec<RecordBatch>,
    /// How each stage's exchange went; empty for a query that ran whole on the driver.
    pub stages: Vec<StageMetrics>,
    /// Wall-clock time of the whole query, in seconds.
    pub seconds: f64,
    /// Flight calls the query made (driver to workers and between workers).
    pub rpcs: u64,
    /// Why the query ran whole on the driver although it has exchanges (see
    /// [`crate::sendable`]); None when its stages ran on the workers (or it has none).
    pub on_driver: Option<String>,
    /// The rows were left on the workers rather than read here ([`crate::held`]).
    pub held: Option<Held>,
}

/// A one-column (`plan`) result of `text`, a line per row.
pub(crate) fn text_result(text: &str, seconds: f64) -> QueryResult {
    let schema = Arc::new(Schema::new(vec![Field::new("plan", DataType::Utf8, false)]));
    let lines: StringArray = text.lines().map(Some).collect();
    let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(lines)]);
    QueryResult {
        held: None,
        schema,
        batches: batch.into_iter().collect(),
        stages: vec![],
        seconds,
        rpcs: 0,
        on_driver: None,
    }
}

/// Where a query's rows wait on the workers ([`crate::held`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The exchange holding them (one partition, 0).
    pub shuffle: flightshuffle::block::ShuffleId,
    /// The workers holding some, by slot: (slot, address, rows there).
    pub holders: Vec<(usize, String, u64)>,
    /// Rows in all.
    pub rows: u64,
}
