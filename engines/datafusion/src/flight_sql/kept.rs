//! What the Flight SQL endpoint keeps between calls: query results waiting to be read from
//! the driver, and online aggregations being polled (`PollFlightInfo`) with the rounds they
//! made so far.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a query's rows wait for a client to read them.
pub const RESULT_TTL: Duration = Duration::from_secs(600);
/// Results kept at once (the oldest goes first).
pub const MAX_RESULTS: usize = 64;

/// A query's rows waiting to be read: each endpoint's batches, taken when read.
pub struct Kept {
    pub at: Instant,
    pub chunks: Vec<Option<Vec<RecordBatch>>>,
    pub schema: SchemaRef,
}

/// Results kept on the driver, by handle.
pub type KeptResults = Arc<Mutex<HashMap<String, Kept>>>;

/// Keep `kept` under handle `id`, after dropping results past [`RESULT_TTL`] and the oldest
/// beyond [`MAX_RESULTS`].
pub fn keep(results: &KeptResults, id: String, kept: Kept) {
    let mut all = results.lock().unwrap_or_else(|p| p.into_inner());
    all.retain(|_, k| k.at.elapsed() < RESULT_TTL);
    while all.len() >= MAX_RESULTS {
        let oldest = all.iter().min_by_key(|(_, k)| k.at).map(|(h, _)| h.clone());
        match oldest {
            Some(h) => all.remove(&h),
            None => break,
        };
    }
    all.insert(id, kept);
}

/// The rounds of an online aggregation: each the fraction of the input read so far and the
/// estimates then (one row per group: keys, each aggregate's estimate and interval, the
/// round), or why it failed; the last round is exact.
pub type Rounds = Box<dyn Iterator<Item = Result<(f64, RecordBatch), String>> + Send>;

/// Starts online aggregation of a query (called on a blocking thread): its rounds, or None
/// when online aggregation does not run that query (it then runs whole).
pub type OnlineRunner = Arc<dyn Fn(&str) -> Result<Option<Rounds>, String> + Send + Sync>;

/// An online aggregation being polled.
pub struct Polled {
    pub at: Instant,
    /// Each round made so far: the fraction read, the handle of its kept estimates, rows.
    pub rounds: Vec<(f64, String, usize)>,
    pub schema: Option<SchemaRef>,
    pub done: bool,
    pub error: Option<String>,
    /// Bumped whenever a round is added or the aggregation ends.
    pub changed: tokio::sync::watch::Sender<usize>,
}

/// The online aggregations being polled, by handle.
pub type Polls = Arc<Mutex<HashMap<String, Polled>>>;
