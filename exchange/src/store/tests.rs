use super::*;
use arrow::datatypes::{DataType, Field, Schema};
use proptest::prelude::*;
use std::sync::Arc;

fn store(budget: u64, segment_bytes: u64) -> (tempfile::TempDir, BlockStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = BlockStore::new(StoreConfig {
        memory_budget: budget,
        spill_dir: dir.path().to_path_buf(),
        segment_bytes,
    })
    .unwrap();
    (dir, s)
}

fn info(id: u64, partitions: u32) -> ShuffleInfo {
    ShuffleInfo {
        id: ShuffleId(id),
        schema: Arc::new(Schema::new(vec![Field::new("a", DataType::Int32, false)])),
        partitions,
        partitioner: crate::partitioner::round_robin(),
    }
}

fn bid(shuffle: u64, map: u32, partition: u32) -> BlockId {
    BlockId {
        shuffle: ShuffleId(shuffle),
        map,
        partition,
        attempt: 0,
        seq: 0,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn every_block_reads_back(sizes in prop::collection::vec(1usize..5000, 1..40),
                              budget in 0u64..40_000, segment in 1u64..20_000) {
        let (_dir, s) = store(budget, segment);
        s.create_shuffle(info(1, 4)).unwrap();
        let mut expect = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            let data: Vec<u8> = (0..*n).map(|j| (i * 31 + j) as u8).collect();
            let id = bid(1, i as u32, (i % 4) as u32);
            s.put(id, 1, Bytes::from(data.clone())).unwrap();
            expect.push((id, data));
            prop_assert!(s.metrics().memory_bytes <= budget);
        }
        for (id, data) in &expect {
            let got = s.get(id).unwrap();
            prop_assert_eq!(got.as_ref(), data.as_slice());
        }
        let m = s.metrics();
        let total: u64 = sizes.iter().map(|n| *n as u64).sum();
        prop_assert_eq!(m.memory_bytes + m.spilled_bytes, total);
        let mut seen = 0;
        for p in 0..4 {
            seen += s.partition_since(ShuffleId(1), p, 0).unwrap().0.len();
        }
        prop_assert_eq!(seen, sizes.len());
        s.seal(ShuffleId(1)).unwrap();
        let files = s.spill_files();
        s.drop_shuffle(ShuffleId(1)).unwrap();
        prop_assert_eq!(s.metrics().memory_bytes, 0);
        for f in files {
            prop_assert!(!f.exists());
        }
    }
}

#[test]
fn corrupted_spill_byte_is_a_checksum_error_naming_the_block() {
    let (_dir, s) = store(0, 1 << 20);
    s.create_shuffle(info(7, 2)).unwrap();
    let id = bid(7, 3, 1);
    s.put(id, 10, Bytes::from(vec![5u8; 1000])).unwrap();
    let files = s.spill_files();
    assert_eq!(files.len(), 1);
    let mut bytes = std::fs::read(&files[0]).unwrap();
    bytes[500] ^= 0xff;
    std::fs::write(&files[0], bytes).unwrap();
    let err = s.get(&id).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Checksum { .. }), "{msg}");
    assert!(msg.contains("map=3 partition=1"), "{msg}");
}

#[test]
fn segments_are_fused_and_indexed() {
    let (_dir, s) = store(0, 10_000);
    s.create_shuffle(info(9, 1)).unwrap();
    for m in 0..25 {
        s.put(bid(9, m, 0), 1, Bytes::from(vec![m as u8; 1000]))
            .unwrap();
    }
    s.seal(ShuffleId(9)).unwrap();
    let files = s.spill_files();
    assert_eq!(files.len(), 3, "10 blocks per 10 kB segment");
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        assert_eq!(&bytes[bytes.len() - 8..], segment::INDEX_MAGIC);
    }
}

#[test]
fn unknown_shuffle_and_partition_errors() {
    let (_dir, s) = store(100, 100);
    assert!(matches!(
        s.get(&bid(1, 0, 0)),
        Err(Error::UnknownShuffle(_))
    ));
    s.create_shuffle(info(1, 2)).unwrap();
    assert!(matches!(s.get(&bid(1, 0, 0)), Err(Error::BlockNotFound(_))));
    assert!(s.put(bid(1, 0, 5), 1, Bytes::from_static(b"x")).is_err());
    assert!(s.partition_since(ShuffleId(1), 9, 0).is_err());
    assert!(matches!(
        s.drop_shuffle(ShuffleId(2)),
        Err(Error::UnknownShuffle(_))
    ));
}

#[test]
fn full_disk_is_a_clear_error() {
    // /dev/full accepts opens and fails every write with ENOSPC.
    if !std::path::Path::new("/dev/full").exists() {
        return;
    }
    let mut full = segment::SegmentWriter::create_at_for_test("/dev/full");
    let meta = BlockMeta {
        id: bid(3, 0, 0),
        rows: 1,
        bytes: 3,
        crc32c: 0,
    };
    let err = full.append(meta, b"abc").unwrap_err();
    assert!(err.to_string().contains("No space left"), "{err}");
    assert_eq!(err.to_status().code(), tonic::Code::ResourceExhausted);
}
