use super::*;
use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema};
use proptest::prelude::*;
use std::sync::Arc;

fn store(budget: u64, segment_bytes: u64) -> (tempfile::TempDir, BlockStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = BlockStore::new(StoreConfig {
        memory_budget: budget,
        spill_dir: dir.path().to_path_buf(),
        segment_bytes,
        disk_budget: None,
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
        combiner: None,
        order: 0,
        group: 0,
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
            s.commit(ShuffleId(1), i as u32, 0, Some(1)).unwrap();
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
        s.commit(ShuffleId(9), m, 0, None).unwrap();
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

// ---- attempts and commits ----

fn aid(shuffle: u64, map: u32, partition: u32, attempt: u32, seq: u32) -> BlockId {
    BlockId {
        shuffle: ShuffleId(shuffle),
        map,
        partition,
        attempt,
        seq,
    }
}

fn visible(s: &BlockStore, shuffle: u64, partitions: u32) -> Vec<BlockId> {
    (0..partitions)
        .flat_map(|p| s.partition_since(ShuffleId(shuffle), p, 0).unwrap().0)
        .collect()
}

#[test]
fn pending_blocks_are_invisible_until_committed() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 2)).unwrap();
    let a = aid(1, 0, 1, 0, 0);
    s.put(a, 1, Bytes::from_static(b"a")).unwrap();
    assert!(visible(&s, 1, 2).is_empty());
    assert!(matches!(s.meta(&a), Err(Error::BlockNotFound(_))));
    assert_eq!(s.map_output(ShuffleId(1), 0).unwrap().0, None);
    let metas = s.commit(ShuffleId(1), 0, 0, Some(1)).unwrap();
    assert_eq!(metas.len(), 1);
    assert_eq!(visible(&s, 1, 2), vec![a]);
    assert!(s.meta(&a).is_ok());
    assert_eq!(s.map_output(ShuffleId(1), 0).unwrap().0, Some(vec![a]));
}

#[test]
fn first_commit_wins_and_a_duplicate_attempt_never_shows() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 2)).unwrap();
    let (a0, a1) = (aid(1, 0, 0, 0, 0), aid(1, 0, 0, 1, 0));
    s.put(a0, 1, Bytes::from_static(b"x")).unwrap();
    s.put(a1, 1, Bytes::from_static(b"y")).unwrap();
    s.commit(ShuffleId(1), 0, 1, Some(1)).unwrap();
    // Committing the winner again is a no-op; the loser is refused.
    s.commit(ShuffleId(1), 0, 1, Some(1)).unwrap();
    let err = s.commit(ShuffleId(1), 0, 0, Some(1)).unwrap_err();
    assert_eq!(
        err.to_status().code(),
        tonic::Code::FailedPrecondition,
        "{err}"
    );
    // A late put of the losing or of a new attempt is refused too.
    assert!(s
        .put(aid(1, 0, 1, 2, 0), 1, Bytes::from_static(b"z"))
        .is_err());
    assert_eq!(s.abort(ShuffleId(1), 0, 0), 1);
    assert_eq!(visible(&s, 1, 2), vec![a1]);
    assert_eq!(s.get(&a1).unwrap().as_ref(), b"y");
    assert_eq!(
        s.metrics().memory_bytes,
        1,
        "the loser's memory is released"
    );
}

#[test]
fn aborting_removes_pending_output_but_never_committed_output() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 1)).unwrap();
    for seq in 0..3 {
        s.put(aid(1, 4, 0, 0, seq), 1, Bytes::from(vec![1u8; 10]))
            .unwrap();
    }
    assert_eq!(s.metrics().memory_bytes, 30);
    assert_eq!(s.abort(ShuffleId(1), 4, 0), 3);
    assert_eq!(s.metrics().memory_bytes, 0);
    assert!(matches!(
        s.get(&aid(1, 4, 0, 0, 0)),
        Err(Error::BlockNotFound(_))
    ));
    s.put(aid(1, 4, 0, 1, 0), 1, Bytes::from(vec![2u8; 10]))
        .unwrap();
    s.commit(ShuffleId(1), 4, 1, Some(1)).unwrap();
    assert_eq!(s.abort(ShuffleId(1), 4, 1), 0, "committed output stays");
    // An aborted attempt that is still running can neither add blocks nor commit.
    s.create_shuffle(info(2, 1)).unwrap();
    s.abort(ShuffleId(2), 0, 0);
    let late = s
        .put(aid(2, 0, 0, 0, 0), 1, Bytes::from_static(b"x"))
        .unwrap_err();
    assert!(late.to_string().contains("aborted"), "{late}");
    assert!(s.commit(ShuffleId(2), 0, 0, None).is_err());
    assert_eq!(s.metrics().memory_bytes, 10);
    assert_eq!(visible(&s, 1, 1).len(), 1);
}

#[test]
fn a_wrong_block_count_commits_nothing() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 1)).unwrap();
    s.put(aid(1, 0, 0, 0, 0), 1, Bytes::from_static(b"a"))
        .unwrap();
    assert!(s.commit(ShuffleId(1), 0, 0, Some(2)).is_err());
    assert!(visible(&s, 1, 1).is_empty());
    s.commit(ShuffleId(1), 0, 0, Some(1)).unwrap();
    assert_eq!(visible(&s, 1, 1).len(), 1);
}

#[test]
fn a_sealed_shuffle_takes_no_puts_or_commits_and_drops_pending_blocks() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 1)).unwrap();
    s.put(aid(1, 0, 0, 0, 0), 1, Bytes::from_static(b"a"))
        .unwrap();
    s.commit(ShuffleId(1), 0, 0, None).unwrap();
    s.put(aid(1, 1, 0, 0, 0), 1, Bytes::from_static(b"b"))
        .unwrap();
    s.seal(ShuffleId(1)).unwrap();
    assert_eq!(
        s.metrics().memory_bytes,
        1,
        "the uncommitted block is discarded"
    );
    let err = s
        .put(aid(1, 2, 0, 0, 0), 1, Bytes::from_static(b"c"))
        .unwrap_err();
    assert_eq!(
        err.to_status().code(),
        tonic::Code::FailedPrecondition,
        "{err}"
    );
    assert!(s.commit(ShuffleId(1), 1, 0, None).is_err());
    assert_eq!(visible(&s, 1, 1).len(), 1);
    assert_eq!(s.map_output(ShuffleId(1), 7).unwrap().0, Some(vec![]));
}

#[test]
fn removing_an_attempt_never_shifts_what_a_reader_has_left() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 1)).unwrap();
    // A reader has consumed the first committed block (position 1).
    s.put(aid(1, 0, 0, 0, 0), 1, Bytes::from_static(b"a"))
        .unwrap();
    s.commit(ShuffleId(1), 0, 0, None).unwrap();
    let (seen, _, _) = s.partition_since(ShuffleId(1), 0, 0).unwrap();
    assert_eq!(seen.len(), 1);
    // Two attempts write; one is aborted, the other committed.
    s.put(aid(1, 1, 0, 0, 0), 1, Bytes::from_static(b"b"))
        .unwrap();
    s.put(aid(1, 2, 0, 0, 0), 1, Bytes::from_static(b"c"))
        .unwrap();
    s.abort(ShuffleId(1), 1, 0);
    s.commit(ShuffleId(1), 2, 0, None).unwrap();
    let (rest, _, _) = s.partition_since(ShuffleId(1), 0, 1).unwrap();
    assert_eq!(rest, vec![aid(1, 2, 0, 0, 0)]);
}

#[derive(Debug, Clone)]
enum Op {
    Put {
        map: u32,
        attempt: u32,
        partition: u32,
        size: usize,
    },
    Commit {
        map: u32,
        attempt: u32,
    },
    Abort {
        map: u32,
        attempt: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..4, 0u32..3, 0u32..3, 1usize..300)
            .prop_map(|(map, attempt, partition, size)| Op::Put { map, attempt, partition, size }),
        1 => (0u32..4, 0u32..3).prop_map(|(map, attempt)| Op::Commit { map, attempt }),
        1 => (0u32..4, 0u32..3).prop_map(|(map, attempt)| Op::Abort { map, attempt }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever the interleaving of puts, commits and aborts (and spilling), readers see exactly
    /// the blocks of the one committed attempt of each map, in commit order, and after the seal
    /// only committed blocks hold memory.
    #[test]
    fn readers_see_exactly_the_committed_attempts(ops in prop::collection::vec(op(), 1..60),
                                                 budget in 0u64..2_000) {
        let (_dir, s) = store(budget, 4_000);
        s.create_shuffle(info(1, 3)).unwrap();
        let mut next_seq = std::collections::HashMap::<(u32, u32, u32), u32>::new();
        let mut written = std::collections::HashMap::<(u32, u32), Vec<(BlockId, usize)>>::new();
        let mut committed = std::collections::BTreeMap::<u32, u32>::new();
        let mut aborted = std::collections::HashSet::<(u32, u32)>::new();
        let mut expect: Vec<BlockId> = Vec::new();
        for op in ops {
            match op {
                Op::Put { map, attempt, partition, size } => {
                    let seq = next_seq.entry((map, attempt, partition)).or_insert(0);
                    let id = aid(1, map, partition, attempt, *seq);
                    let ok = s.put(id, 1, Bytes::from(vec![map as u8; size])).is_ok();
                    prop_assert_eq!(ok, !committed.contains_key(&map) && !aborted.contains(&(map, attempt)));
                    if ok {
                        *seq += 1;
                        written.entry((map, attempt)).or_default().push((id, size));
                    }
                }
                Op::Commit { map, attempt } => {
                    let r = s.commit(ShuffleId(1), map, attempt, None);
                    match committed.get(&map) {
                        Some(&a) => prop_assert_eq!(r.is_ok(), a == attempt),
                        None if aborted.contains(&(map, attempt)) => prop_assert!(r.is_err()),
                        None => {
                            prop_assert!(r.is_ok());
                            committed.insert(map, attempt);
                            expect.extend(written.remove(&(map, attempt)).unwrap_or_default().iter().map(|(id, _)| *id));
                        }
                    }
                }
                Op::Abort { map, attempt } => {
                    s.abort(ShuffleId(1), map, attempt);
                    if committed.get(&map) != Some(&attempt) {
                        written.remove(&(map, attempt));
                        aborted.insert((map, attempt));
                    }
                }
            }
            let mut seen = visible(&s, 1, 3);
            let mut want = expect.clone();
            seen.sort();
            want.sort();
            prop_assert_eq!(seen, want);
        }
        s.seal(ShuffleId(1)).unwrap();
        for id in visible(&s, 1, 3) {
            prop_assert_eq!(s.get(&id).unwrap()[0], id.map as u8);
        }
        let m = s.metrics();
        prop_assert!(m.memory_bytes <= budget);
        s.drop_shuffle(ShuffleId(1)).unwrap();
        prop_assert_eq!(s.metrics().memory_bytes, 0);
    }
}

/// Blocks this process encoded and holds in memory decode without arrow's second validation;
/// spilled ones (bytes from disk) and plain bytes are validated (garbage is an error, not a crash); a corrupted encoded
/// block fails its CRC before any decoding.
#[test]
fn encoded_blocks_skip_revalidation_and_plain_bytes_do_not() {
    use arrow::array::{Int32Array, StringArray};
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int32, false),
        Field::new("s", DataType::Utf8, true),
    ]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int32Array::from((0..1000).collect::<Vec<_>>())),
            Arc::new(StringArray::from_iter(
                (0..1000).map(|i| (i % 7 != 0).then(|| format!("s{i}"))),
            )),
        ],
    )
    .unwrap();
    // A budget that holds the first block only: the second is spilled.
    let first = EncodedBlock::encode(
        &schema,
        std::slice::from_ref(&batch),
        crate::Compression::Lz4,
    )
    .unwrap();
    let (dir, s) = store(first.bytes().len() as u64, 1 << 20);
    s.create_shuffle(info(1, 2)).unwrap();
    let (a, b, c) = (bid(1, 0, 0), bid(1, 1, 0), bid(1, 2, 1));
    assert!(!s.put_encoded(a, 1000, first).unwrap().1);
    let second = EncodedBlock::encode(
        &schema,
        std::slice::from_ref(&batch),
        crate::Compression::None,
    )
    .unwrap();
    assert!(s.put_encoded(b, 1000, second).unwrap().1, "spilled");
    s.put(c, 1, Bytes::from_static(b"not an IPC stream"))
        .unwrap();
    for m in 0..3 {
        s.commit(ShuffleId(1), m, 0, Some(1)).unwrap();
    }
    assert_eq!(s.read_batches(&a).unwrap(), vec![batch.clone()]);
    assert_eq!(s.read_batches(&b).unwrap(), vec![batch]);
    assert_eq!(
        s.unvalidated_decodes(),
        1,
        "spilled blocks are validated again"
    );
    assert!(s.read_batches(&c).is_err());
    assert_eq!(
        s.unvalidated_decodes(),
        1,
        "plain bytes take the validated path"
    );
    // Flip a byte of the spilled block in its segment file: the CRC catches it.
    let file = std::fs::read_dir(dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    assert!(matches!(s.read_batches(&b), Err(Error::Checksum { .. })));
    assert_eq!(s.unvalidated_decodes(), 1);
}

/// A committed merge group replaces its maps for readers in one step: their blocks leave the
/// partition lists and memory, a late attempt of a merged map is refused, and its map output
/// is an error rather than an empty answer.
#[test]
fn a_merge_group_replaces_its_maps_for_readers() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 2)).unwrap();
    for m in 0..3 {
        for p in 0..2 {
            s.put(aid(1, m, p, 0, 0), 1, Bytes::from(vec![m as u8; 100]))
                .unwrap();
        }
        s.commit(ShuffleId(1), m, 0, Some(2)).unwrap();
    }
    let g = MERGE_GROUP_BASE;
    for p in 0..2 {
        s.put(aid(1, g, p, 0, 0), 2, Bytes::from(vec![9u8; 200]))
            .unwrap();
    }
    let before = s.metrics().memory_bytes;
    assert!(
        s.commit_merge(ShuffleId(1), 5, 0, Some(2), &[0, 1])
            .is_err(),
        "not a group id"
    );
    assert!(
        s.commit_merge(ShuffleId(1), g, 0, Some(2), &[0, 7])
            .is_err(),
        "map 7 never ran"
    );
    assert!(
        s.commit_merge(ShuffleId(1), g, 0, Some(2), &[0, 0])
            .is_err(),
        "a map listed twice"
    );
    assert!(s.committed_blocks_of(ShuffleId(1), &[1, 1]).is_err());
    s.commit_merge(ShuffleId(1), g, 0, Some(2), &[0, 1])
        .unwrap();
    assert_eq!(
        s.metrics().memory_bytes,
        before - 400,
        "merged maps' blocks freed"
    );
    let mut maps: Vec<u32> = visible(&s, 1, 2).iter().map(|b| b.map).collect();
    maps.sort();
    assert_eq!(maps, vec![2, 2, g, g]);
    // A repeat of the commit (its reply lost) is a no-op, even once a reader has started;
    // another attempt of the group is refused.
    let _ = visible(&s, 1, 2);
    let again = s
        .commit_merge(ShuffleId(1), g, 0, Some(2), &[0, 1])
        .unwrap();
    assert_eq!(again.len(), 2);
    assert!(s.commit_merge(ShuffleId(1), g, 1, None, &[2]).is_err());
    assert!(
        s.commit_merge(ShuffleId(1), g, 0, Some(2), &[2]).is_err(),
        "the same attempt of other maps is no repeat"
    );
    let mut maps: Vec<u32> = visible(&s, 1, 2).iter().map(|b| b.map).collect();
    maps.sort();
    assert_eq!(maps, vec![2, 2, g, g]);
    assert!(s
        .put(aid(1, 0, 0, 1, 0), 1, Bytes::from_static(b"late"))
        .is_err());
    assert!(s.commit(ShuffleId(1), 0, 1, None).is_err());
    assert!(
        s.committed_blocks_of(ShuffleId(1), &[0]).is_err(),
        "merged once only"
    );
    let err = s.map_output(ShuffleId(1), 1).err().unwrap();
    assert!(err.to_string().contains("merged into group"), "{err}");
}

/// A forward ([`crate::forward`]) is merged again on a holder like a map; other merge groups
/// are not.
#[test]
fn a_merge_takes_a_forward_but_no_other_merge_group() {
    let (_dir, s) = store(1 << 20, 1 << 20);
    s.create_shuffle(info(1, 1)).unwrap();
    let f = FORWARD_GROUP_BASE;
    for m in [0, f] {
        s.put(aid(1, m, 0, 0, 0), 1, Bytes::from(vec![1u8; 10]))
            .unwrap();
        s.commit(ShuffleId(1), m, 0, Some(1)).unwrap();
    }
    let g = MERGE_GROUP_BASE;
    s.put(aid(1, g, 0, 0, 0), 2, Bytes::from(vec![2u8; 20]))
        .unwrap();
    s.commit_merge(ShuffleId(1), g, 0, Some(1), &[0, f])
        .unwrap();
    let g2 = MERGE_GROUP_BASE + 1;
    s.put(aid(1, g2, 0, 0, 0), 2, Bytes::from(vec![2u8; 20]))
        .unwrap();
    let err = s
        .commit_merge(ShuffleId(1), g2, 0, Some(1), &[g])
        .unwrap_err();
    assert!(
        err.to_string().contains("no committed, unmerged output"),
        "{err}"
    );
    let err = s.committed_blocks_of(ShuffleId(1), &[g]).unwrap_err();
    assert!(err.to_string().contains("cannot be merged again"), "{err}");
    let maps: Vec<u32> = visible(&s, 1, 1).iter().map(|b| b.map).collect();
    assert_eq!(maps, vec![g]);
}

/// Once a reader has listed a partition, or the shuffle is sealed, a merge is refused and
/// changes nothing; the group's pending blocks are removed by aborting its attempt.
#[test]
fn merges_are_refused_once_reading_started_or_sealed() {
    for seal_first in [false, true] {
        let (_dir, s) = store(1 << 20, 1 << 20);
        s.create_shuffle(info(1, 1)).unwrap();
        for m in 0..2 {
            s.put(aid(1, m, 0, 0, 0), 1, Bytes::from(vec![1u8; 10]))
                .unwrap();
            s.commit(ShuffleId(1), m, 0, Some(1)).unwrap();
        }
        let g = MERGE_GROUP_BASE;
        s.put(aid(1, g, 0, 0, 0), 2, Bytes::from(vec![2u8; 20]))
            .unwrap();
        if seal_first {
            s.seal(ShuffleId(1)).unwrap();
        } else {
            s.partition_since(ShuffleId(1), 0, 0).unwrap();
        }
        assert!(s
            .commit_merge(ShuffleId(1), g, 0, Some(1), &[0, 1])
            .is_err());
        assert!(
            s.committed_blocks_of(ShuffleId(1), &[0, 1]).is_err(),
            "refused up front"
        );
        s.abort(ShuffleId(1), g, 0);
        let maps: Vec<u32> = visible(&s, 1, 1).iter().map(|b| b.map).collect();
        assert_eq!(maps, vec![0, 1], "seal first: {seal_first}");
        assert_eq!(s.metrics().memory_bytes, 20);
    }
}

/// Rows `keys` of an Int32 column "a", as the one-column shuffles here expect.
fn ints(keys: &[i32]) -> RecordBatch {
    RecordBatch::try_new(
        info(0, 1).schema,
        vec![Arc::new(arrow::array::Int32Array::from(keys.to_vec()))],
    )
    .unwrap()
}

fn values(batches: &[RecordBatch]) -> Vec<i32> {
    let mut v: Vec<i32> = batches
        .iter()
        .flat_map(|b| {
            let a = b
                .column(0)
                .as_any()
                .downcast_ref::<arrow::array::Int32Array>();
            a.unwrap().values().to_vec()
        })
        .collect();
    v.sort();
    v
}

/// A packed block holding key k in partition k % 3 (k in 0..20, key 5 missing so partition 2
/// holds 4..), put as the map task or a push would put it.
fn put_packed(s: &BlockStore, shuffle: u64, map: u32, pushed: bool) -> BlockId {
    let keys: Vec<i32> = (0..20).filter(|k| *k != 5).collect();
    let assignment: Vec<u32> = keys.iter().map(|k| (*k % 3) as u32).collect();
    let sorted = crate::packed::sort_by_holder(&ints(&keys), &assignment, 3, &[0, 0, 0]).unwrap();
    let (_, rows, ends) = sorted.into_iter().next().unwrap();
    let ends = crate::packed::Ends::new(ends, 3, rows.num_rows() as u64).unwrap();
    let block =
        crate::packed::encode(&info(0, 1).schema, &rows, &ends, crate::Compression::None).unwrap();
    let id = aid(shuffle, map, crate::packed::PACKED, 0, 0);
    let n = rows.num_rows() as u64;
    if pushed {
        s.put(id, n, block.into_bytes()).unwrap();
    } else {
        s.put_encoded_with(id, n, block, Some(ends)).unwrap();
    }
    id
}

#[test]
fn packed_blocks_are_listed_and_read_per_partition_and_merged() {
    for budget in [u64::MAX, 0] {
        let (_dir, s) = store(budget, 1 << 20);
        s.create_shuffle(info(9, 3)).unwrap();
        let a = put_packed(&s, 9, 0, false);
        let b = put_packed(&s, 9, 1, true);
        // A plain block of partition 1 beside them.
        let plain = aid(9, 2, 1, 0, 0);
        let data = crate::block::encode_block(
            &info(0, 1).schema,
            &[ints(&[100, 103])],
            crate::Compression::None,
        )
        .unwrap();
        s.put(plain, 2, data).unwrap();
        for m in 0..3 {
            s.commit(ShuffleId(9), m, 0, Some(1)).unwrap();
        }
        // Each packed block is listed in the partitions it has rows of; a reader of a
        // partition gets only that partition's rows, from the store or as bytes.
        for p in 0..3u32 {
            let (ids, _, _) = s.partition_since(ShuffleId(9), p, 0).unwrap();
            assert!(ids.contains(&a) && ids.contains(&b));
            let mut expect: Vec<i32> = (0..20).filter(|k| *k != 5 && k % 3 == p as i32).collect();
            expect.extend(expect.clone());
            let got: Vec<RecordBatch> = [a, b]
                .iter()
                .flat_map(|id| s.read_part(id, Some(p)).unwrap())
                .collect();
            assert_eq!(values(&got), {
                expect.sort();
                expect.clone()
            });
            let bytes = s.get_part(&a, Some(p)).unwrap();
            let (schema, batches) = crate::block::decode_block(&bytes).unwrap();
            assert_eq!(schema, info(0, 1).schema);
            assert_eq!(values(&batches).len(), expect.len() / 2);
        }
        // A map output read gets the whole block, with the shuffle's schema.
        let whole = s.read_batches(&a).unwrap();
        assert_eq!(
            (values(&whole).len(), whole[0].schema()),
            (19, info(0, 1).schema)
        );
    }
}

#[test]
fn a_merge_cuts_packed_blocks_by_partition() {
    let (_dir, s) = store(u64::MAX, 1 << 20);
    s.create_shuffle(info(10, 3)).unwrap();
    let shuffle = ShuffleId(10);
    put_packed(&s, 10, 0, false);
    put_packed(&s, 10, 1, true);
    let plain = aid(10, 2, 2, 0, 0);
    let data = crate::block::encode_block(
        &info(0, 1).schema,
        &[ints(&[500])],
        crate::Compression::None,
    )
    .unwrap();
    s.put(plain, 1, data).unwrap();
    for m in 0..3 {
        s.commit(shuffle, m, 0, Some(1)).unwrap();
    }
    let ids = s.committed_blocks_of(shuffle, &[0, 1, 2]).unwrap();
    let group = MERGE_GROUP_BASE;
    let out = crate::task::run_merge(
        &s,
        &s.shuffle_info(shuffle).unwrap(),
        ids,
        group,
        0,
        crate::task::MapConfig::default(),
    )
    .unwrap();
    assert_eq!(out.blocks.len(), 3, "one merged block per partition");
    s.commit_merge(shuffle, group, 0, Some(3), &[0, 1, 2])
        .unwrap();
    for p in 0..3u32 {
        let (ids, _, _) = s.partition_since(shuffle, p, 0).unwrap();
        assert_eq!(ids.len(), 1, "partition {p}: only the merged block is left");
        assert_eq!(ids[0].partition, p);
        let mut expect: Vec<i32> = (0..20).filter(|k| *k != 5 && k % 3 == p as i32).collect();
        expect.extend(expect.clone());
        if p == 2 {
            expect.push(500);
        }
        expect.sort();
        assert_eq!(values(&s.read_batches(&ids[0]).unwrap()), expect);
    }
}

#[test]
fn a_packed_block_without_valid_ends_is_refused() {
    let (_dir, s) = store(u64::MAX, 1 << 20);
    s.create_shuffle(info(11, 3)).unwrap();
    let plain = crate::block::encode_block(
        &info(0, 1).schema,
        &[ints(&[1, 2])],
        crate::Compression::None,
    )
    .unwrap();
    let id = aid(11, 0, crate::packed::PACKED, 0, 0);
    let err = s.put(id, 2, plain).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // Ends that do not fit this shuffle (2 partitions' ends for 3) are refused too.
    let rows = ints(&[1, 2]);
    let ends = crate::packed::Ends::new(vec![1, 2], 2, 2).unwrap();
    let block =
        crate::packed::encode(&info(0, 1).schema, &rows, &ends, crate::Compression::None).unwrap();
    assert!(s.put(id, 2, block.into_bytes()).is_err());
}
