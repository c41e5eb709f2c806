//! Fused spill segment files: blocks appended with sequential writes to one file per
//! (shuffle, sequence), rolled over at a size threshold, closed with one index footer; a
//! closed one may move to the tier below disk ([`super::tier`]).
//!
//! File layout: `block bytes...` then the index: for each block
//! `shuffle u64 | map u32 | partition u32 | attempt u32 | seq u32 | offset u64 | len u64 | crc u32`
//! (little endian), then `entries u64` and the magic `FSSEGIX1`.

use super::tier::Tier;
use crate::block::{BlockId, BlockMeta};
use crate::error::{Error, Result};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

pub const INDEX_MAGIC: &[u8; 8] = b"FSSEGIX1";

/// A segment readers can `pread` from, shared by the blocks it holds: a file, or, once moved
/// to the tier below disk ([`super::tier`]), an object read by range.
#[derive(Debug)]
pub struct Segment {
    pub path: PathBuf,
    backing: RwLock<Backing>,
    /// Bytes of blocks appended so far.
    bytes: AtomicU64,
    /// Closed for appends (its footer written): it may move to the tier.
    closed: AtomicBool,
}

#[derive(Debug)]
enum Backing {
    File(File),
    Tiered { tier: Arc<Tier>, object: String },
}

impl Segment {
    fn new(path: &Path, file: File) -> Self {
        Segment {
            path: path.to_path_buf(),
            backing: RwLock::new(Backing::File(file)),
            bytes: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        }
    }

    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        match &*self.backing.read().unwrap_or_else(|p| p.into_inner()) {
            Backing::File(file) => {
                let mut buf = vec![0u8; len as usize];
                file.read_exact_at(&mut buf, offset)
                    .map_err(|e| Error::io(&self.path, e))?;
                Ok(buf)
            }
            Backing::Tiered { tier, object } => tier.read(object, offset, len),
        }
    }

    /// Bytes of blocks in the segment.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }

    /// Whether it is closed and still a local file (it may move to the tier).
    pub fn movable(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
            && matches!(
                *self.backing.read().unwrap_or_else(|p| p.into_inner()),
                Backing::File(_)
            )
    }

    /// Whether it was moved to the tier.
    pub fn tiered(&self) -> bool {
        matches!(
            *self.backing.read().unwrap_or_else(|p| p.into_inner()),
            Backing::Tiered { .. }
        )
    }

    /// Move a closed segment to `tier`: upload the file whole, switch readers to the
    /// object, then delete the file. On any failure the file stays as it was.
    pub fn move_to(&self, tier: &Arc<Tier>) -> Result<()> {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let object = tier.object_of(&name);
        let data = std::fs::read(&self.path).map_err(|e| Error::io(&self.path, e))?;
        tier.upload(&object, bytes::Bytes::from(data))?;
        *self.backing.write().unwrap_or_else(|p| p.into_inner()) = Backing::Tiered {
            tier: tier.clone(),
            object,
        };
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(&self.path, e)),
        }
    }

    /// Remove the segment: its file, or (tiered) its object, in the background.
    pub fn remove(&self) -> Result<()> {
        match &*self.backing.read().unwrap_or_else(|p| p.into_inner()) {
            Backing::Tiered { tier, object } => {
                tier.delete_later(object);
                Ok(())
            }
            Backing::File(_) => match std::fs::remove_file(&self.path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(Error::io(&self.path, e)),
            },
        }
    }
}

/// The segment currently being appended to.
pub struct SegmentWriter {
    segment: Arc<Segment>,
    file: File,
    len: u64,
    index: Vec<(BlockMeta, u64)>,
}

impl SegmentWriter {
    pub fn create(path: &Path) -> Result<Self> {
        let file = crate::private::create_file(path)?;
        let reader = file.try_clone().map_err(|e| Error::io(path, e))?;
        Ok(SegmentWriter {
            segment: Arc::new(Segment::new(path, reader)),
            file,
            len: 0,
            index: Vec::new(),
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn segment(&self) -> Arc<Segment> {
        self.segment.clone()
    }

    /// Append one block; returns its offset. A failed write (e.g. a full disk) leaves the
    /// segment unusable for more blocks, which the caller sees as an error.
    pub fn append(&mut self, meta: BlockMeta, data: &[u8]) -> Result<u64> {
        let offset = self.len;
        self.file
            .write_all(data)
            .map_err(|e| Error::io(&self.segment.path, e))?;
        self.len += data.len() as u64;
        self.segment
            .bytes
            .fetch_add(data.len() as u64, Ordering::SeqCst);
        self.index.push((meta, offset));
        Ok(offset)
    }

    /// Write the index footer and close the segment for appends.
    pub fn finish(mut self) -> Result<Arc<Segment>> {
        let mut footer = Vec::with_capacity(self.index.len() * 44 + 16);
        for (m, offset) in &self.index {
            let BlockId {
                shuffle,
                map,
                partition,
                attempt,
                seq,
            } = m.id;
            footer.extend_from_slice(&shuffle.0.to_le_bytes());
            for v in [map, partition, attempt, seq] {
                footer.extend_from_slice(&v.to_le_bytes());
            }
            footer.extend_from_slice(&offset.to_le_bytes());
            footer.extend_from_slice(&m.bytes.to_le_bytes());
            footer.extend_from_slice(&m.crc32c.to_le_bytes());
        }
        footer.extend_from_slice(&(self.index.len() as u64).to_le_bytes());
        footer.extend_from_slice(INDEX_MAGIC);
        self.file
            .write_all(&footer)
            .map_err(|e| Error::io(&self.segment.path, e))?;
        self.segment.closed.store(true, Ordering::SeqCst);
        Ok(self.segment)
    }
}

#[cfg(test)]
impl SegmentWriter {
    /// A writer over an existing path (e.g. `/dev/full`) to inject write failures.
    pub fn create_at_for_test(path: &str) -> Self {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        let reader = std::fs::OpenOptions::new().read(true).open(path).unwrap();
        SegmentWriter {
            segment: Arc::new(Segment::new(std::path::Path::new(path), reader)),
            file,
            len: 0,
            index: Vec::new(),
        }
    }
}
