//! Fused spill segment files: blocks appended with sequential writes to one file per
//! (shuffle, sequence), rolled over at a size threshold, closed with one index footer.
//!
//! File layout: `block bytes...` then the index: for each block
//! `shuffle u64 | map u32 | partition u32 | attempt u32 | seq u32 | offset u64 | len u64 | crc u32`
//! (little endian), then `entries u64` and the magic `FSSEGIX1`.

use crate::block::{BlockId, BlockMeta};
use crate::error::{Error, Result};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const INDEX_MAGIC: &[u8; 8] = b"FSSEGIX1";

/// A segment file readers can `pread` from, shared by the blocks it holds.
#[derive(Debug)]
pub struct Segment {
    pub path: PathBuf,
    file: File,
}

impl Segment {
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut buf, offset)
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(buf)
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
            segment: Arc::new(Segment {
                path: path.to_path_buf(),
                file: reader,
            }),
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
            segment: Arc::new(Segment {
                path: path.into(),
                file: reader,
            }),
            file,
            len: 0,
            index: Vec::new(),
        }
    }
}
