//! Object storage for durable shuffles (Seer §3; IBM's Spark S3 shuffle): each committed map
//! output is also written as **one object** — its blocks back to back, then a footer that
//! lists them — under an attempt-scoped name, and read back by byte ranges the manifest names
//! (no LIST on any read path). This module is the one place that talks to a store: it opens
//! one from a URL and `object_store`'s options ([`StorageConfig`]), writes objects
//! ([`ObjectWriter`]), reads ranges (coalescing neighbours), deletes and lists, and counts
//! every request it makes ([`proto::StorageStats`]).
//!
//! Credentials are options like any other (or come from the usual AWS environment): they are
//! sent to workers only inside the authenticated cluster channel, and no `Debug`, log line
//! or error of this module prints an option's value.

use crate::block::BlockMeta;
use crate::error::{Error, Result};
use crate::proto;
use bytes::{Bytes, BytesMut};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use prost::Message;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The last 4 bytes of every object: what it is and the footer's version.
pub const MAGIC: &[u8; 4] = b"FSO1";
/// An object over this size is written as a multipart upload of parts this big (S3 needs at
/// least 5 MiB per part but the last).
pub const PART_BYTES: usize = 8 << 20;
/// Ranges at most this far apart are read with one GET (`object_store`'s default too).
pub const COALESCE_BYTES: u64 = 1 << 20;
/// Deadline of one request to the store, over the client's own timeouts and retries: a store
/// that stops answering is an error after this long, never a hang.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(90);
/// GETs of one read in flight at once.
const READS_IN_FLIGHT: usize = 8;

/// Where durable shuffles write: an object store URL (`s3://bucket/prefix`,
/// `file:///mnt/shared/prefix`, `memory:///` in tests) and `object_store`'s options for it
/// (`aws_endpoint`, `aws_access_key_id`, `aws_region`, `aws_allow_http`, `timeout`, ...).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct StorageConfig {
    /// The store's URL: scheme, bucket and the prefix every object goes under.
    pub url: String,
    /// `object_store`'s configuration keys and their values.
    pub options: BTreeMap<String, String>,
}

impl std::fmt::Debug for StorageConfig {
    /// The URL and the option *names*: values may be credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageConfig")
            .field("url", &self.url)
            .field("options", &self.options.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl std::fmt::Debug for proto::Storage {
    /// As [`StorageConfig`]'s: no option value.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<&String> = self.options.keys().collect();
        keys.sort();
        f.debug_struct("Storage")
            .field("url", &self.url)
            .field("options", &keys)
            .field("prefix", &self.prefix)
            .field("tier_only", &self.tier_only)
            .finish()
    }
}

impl StorageConfig {
    /// A store at `url` with `options`; the URL is checked here (scheme, bucket), the
    /// options when the store is opened.
    pub fn new(
        url: impl Into<String>,
        options: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self> {
        let cfg = StorageConfig {
            url: url.into().trim_end_matches('/').to_string(),
            options: options.into_iter().collect(),
        };
        let parsed = parse(&cfg.url)?;
        match parsed.scheme() {
            "s3" | "s3a" | "file" | "memory" => Ok(cfg),
            other => Err(Error::invalid(format!(
                "storage URL {}: scheme {other:?} is not supported (s3://, file://, memory://)",
                cfg.url
            ))),
        }
    }

    /// The message that hands this store to workers, for objects under `prefix`.
    pub fn to_proto(&self, prefix: &str) -> proto::Storage {
        proto::Storage {
            url: self.url.clone(),
            options: self
                .options
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            prefix: prefix.to_string(),
            tier_only: false,
            read_through: false,
        }
    }

    /// The store a worker was handed.
    pub fn from_proto(p: &proto::Storage) -> Result<Self> {
        StorageConfig::new(p.url.clone(), p.options.clone())
    }
}

fn parse(url: &str) -> Result<url::Url> {
    url::Url::parse(url).map_err(|e| Error::invalid(format!("storage URL {url:?}: {e}")))
}

/// Request counters of one store client.
#[derive(Default)]
struct Counters {
    puts: AtomicU64,
    put_parts: AtomicU64,
    gets: AtomicU64,
    lists: AtomicU64,
    deletes: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
}

/// An open object store: the client, the URL's prefix, and its request counters.
pub struct Storage {
    store: Arc<dyn ObjectStore>,
    base: Path,
    url: String,
    counters: Counters,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage").field("url", &self.url).finish()
    }
}

impl Storage {
    /// Open the store `cfg` names. S3 credentials and region come from the options or the
    /// AWS environment (`AWS_ACCESS_KEY_ID`, ...); requests time out (30 s, 5 s to connect)
    /// and are retried twice within 20 s unless the options say otherwise.
    pub fn open(cfg: &StorageConfig) -> Result<Self> {
        let url = parse(&cfg.url)?;
        let bad = |e: object_store::Error| Error::Storage {
            object: cfg.url.clone(),
            reason: redact(&e.to_string(), cfg),
        };
        let (store, base): (Arc<dyn ObjectStore>, Path) = match url.scheme() {
            "s3" | "s3a" => {
                use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
                let client = object_store::ClientOptions::new()
                    .with_timeout(Duration::from_secs(30))
                    .with_connect_timeout(Duration::from_secs(5));
                let retry = object_store::RetryConfig {
                    max_retries: 2,
                    retry_timeout: Duration::from_secs(20),
                    ..Default::default()
                };
                let mut b = AmazonS3Builder::from_env()
                    .with_url(cfg.url.as_str())
                    .with_client_options(client)
                    .with_retry(retry);
                for (k, v) in &cfg.options {
                    let key: AmazonS3ConfigKey = k.parse().map_err(|_| {
                        Error::invalid(format!(
                            "storage option {k:?} is not an object_store S3 option"
                        ))
                    })?;
                    b = b.with_config(key, v.clone());
                }
                let base = Path::parse(url.path().trim_start_matches('/'))
                    .map_err(|e| Error::invalid(format!("storage URL {}: {e}", cfg.url)))?;
                (Arc::new(b.build().map_err(bad)?), base)
            }
            _ => {
                let (store, base) =
                    object_store::parse_url_opts(&url, cfg.options.iter()).map_err(bad)?;
                (Arc::from(store), base)
            }
        };
        Ok(Storage {
            store,
            base,
            url: cfg.url.clone(),
            counters: Counters::default(),
        })
    }

    /// The full name of object `path`, for messages.
    pub fn name(&self, path: &str) -> String {
        format!("{}/{path}", self.url)
    }

    fn location(&self, path: &str) -> Path {
        path.split('/')
            .filter(|p| !p.is_empty())
            .fold(self.base.clone(), |at, part| at.clone().join(part))
    }

    /// The requests made so far.
    pub fn stats(&self) -> proto::StorageStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        proto::StorageStats {
            puts: get(&c.puts),
            put_parts: get(&c.put_parts),
            gets: get(&c.gets),
            lists: get(&c.lists),
            deletes: get(&c.deletes),
            bytes_written: get(&c.bytes_written),
            bytes_read: get(&c.bytes_read),
        }
    }

    fn fail(&self, path: &str, e: impl std::fmt::Display) -> Error {
        Error::Storage {
            object: self.name(path),
            reason: e.to_string(),
        }
    }

    /// `fut` within [`REQUEST_DEADLINE`], its error naming `path`.
    async fn timed<T>(
        &self,
        path: &str,
        what: &str,
        fut: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(REQUEST_DEADLINE, fut).await {
            Ok(r) => r.map_err(|e| self.fail(path, format!("{what}: {e}"))),
            Err(_) => Err(self.fail(
                path,
                format!("{what}: no answer within {} s", REQUEST_DEADLINE.as_secs()),
            )),
        }
    }

    /// Write one object whole (one PUT).
    pub async fn put(&self, path: &str, data: Bytes) -> Result<()> {
        let len = data.len() as u64;
        // Counted when sent, whatever the answer.
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.timed(
            path,
            "put",
            self.store.put(&self.location(path), PutPayload::from(data)),
        )
        .await?;
        self.counters
            .bytes_written
            .fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Read `ranges` of object `path`: ranges at most [`COALESCE_BYTES`] apart share one GET.
    /// Each range's bytes, in the order asked; a short object is an error naming it.
    pub async fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        use futures::{StreamExt, TryStreamExt};
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&i| ranges[i].start);
        // Coalesced spans, each with the requests it serves.
        let mut spans: Vec<(Range<u64>, Vec<usize>)> = Vec::new();
        for i in order {
            let r = &ranges[i];
            match spans.last_mut() {
                Some((span, members)) if r.start <= span.end + COALESCE_BYTES => {
                    span.end = span.end.max(r.end);
                    members.push(i);
                }
                _ => spans.push((r.clone(), vec![i])),
            }
        }
        let location = self.location(path);
        let fetched: Vec<(Range<u64>, Vec<usize>, Bytes)> = futures::stream::iter(spans)
            .map(|(span, members)| {
                let location = location.clone();
                async move {
                    self.counters.gets.fetch_add(1, Ordering::Relaxed);
                    let bytes = self
                        .timed(
                            path,
                            "ranged get",
                            self.store.get_range(&location, span.clone()),
                        )
                        .await?;
                    self.counters
                        .bytes_read
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    if (bytes.len() as u64) < span.end - span.start {
                        return Err(self.fail(
                            path,
                            format!(
                                "bytes {}..{} asked, {} returned (truncated object)",
                                span.start,
                                span.end,
                                bytes.len()
                            ),
                        ));
                    }
                    Ok::<_, Error>((span, members, bytes))
                }
            })
            .buffer_unordered(READS_IN_FLIGHT)
            .try_collect()
            .await?;
        let mut out = vec![Bytes::new(); ranges.len()];
        for (span, members, bytes) in fetched {
            for i in members {
                let r = &ranges[i];
                out[i] =
                    bytes.slice((r.start - span.start) as usize..(r.end - span.start) as usize);
            }
        }
        Ok(out)
    }

    /// Read object `path` whole.
    pub async fn get(&self, path: &str) -> Result<Bytes> {
        let location = self.location(path);
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let got = self.timed(path, "get", self.store.get(&location)).await?;
        let bytes = self.timed(path, "get", got.bytes()).await?;
        self.counters
            .bytes_read
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Delete object `path` (one already gone is not an error).
    pub async fn delete(&self, path: &str) -> Result<()> {
        let r =
            tokio::time::timeout(REQUEST_DEADLINE, self.store.delete(&self.location(path))).await;
        self.counters.deletes.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(Ok(())) | Ok(Err(object_store::Error::NotFound { .. })) => Ok(()),
            Ok(Err(e)) => Err(self.fail(path, format!("delete: {e}"))),
            Err(_) => Err(self.fail(path, "delete: no answer in time")),
        }
    }

    /// Every object under `prefix`: its path relative to the store's URL, size and age.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, u64, Duration)>> {
        use futures::TryStreamExt;
        let location = self.location(prefix);
        self.counters.lists.fetch_add(1, Ordering::Relaxed);
        let listed: Vec<object_store::ObjectMeta> = self
            .timed(
                prefix,
                "list",
                self.store.list(Some(&location)).try_collect(),
            )
            .await?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs() as i64;
        let base = self.base.as_ref().len();
        Ok(listed
            .into_iter()
            .map(|m| {
                let full = m.location.as_ref();
                let rel = full
                    .get(base..)
                    .unwrap_or(full)
                    .trim_start_matches('/')
                    .to_string();
                let age = (now - m.last_modified.timestamp()).max(0) as u64;
                (rel, m.size, Duration::from_secs(age))
            })
            .collect())
    }
}

/// Delete what crashed clusters left in `storage`: objects of flightshuffle runs (named
/// `run-<id>/...`, ending `.fsobj` or the start probe) last modified over `older_than` ago;
/// with `dry_run` only list them. Returns each object's path and size. Other objects under
/// the URL are never touched. Stopped clusters leave nothing (objects go with their shuffle).
pub async fn sweep(
    storage: &Storage,
    older_than: Duration,
    dry_run: bool,
) -> Result<Vec<(String, u64)>> {
    let mut gone = Vec::new();
    for (path, size, age) in storage.list("").await? {
        let ours =
            path.starts_with("run-") && (path.ends_with(".fsobj") || path.ends_with("/probe"));
        if !ours || age < older_than {
            continue;
        }
        if !dry_run {
            storage.delete(&path).await?;
        }
        gone.push((path, size));
    }
    Ok(gone)
}

/// `text` with every option value of `cfg` longer than 3 characters replaced (an error of
/// the store's builder may quote what it was given).
fn redact(text: &str, cfg: &StorageConfig) -> String {
    cfg.options
        .values()
        .filter(|v| v.len() > 3)
        .fold(text.to_string(), |t, v| t.replace(v.as_str(), "<redacted>"))
}

/// The store a driver's durable shuffles write to, and this cluster run's name in it.
pub struct RunStore {
    /// The store's URL and options (handed to workers with each shuffle).
    pub cfg: StorageConfig,
    /// The driver's own client (restores, deletes).
    pub storage: Arc<Storage>,
    /// A random name of this run (`run-<16 hex digits>`): two clusters sharing a store never
    /// share objects, and a sweep recognises what runs left.
    pub run: String,
    /// The store's rates for the cost model, measured on first use
    /// ([`crate::calibrate::store_rates`]): seconds per request with many in flight, bytes
    /// per second read, bytes per second written.
    pub rates: tokio::sync::OnceCell<[f64; 3]>,
}

impl RunStore {
    /// Open the store `cfg` names for a new run.
    pub fn open(cfg: &StorageConfig) -> Result<Self> {
        Ok(RunStore {
            cfg: cfg.clone(),
            storage: Arc::new(Storage::open(cfg)?),
            run: format!("run-{:016x}", rand::random::<u64>()),
            rates: tokio::sync::OnceCell::new(),
        })
    }

    /// Where the objects of shuffle `shuffle` go.
    pub fn shuffle_prefix(&self, shuffle: u64) -> String {
        format!("{}/{shuffle:016x}", self.run)
    }
}

/// Writes one map output as one object: blocks are buffered up to [`PART_BYTES`]; a bigger
/// object becomes a multipart upload, aborted if the writer fails or is dropped unfinished.
pub struct ObjectWriter<'a> {
    storage: &'a Storage,
    path: String,
    buf: BytesMut,
    upload: Option<Box<dyn object_store::MultipartUpload>>,
    footer: proto::StoredObject,
    at: u64,
}

impl<'a> ObjectWriter<'a> {
    /// A writer of object `path` of `storage`.
    pub fn new(storage: &'a Storage, path: impl Into<String>) -> Self {
        let path = path.into();
        ObjectWriter {
            storage,
            footer: proto::StoredObject {
                path: path.clone(),
                ..Default::default()
            },
            path,
            buf: BytesMut::new(),
            upload: None,
            at: 0,
        }
    }

    /// Append one block (its bytes as the store holds them), held by worker slot `holder`.
    pub async fn push(&mut self, meta: &BlockMeta, holder: u32, data: &[u8]) -> Result<()> {
        self.footer.blocks.push(meta.into());
        self.footer.holders.push(holder);
        self.footer.offsets.push(self.at);
        self.at += data.len() as u64;
        self.buf.extend_from_slice(data);
        if self.buf.len() >= PART_BYTES {
            self.flush_part().await?;
        }
        Ok(())
    }

    async fn flush_part(&mut self) -> Result<()> {
        if self.upload.is_none() {
            let location = self.storage.location(&self.path);
            let up = self
                .storage
                .timed(
                    &self.path,
                    "multipart start",
                    self.storage.store.put_multipart(&location),
                )
                .await?;
            self.upload = Some(up);
        }
        let part = self.buf.split().freeze();
        let len = part.len() as u64;
        let Some(up) = self.upload.as_mut() else {
            return Err(self.storage.fail(&self.path, "multipart upload missing"));
        };
        let fut = up.put_part(PutPayload::from(part));
        let c = &self.storage.counters;
        c.put_parts.fetch_add(1, Ordering::Relaxed);
        self.storage.timed(&self.path, "part put", fut).await?;
        c.bytes_written.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Write the footer and finish the object; returns what the manifest records of it.
    pub async fn finish(mut self) -> Result<proto::StoredObject> {
        self.footer.size = 0;
        let footer = self.footer.encode_to_vec();
        self.footer.size = self.at + footer.len() as u64 + 12;
        self.buf.extend_from_slice(&footer);
        self.buf
            .extend_from_slice(&(footer.len() as u64).to_le_bytes());
        self.buf.extend_from_slice(MAGIC);
        match self.upload.is_some() {
            false => {
                let data = self.buf.split().freeze();
                self.storage.put(&self.path, data).await?;
            }
            true => {
                // Dropped on an error, the writer aborts the upload (see its `Drop`).
                self.flush_part().await?;
                self.storage.counters.puts.fetch_add(1, Ordering::Relaxed);
                let Some(up) = self.upload.as_mut() else {
                    return Err(self.storage.fail(&self.path, "multipart upload missing"));
                };
                let done = self
                    .storage
                    .timed(&self.path, "multipart complete", up.complete())
                    .await;
                if done.is_ok() {
                    self.upload = None; // completed: nothing to abort
                }
                done?;
            }
        }
        Ok(std::mem::take(&mut self.footer))
    }

    /// Give up: a multipart upload started is aborted (a single PUT was never sent).
    pub async fn abort(mut self) {
        if let Some(mut up) = self.upload.take() {
            let _ = tokio::time::timeout(REQUEST_DEADLINE, up.abort()).await;
        }
    }
}

impl Drop for ObjectWriter<'_> {
    /// A multipart upload neither completed nor aborted (the writer failed, or the map attempt
    /// that wrote was cancelled) is aborted in the background, so the store keeps no parts.
    fn drop(&mut self) {
        if let Some(mut up) = self.upload.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = tokio::time::timeout(REQUEST_DEADLINE, up.abort()).await;
                });
            }
        }
    }
}

/// The footer of a whole object's bytes: the blocks it holds and where; an error naming
/// `name` if the bytes are not such an object.
pub fn read_footer(name: &str, data: &[u8]) -> Result<proto::StoredObject> {
    let bad = |why: &str| Error::Storage {
        object: name.to_string(),
        reason: format!("not a flightshuffle object: {why}"),
    };
    let n = data.len();
    if n < 12 || &data[n - 4..] != MAGIC {
        return Err(bad("no footer magic"));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&data[n - 12..n - 4]);
    let len = u64::from_le_bytes(len);
    if len > (n - 12) as u64 {
        return Err(bad("footer longer than the object"));
    }
    let start = n - 12 - len as usize;
    let mut footer = proto::StoredObject::decode(&data[start..n - 12])
        .map_err(|e| bad(&format!("footer does not decode: {e}")))?;
    // Written before the object's size was known.
    footer.size = n as u64;
    if footer.blocks.len() != footer.offsets.len() {
        return Err(bad("footer lists blocks and offsets of different counts"));
    }
    for (b, &off) in footer.blocks.iter().zip(&footer.offsets) {
        if off.saturating_add(b.bytes) > start as u64 {
            return Err(bad("a block runs past the footer"));
        }
    }
    Ok(footer)
}

/// Add `more` to `total`, counter by counter.
pub fn add_stats(total: &mut proto::StorageStats, more: &proto::StorageStats) {
    total.puts += more.puts;
    total.put_parts += more.put_parts;
    total.gets += more.gets;
    total.lists += more.lists;
    total.deletes += more.deletes;
    total.bytes_written += more.bytes_written;
    total.bytes_read += more.bytes_read;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockId, ShuffleId};

    fn meta(seq: u32, bytes: u64) -> BlockMeta {
        BlockMeta {
            id: BlockId {
                shuffle: ShuffleId(7),
                map: 3,
                partition: seq % 4,
                attempt: 1,
                seq,
            },
            rows: seq as u64,
            bytes,
            crc32c: seq,
        }
    }

    fn memory() -> Storage {
        Storage::open(&StorageConfig::new("memory:///", []).unwrap()).unwrap()
    }

    /// Objects of every size (one PUT, or a multipart upload of several parts) read back by
    /// ranges exactly, and their footer lists every block where it is.
    #[tokio::test]
    async fn an_object_reads_back_by_ranges_and_by_its_footer() {
        let storage = memory();
        for (blocks, size) in [(0usize, 0usize), (3, 100), (5, 3 << 20), (40, 1 << 20)] {
            let mut w = ObjectWriter::new(&storage, format!("s/o{blocks}"));
            let mut want = Vec::new();
            for i in 0..blocks {
                let data: Vec<u8> = (0..size + i).map(|j| (j * 31 + i) as u8).collect();
                w.push(&meta(i as u32, data.len() as u64), 0, &data)
                    .await
                    .unwrap();
                want.push(data);
            }
            let obj = w.finish().await.unwrap();
            let ranges: Vec<Range<u64>> = obj
                .offsets
                .iter()
                .zip(&want)
                .map(|(&o, d)| o..o + d.len() as u64)
                .rev()
                .collect();
            let got = storage.get_ranges(&obj.path, &ranges).await.unwrap();
            let mut back: Vec<Vec<u8>> = got.into_iter().map(|b| b.to_vec()).collect();
            back.reverse();
            assert_eq!(back, want);
            let whole = storage.get(&obj.path).await.unwrap();
            assert_eq!(whole.len() as u64, obj.size);
            assert_eq!(read_footer("o", &whole).unwrap(), obj);
        }
        let s = storage.stats();
        // Four objects (the empty one and 3 small blocks by one PUT each; 5 blocks of 3 MiB and
        // 40 of 1 MiB as multipart uploads), those two of 2 and 5 parts.
        assert_eq!(s.puts, 4, "{s:?}");
        assert!(s.put_parts >= 5, "{s:?}");
    }

    /// A truncated or garbled object is an error naming it, never a panic.
    #[tokio::test]
    async fn a_truncated_or_garbled_object_is_a_clear_error() {
        let storage = memory();
        let mut w = ObjectWriter::new(&storage, "x/y");
        w.push(&meta(0, 10), 0, &[1u8; 10]).await.unwrap();
        let obj = w.finish().await.unwrap();
        let whole = storage.get("x/y").await.unwrap();
        for cut in 0..whole.len() {
            let e = read_footer("mem:///x/y", &whole[..cut]).unwrap_err();
            assert!(e.to_string().contains("mem:///x/y"), "{e}");
        }
        assert!(read_footer("o", &whole).is_ok());
        let mut bad = whole.to_vec();
        let n = bad.len();
        bad[n - 6] ^= 0x7f;
        assert!(read_footer("o", &bad).is_err());
        let past_end = 0..obj.size + 10;
        let e = storage
            .get_ranges("x/y", std::slice::from_ref(&past_end))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("x/y"), "{e}");
        let first = 0..1;
        let e = storage
            .get_ranges("x/none", std::slice::from_ref(&first))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("x/none"), "{e}");
    }

    /// The sweep deletes old objects of runs only, never another object under the URL.
    #[tokio::test]
    async fn the_sweep_deletes_only_old_objects_of_runs() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        let storage = Storage::open(&StorageConfig::new(url, []).unwrap()).unwrap();
        for path in [
            "run-00ab/1/0-0.fsobj",
            "run-00ab/probe",
            "other/data.parquet",
            "run-x.txt",
        ] {
            storage.put(path, Bytes::from_static(b"abc")).await.unwrap();
        }
        let young = sweep(&storage, Duration::from_secs(3600), false)
            .await
            .unwrap();
        assert!(young.is_empty(), "{young:?}");
        let listed = sweep(&storage, Duration::ZERO, true).await.unwrap();
        assert_eq!(listed.len(), 2, "{listed:?}");
        let mut gone = sweep(&storage, Duration::ZERO, false).await.unwrap();
        gone.sort();
        assert_eq!(
            gone,
            vec![
                ("run-00ab/1/0-0.fsobj".to_string(), 3),
                ("run-00ab/probe".to_string(), 3)
            ]
        );
        let mut left: Vec<String> = storage
            .list("")
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.0)
            .collect();
        left.sort();
        assert_eq!(left, vec!["other/data.parquet", "run-x.txt"]);
    }

    /// Neither a config's nor a handed-over store's `Debug` prints an option's value.
    #[test]
    fn no_credential_in_debug_output() {
        let cfg = StorageConfig::new(
            "s3://bucket/p",
            [(
                "aws_secret_access_key".to_string(),
                "s3cr3t-value".to_string(),
            )],
        )
        .unwrap();
        let shown = format!("{cfg:?} {:?}", cfg.to_proto("run/1"));
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("aws_secret_access_key"), "{shown}");
        let msg = proto::CreateShuffle {
            storage: Some(cfg.to_proto("run/1")),
            ..Default::default()
        };
        assert!(!format!("{msg:?}").contains("s3cr3t"));
        assert!(StorageConfig::new("ftp://x/y", []).is_err());
        assert!(StorageConfig::new("not a url", []).is_err());
    }
}
