//! Map inputs the driver keeps, so a map output lost with its worker can be recomputed.
//!
//! Lineage recovery (Exoshuffle §3.2) re-runs a lost map from its input. A worker-side source
//! (a dataset split, a SQL stage's task, a generator) can run again anywhere; batches a user
//! handed to the driver (`Cluster.shuffle` of a pyarrow Table, a Polars frame, a DuckDB
//! relation or any stream) exist only there. We keep a replayable copy of them rather than
//! parity: a copy costs no network traffic and no extra work on the workers, the batches of an
//! in-memory table are shared with the caller's (no copy at all), and a stream's are kept up
//! to [`KEEP_MEMORY`] bytes per process, then written to an Arrow IPC file in the driver's
//! temporary directory ([`Kept`] removes it when dropped; a driver killed before that leaves a
//! directory named after its pid, swept by the next driver).
//!
//! A [`KeptInput`] is one map's input: the batches of the channel it is fed from, recorded as
//! the first attempt reads them. A retry (after the worker running the attempt was lost, or
//! after its committed output was lost) reads what was recorded and then the rest of the
//! channel, so a map lost half-way through its input loses nothing.

use crate::error::{Error, Result};
use crate::source::BatchStream;
use crate::sync::lock;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Bytes of kept inputs held in memory per process before further inputs go to disk
/// (`FLIGHTSHUFFLE_KEEP_MEMORY` overrides it, in bytes).
pub const KEEP_MEMORY: u64 = 1 << 30;

static IN_MEMORY: AtomicU64 = AtomicU64::new(0);
/// The allowance set by [`set_keep_memory`] (u64::MAX: from the environment or the default).
static LIMIT: AtomicU64 = AtomicU64::new(u64::MAX);

fn keep_memory() -> u64 {
    match LIMIT.load(Ordering::SeqCst) {
        u64::MAX => std::env::var("FLIGHTSHUFFLE_KEEP_MEMORY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(KEEP_MEMORY),
        set => set,
    }
}

/// Set the bytes of kept inputs held in memory in this process (see [`KEEP_MEMORY`]).
#[cfg(test)]
pub fn set_keep_memory(bytes: u64) {
    LIMIT.store(bytes.min(u64::MAX - 1), Ordering::SeqCst);
}

/// This process's directory for kept inputs written to disk: made exclusively with a random
/// name (`flightshuffle-kept-<pid>-<random>`, mode 0700, never an existing directory) the
/// first time it is needed; stale ones (their driver died) are removed then.
fn kept_dir() -> Result<PathBuf> {
    static DIR: std::sync::OnceLock<std::result::Result<PathBuf, String>> =
        std::sync::OnceLock::new();
    let base = std::env::temp_dir();
    DIR.get_or_init(|| {
        sweep_stale(&base);
        tempfile::Builder::new()
            .prefix(&format!("flightshuffle-kept-{}-", std::process::id()))
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .tempdir_in(&base)
            .map(|d| d.keep())
            .map_err(|e| format!("cannot make a private directory in {}: {e}", base.display()))
    })
    .clone()
    .map_err(Error::Cluster)
}

/// Remove `flightshuffle-kept-<pid>` directories of processes that no longer exist (a local
/// cluster does it when it starts, like its spill roots).
pub fn sweep_stale(base: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("flightshuffle-kept-") else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or_default();
        let dead = pid
            .parse::<u32>()
            .is_ok_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists());
        if dead {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Where the recorded batches are.
enum Kept {
    /// In memory, with the bytes counted against [`KEEP_MEMORY`].
    Memory(Vec<RecordBatch>, u64),
    /// Written to this IPC file once the input ended (memory was over [`KEEP_MEMORY`]).
    Disk(PathBuf),
}

impl Drop for Kept {
    fn drop(&mut self) {
        match self {
            Kept::Memory(_, bytes) => {
                IN_MEMORY.fetch_sub(*bytes, Ordering::SeqCst);
            }
            Kept::Disk(path) => {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

struct State {
    kept: Kept,
    /// The channel has ended (every batch is recorded).
    ended: bool,
    /// The input failed (the caller's iterator raised): every replay fails the same way.
    failed: Option<String>,
}

/// What a kept input is fed from: batches with the bytes each counts as.
pub type Feed = mpsc::Receiver<(Result<RecordBatch>, u64)>;

/// One map's input, kept for replay (see the module doc).
pub struct KeptInput {
    schema: SchemaRef,
    state: Mutex<State>,
    /// The rest of the input; one reader at a time (an attempt).
    rx: tokio::sync::Mutex<Option<Feed>>,
}

impl std::fmt::Debug for KeptInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = lock(&self.state);
        let (batches, on_disk) = match &st.kept {
            Kept::Memory(b, _) => (b.len(), false),
            Kept::Disk(_) => (0, true),
        };
        f.debug_struct("KeptInput")
            .field("batches", &batches)
            .field("on_disk", &on_disk)
            .field("ended", &st.ended)
            .finish_non_exhaustive()
    }
}

impl KeptInput {
    /// An input fed by `rx`: each batch with the bytes it is counted as (its share of a
    /// larger batch it was sliced from, not the shared buffers' size).
    pub fn new(schema: SchemaRef, rx: Feed) -> Arc<Self> {
        Arc::new(KeptInput {
            schema,
            state: Mutex::new(State {
                kept: Kept::Memory(Vec::new(), 0),
                ended: false,
                failed: None,
            }),
            rx: tokio::sync::Mutex::new(Some(rx)),
        })
    }

    /// Whether the whole input has been read once (a replay needs nothing from the caller).
    pub fn complete(&self) -> bool {
        lock(&self.state).ended
    }

    /// The input from its first batch: what was recorded, then the rest of the channel
    /// (recorded as it is read).
    pub fn stream(self: &Arc<Self>) -> BatchStream {
        let me = self.clone();
        Box::pin(futures::stream::try_unfold(
            (me, None::<Vec<RecordBatch>>, 0usize),
            |(me, mut disk, read)| async move {
                // Batch `read` if it was recorded; the channel is read one attempt at a time.
                if let Some(next) = me.at(read, &mut disk)? {
                    return Ok(next.map(|b| (b, (me, disk, read + 1))));
                }
                let guard = me.clone();
                let mut rx = guard.rx.lock().await;
                // Another attempt may have recorded it while this one waited.
                if let Some(next) = me.at(read, &mut disk)? {
                    return Ok(next.map(|b| (b, (me, disk, read + 1))));
                }
                let Some(channel) = rx.as_mut() else {
                    return Ok(None);
                };
                match channel.recv().await {
                    Some((Ok(b), bytes)) => {
                        me.record(b.clone(), bytes);
                        Ok(Some((b, (me, disk, read + 1))))
                    }
                    Some((Err(e), _)) => {
                        lock(&me.state).failed = Some(e.to_string());
                        *rx = None;
                        Err(e)
                    }
                    None => {
                        *rx = None;
                        me.end()?;
                        Ok(None)
                    }
                }
            },
        ))
    }

    /// Recorded batch `i`: `Some(Some(b))`; `Some(None)` past the end of a finished input;
    /// `None` when it is still to be read from the channel. `disk` caches a written input.
    fn at(
        &self,
        i: usize,
        disk: &mut Option<Vec<RecordBatch>>,
    ) -> Result<Option<Option<RecordBatch>>> {
        if let Some(all) = disk {
            return Ok(Some(all.get(i).cloned()));
        }
        let path = {
            let st = lock(&self.state);
            match &st.kept {
                Kept::Memory(b, _) if i < b.len() => return Ok(Some(Some(b[i].clone()))),
                Kept::Memory(..) if st.failed.is_some() => {
                    return Err(Error::Task(format!(
                        "the map input failed: {}",
                        st.failed.clone().unwrap_or_default()
                    )))
                }
                Kept::Memory(..) if st.ended => return Ok(Some(None)),
                Kept::Memory(..) => return Ok(None),
                Kept::Disk(p) => p.clone(),
            }
        };
        let file = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::BufReader::new(file), None)?;
        let all = reader.collect::<std::result::Result<Vec<_>, _>>()?;
        let b = all.get(i).cloned();
        *disk = Some(all);
        Ok(Some(b))
    }

    fn record(&self, batch: RecordBatch, bytes: u64) {
        let mut st = lock(&self.state);
        if let Kept::Memory(batches, counted) = &mut st.kept {
            batches.push(batch);
            *counted += bytes;
            IN_MEMORY.fetch_add(bytes, Ordering::SeqCst);
        }
    }

    /// The channel ended: past the memory allowance, write the batches to disk.
    fn end(&self) -> Result<()> {
        let mut st = lock(&self.state);
        st.ended = true;
        let written = match &st.kept {
            Kept::Memory(batches, counted)
                if !batches.is_empty() && IN_MEMORY.load(Ordering::SeqCst) > keep_memory() =>
            {
                static FILES: AtomicU64 = AtomicU64::new(0);
                let path =
                    kept_dir()?.join(format!("{}.arrow", FILES.fetch_add(1, Ordering::SeqCst)));
                match write_ipc(&path, &self.schema, batches) {
                    Ok(()) => {
                        tracing::debug!(path = %path.display(), bytes = counted, "kept map input written to disk");
                        Some(path)
                    }
                    // Kept in memory rather than lost (a full disk here is not fatal).
                    Err(e) => {
                        let _ = std::fs::remove_file(&path);
                        tracing::warn!(error = %e, "could not write a kept map input to disk; kept in memory");
                        None
                    }
                }
            }
            _ => None,
        };
        if let Some(path) = written {
            st.kept = Kept::Disk(path);
        }
        Ok(())
    }
}

fn write_ipc(path: &std::path::Path, schema: &SchemaRef, batches: &[RecordBatch]) -> Result<()> {
    let file = crate::private::create_file(path)?;
    let mut w = arrow::ipc::writer::FileWriter::try_new(std::io::BufWriter::new(file), schema)?;
    for b in batches {
        w.write(b)?;
    }
    w.finish()?;
    Ok(())
}

/// Bytes of kept inputs in memory in this process now.
pub fn in_memory() -> u64 {
    IN_MEMORY.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use futures::StreamExt;

    fn batch(i: i64) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![i, i + 1]))]).unwrap()
    }

    async fn all(k: &Arc<KeptInput>) -> Result<Vec<RecordBatch>> {
        k.stream().collect::<Vec<_>>().await.into_iter().collect()
    }

    /// An attempt that stopped half-way, then retries: every retry gets the whole input in
    /// order, once; past the memory allowance the input goes to disk and comes back equal,
    /// and the file goes with the input; a failed input fails every replay.
    #[tokio::test]
    async fn replays_give_the_whole_input_in_order_from_memory_or_disk() {
        let want: Vec<RecordBatch> = (0..5).map(|i| batch(i * 10)).collect();
        for limit in [u64::MAX - 1, 0] {
            set_keep_memory(limit);
            let (tx, rx) = mpsc::channel(8);
            for b in &want {
                tx.send((Ok(b.clone()), 100)).await.unwrap();
            }
            drop(tx);
            let k = KeptInput::new(want[0].schema(), rx);
            let first: Vec<_> = k.stream().take(2).collect().await;
            assert_eq!(first.len(), 2);
            assert!(!k.complete());
            assert_eq!(all(&k).await.unwrap(), want);
            assert!(k.complete());
            assert_eq!(all(&k).await.unwrap(), want);
            let file = match &lock(&k.state).kept {
                Kept::Disk(p) => Some(p.clone()),
                Kept::Memory(..) => None,
            };
            assert_eq!(file.is_some(), limit == 0, "on disk past the allowance");
            drop(k);
            if let Some(f) = file {
                assert!(!f.exists(), "the kept file goes with its input");
            }
        }
        set_keep_memory(u64::MAX - 1);
        let (tx, rx) = mpsc::channel(8);
        tx.send((Ok(batch(1)), 10)).await.unwrap();
        tx.send((Err(Error::invalid("bad row")), 0)).await.unwrap();
        let k = KeptInput::new(batch(1).schema(), rx);
        assert!(all(&k).await.is_err());
        let again = all(&k).await.unwrap_err().to_string();
        assert!(again.contains("bad row"), "{again}");
    }
}
