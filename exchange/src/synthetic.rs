//! A deterministic generator of lineitem-like rows (TPC-H column names and types, random
//! values), a worker-side task source: the machine calibration of the `auto` strategy reads it,
//! and so does the shuffle bench (`bench/shuffle`).

use crate::error::{Error, Result};
use crate::source::{BatchSource, BatchStream};
use arrow::array::{
    ArrayRef, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// Task source kind of the lineitem generator ([`LineitemSource`]).
pub const LINEITEM_SOURCE: &str = "lineitem";

const WORDS: &[&str] = &[
    "furiously",
    "quickly",
    "carefully",
    "blithely",
    "slyly",
    "ironic",
    "final",
    "pending",
    "regular",
    "express",
    "special",
    "bold",
    "even",
    "silent",
    "deposits",
    "packages",
    "requests",
    "accounts",
    "theodolites",
    "pinto",
    "beans",
    "instructions",
    "foxes",
    "ideas",
];
const INSTRUCT: &[&str] = &[
    "DELIVER IN PERSON",
    "COLLECT COD",
    "NONE",
    "TAKE BACK RETURN",
];
const MODES: &[&str] = &["REG AIR", "AIR", "RAIL", "SHIP", "TRUCK", "MAIL", "FOB"];

/// A fixed pool of comments (TPC-H style word salad), built once per process.
fn comments() -> &'static [String] {
    static POOL: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let mut rng = SmallRng::seed_from_u64(7);
        (0..4096)
            .map(|_| {
                let n = rng.random_range(2..6);
                let words: Vec<&str> = (0..n)
                    .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                    .collect();
                words.join(" ")
            })
            .collect()
    })
}

/// The schema of the generated rows: TPC-H lineitem's 16 columns.
pub fn lineitem_schema() -> SchemaRef {
    let f = |n: &str, t: DataType| Field::new(n, t, false);
    Arc::new(Schema::new(vec![
        f("l_orderkey", DataType::Int64),
        f("l_partkey", DataType::Int64),
        f("l_suppkey", DataType::Int64),
        f("l_linenumber", DataType::Int32),
        f("l_quantity", DataType::Float64),
        f("l_extendedprice", DataType::Float64),
        f("l_discount", DataType::Float64),
        f("l_tax", DataType::Float64),
        f("l_returnflag", DataType::Utf8),
        f("l_linestatus", DataType::Utf8),
        f("l_shipdate", DataType::Date32),
        f("l_commitdate", DataType::Date32),
        f("l_receiptdate", DataType::Date32),
        f("l_shipinstruct", DataType::Utf8),
        f("l_shipmode", DataType::Utf8),
        f("l_comment", DataType::Utf8),
    ]))
}

/// `rows` rows starting at global row `first` (so map tasks generate disjoint slices).
pub fn lineitem_batch(first: u64, rows: usize, seed: u64) -> Result<RecordBatch> {
    let mut rng = SmallRng::seed_from_u64(seed ^ first.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let orderkey: Int64Array = (0..rows as u64)
        .map(|i| ((first + i) / 4 + 1) as i64)
        .collect();
    let linenumber: Int32Array = (0..rows as u64)
        .map(|i| ((first + i) % 4 + 1) as i32)
        .collect();
    let partkey: Int64Array = (0..rows).map(|_| rng.random_range(1..200_000)).collect();
    let suppkey: Int64Array = (0..rows).map(|_| rng.random_range(1..10_000)).collect();
    let qty: Float64Array = (0..rows).map(|_| rng.random_range(1..=50) as f64).collect();
    let price: Float64Array = (0..rows)
        .map(|_| rng.random_range(90_000..10_500_000) as f64 / 100.0)
        .collect();
    let disc: Float64Array = (0..rows)
        .map(|_| rng.random_range(0..=10) as f64 / 100.0)
        .collect();
    let tax: Float64Array = (0..rows)
        .map(|_| rng.random_range(0..=8) as f64 / 100.0)
        .collect();
    let rf: StringArray = (0..rows)
        .map(|_| Some(["R", "A", "N"][rng.random_range(0..3)]))
        .collect();
    let ls: StringArray = (0..rows)
        .map(|_| Some(["O", "F"][rng.random_range(0..2)]))
        .collect();
    let ship: Vec<i32> = (0..rows).map(|_| rng.random_range(8036..10_561)).collect();
    let commit: Date32Array = ship
        .iter()
        .map(|d| Some(d + rng.random_range(-60..60)))
        .collect();
    let receipt: Date32Array = ship
        .iter()
        .map(|d| Some(d + rng.random_range(1..30)))
        .collect();
    let instruct: StringArray = (0..rows)
        .map(|_| Some(INSTRUCT[rng.random_range(0..INSTRUCT.len())]))
        .collect();
    let mode: StringArray = (0..rows)
        .map(|_| Some(MODES[rng.random_range(0..MODES.len())]))
        .collect();
    let pool = comments();
    let comment: StringArray = (0..rows)
        .map(|_| Some(pool[rng.random_range(0..pool.len())].as_str()))
        .collect();
    let cols: Vec<ArrayRef> = vec![
        Arc::new(orderkey),
        Arc::new(partkey),
        Arc::new(suppkey),
        Arc::new(linenumber),
        Arc::new(qty),
        Arc::new(price),
        Arc::new(disc),
        Arc::new(tax),
        Arc::new(rf),
        Arc::new(ls),
        Arc::new(Date32Array::from(ship)),
        Arc::new(commit),
        Arc::new(receipt),
        Arc::new(instruct),
        Arc::new(mode),
        Arc::new(comment),
    ];
    Ok(RecordBatch::try_new(lineitem_schema(), cols)?)
}

/// Payload of the lineitem source.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct LineitemSlice {
    /// Global index of the slice's first row.
    pub first: u64,
    /// Rows in the slice.
    pub rows: u64,
    /// Seed of the random values (the same seed and rows give the same batches).
    pub seed: u64,
    /// Rows per generated batch.
    pub batch_rows: usize,
    /// Fault injection for tests: attempt 0 of the task waits this long before its first
    /// batch (a straggler that a later attempt of the same task does not reproduce).
    #[serde(default)]
    pub first_attempt_delay_ms: u64,
}

impl LineitemSlice {
    /// The slice's rows, as batches of `batch_rows` rows.
    pub fn batches(self) -> impl Iterator<Item = Result<RecordBatch>> {
        let step = self.batch_rows.max(1) as u64;
        (0..self.rows.div_ceil(step)).map(move |i| {
            let start = i * step;
            let n = step.min(self.rows - start) as usize;
            lineitem_batch(self.first + start, n, self.seed)
        })
    }
}

/// The lineitem generator as a worker-side task source; its payload is a
/// [`LineitemSlice`] as JSON.
pub struct LineitemSource;

impl BatchSource for LineitemSource {
    fn open(
        &self,
        ctx: &crate::source::TaskContext,
        payload: &[u8],
        _schema: SchemaRef,
    ) -> Result<BatchStream> {
        use futures::StreamExt;
        let slice: LineitemSlice = serde_json::from_slice(payload)
            .map_err(|e| Error::invalid(format!("bad lineitem source payload: {e}")))?;
        let batches = futures::stream::iter(slice.batches());
        if ctx.attempt == 0 && slice.first_attempt_delay_ms > 0 {
            let delay = std::time::Duration::from_millis(slice.first_attempt_delay_ms);
            let wait =
                futures::stream::once(tokio::time::sleep(delay)).filter_map(|_| async { None });
            return Ok(Box::pin(wait.chain(batches)));
        }
        Ok(Box::pin(batches))
    }
}
