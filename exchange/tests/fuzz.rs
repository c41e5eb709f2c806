//! A seeded fuzzer over a real worker's Flight service: every action with valid, mutated and
//! random bodies, `do_get` with mutated tickets, `do_put` with mutated put commands and
//! bodies. Every call must come back with a status within its deadline (no crash, no hang
//! past the deadline), and the same worker process must stay healthy throughout.
//!
//! `FLIGHTSHUFFLE_FUZZ_CASES` sets the cases per kind (default 150: a few seconds in CI) and
//! `FLIGHTSHUFFLE_FUZZ_SEED` the seed. `calibrate` is left out: it measures for seconds by
//! design (its disk sample is capped at 256 MiB).

use arrow::array::{Int64Array, RecordBatch, StringArray};
use arrow_flight::{FlightData, FlightDescriptor, Ticket};
use flightshuffle::cluster::LocalCluster;
use flightshuffle::driver::ShuffleSpec;
use flightshuffle::transport::actions;
use flightshuffle::{partitioner, proto, ShuffleId};
use futures::TryStreamExt;
use prost::Message;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::*;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A mutation of `seed`: as it is, bytes flipped, cut short, grown, or all random.
fn mutate(rng: &mut SmallRng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    match rng.random_range(0..6) {
        0 => {}
        1 | 2 => {
            for _ in 0..rng.random_range(1..4) {
                if !b.is_empty() {
                    let i = rng.random_range(0..b.len());
                    b[i] ^= 1 << rng.random_range(0..8);
                }
            }
        }
        3 => b.truncate(rng.random_range(0..=b.len())),
        4 => b.extend((0..rng.random_range(1..64)).map(|_| rng.random::<u8>())),
        _ => {
            b = (0..rng.random_range(0..128))
                .map(|_| rng.random::<u8>())
                .collect()
        }
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_survives_fuzzed_actions_tickets_and_puts() {
    let cases = env_or("FLIGHTSHUFFLE_FUZZ_CASES", 150);
    let seed = env_or("FLIGHTSHUFFLE_FUZZ_SEED", 7);
    let mut cfg = config(1, 64 << 20);
    cfg.driver.rpc_timeout = Duration::from_secs(2);
    let cluster = LocalCluster::start(cfg).await.unwrap();
    let pid = cluster.pids()[0];
    let w = cluster.driver.worker(0).unwrap();
    // A real shuffle with committed blocks, so mutated messages naming it reach deep code.
    let spec = ShuffleSpec {
        id: ShuffleId(77),
        schema: schema(),
        partitions: 4,
        partitioner: partitioner::hash(&["k"]),
        checksum_inputs: true,
        combine: None,
    };
    cluster.driver.create_shuffle(&spec).await.unwrap();
    let task = proto::MapTask {
        shuffle_id: 77,
        map_id: 0,
        ..Default::default()
    };
    let batch = RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(0..100)),
            Arc::new(StringArray::from_iter_values(
                (0..100).map(|i| format!("v{i}")),
            )),
        ],
    )
    .unwrap();
    let done = w
        .put_map(
            &task,
            schema(),
            Box::pin(futures::stream::iter(vec![Ok(batch.clone())])),
        )
        .await
        .unwrap();
    let first = done.blocks[0];
    let key = first.key.unwrap();
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        (
            actions::CREATE_SHUFFLE,
            proto::CreateShuffle {
                shuffle_id: 78,
                schema_ipc: flightshuffle::block::encode_schema(&schema())
                    .unwrap()
                    .to_vec(),
                partitions: 4,
                partitioner: Some(partitioner::hash(&["k"])),
                combine: None,
                order: 1,
                group: 1,
                storage: None,
            }
            .encode_to_vec(),
        ),
        (
            actions::RUN_MAP,
            proto::MapTask {
                source: Some(proto::TaskSource {
                    kind: "lineitem".into(),
                    payload: br#"{"first":0,"rows":10,"seed":1,"batch_rows":5}"#.to_vec(),
                }),
                map_id: 5,
                ..task.clone()
            }
            .encode_to_vec(),
        ),
        (
            actions::RUN_REDUCE,
            proto::ReduceTask {
                shuffle_id: 77,
                partition: 1,
                peers: vec![w.addr.clone()],
                sink: "checksum".into(),
            }
            .encode_to_vec(),
        ),
        (
            actions::FOLD,
            proto::FoldTask {
                shuffle_id: 77,
                partition: 1,
                blocks: vec![proto::BlockLocation {
                    key: Some(key),
                    peer: w.addr.clone(),
                }],
                reducer: "checksum".into(),
                first: true,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            actions::COMMIT,
            proto::CommitTask {
                shuffle_id: 77,
                map_id: 0,
                attempt: 0,
                blocks: done.blocks.len() as u32,
                merged_maps: vec![],
            }
            .encode_to_vec(),
        ),
        (
            actions::CANCEL,
            proto::CommitTask {
                shuffle_id: 77,
                map_id: 3,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            actions::MERGE,
            proto::MergeTask {
                shuffle_id: 77,
                group: 1 << 31,
                attempt: 0,
                maps: vec![0],
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            // A forward: the map's blocks to holders (here a placement of the wrong length).
            actions::MERGE,
            proto::MergeTask {
                shuffle_id: 77,
                group: (1 << 31) + 1,
                attempt: 0,
                maps: vec![0],
                push_peers: vec![w.addr.clone()],
                push_to: vec![0; 3],
                worker_index: 0,
            }
            .encode_to_vec(),
        ),
        (
            actions::SEAL_SHUFFLE,
            proto::ShuffleRef {
                shuffle_id: 78,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        // Objects to read through a store the shuffle was never registered with.
        (
            actions::SEAL_SHUFFLE,
            proto::ShuffleRef {
                shuffle_id: 78,
                objects: vec![proto::StoredObject {
                    path: "../../etc/passwd".into(),
                    size: u64::MAX,
                    ..Default::default()
                }],
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            actions::DROP_SHUFFLE,
            proto::ShuffleRef {
                shuffle_id: 78,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (actions::STATS, vec![]),
        (actions::HEALTH, vec![]),
        ("no-such-action", vec![1, 2, 3]),
    ];
    let tickets: Vec<Vec<u8>> = [
        proto::ticket::Kind::Block(key),
        proto::ticket::Kind::Raw(key),
        proto::ticket::Kind::Partition(proto::PartitionTicket {
            shuffle_id: 77,
            partition: 1,
            timeout_ms: 200,
            ..Default::default()
        }),
        proto::ticket::Kind::MapOutput(proto::MapOutputTicket {
            shuffle_id: 77,
            map_id: 0,
        }),
    ]
    .into_iter()
    .map(|k| proto::Ticket { kind: Some(k) }.encode_to_vec())
    .collect();
    let puts: Vec<Vec<u8>> = [
        proto::put_command::Kind::Map(proto::MapTask {
            map_id: 9,
            ..task.clone()
        }),
        proto::put_command::Kind::Block(key),
        proto::put_command::Kind::Push(proto::PushBlocks {
            shuffle_id: 77,
            map_id: 11,
            attempt: 0,
        }),
    ]
    .into_iter()
    .map(|k| proto::PutCommand { kind: Some(k) }.encode_to_vec())
    .collect();
    let body: Vec<FlightData> = arrow_flight::encode::FlightDataEncoderBuilder::new()
        .build(futures::stream::iter(vec![Ok(batch)]))
        .try_collect()
        .await
        .unwrap();

    let mut raw = raw_client(&cluster, 0).await;
    let auth = format!("Bearer {}", cluster.driver.token());
    let mut rng = SmallRng::seed_from_u64(seed);
    let deadline = Duration::from_secs(5);
    let mut statuses = std::collections::BTreeMap::<String, u64>::new();
    for case in 0..cases {
        // An action.
        let (kind, seed_body) = &seeds[rng.random_range(0..seeds.len())];
        let r = tokio::time::timeout(
            deadline,
            w.action(kind, mutate(&mut rng, seed_body), Duration::from_secs(2)),
        )
        .await
        .unwrap_or_else(|_| panic!("action {kind} did not come back (case {case})"));
        let o = outcome(&r);
        // Internal: a failure the worker did not expect; name the action that met it.
        let o = if o == "Internal" {
            format!("{o}:{kind}")
        } else {
            o
        };
        *statuses.entry(format!("action:{o}")).or_default() += 1;
        // A ticket.
        let t = rng.random_range(0..tickets.len());
        let ticket = mutate(&mut rng, &tickets[t]);
        let mut req = tonic::Request::new(Ticket {
            ticket: ticket.into(),
        });
        req.metadata_mut()
            .insert("authorization", auth.parse().unwrap());
        let got = tokio::time::timeout(deadline, async {
            match raw.do_get(req).await {
                Ok(s) => s.into_inner().try_collect::<Vec<_>>().await.map(|_| ()),
                Err(s) => Err(s),
            }
        })
        .await
        .unwrap_or_else(|_| panic!("do_get did not come back (case {case})"));
        *statuses
            .entry(format!("get:{:?}", got.err().map(|s| s.code())))
            .or_default() += 1;
        // A put: a mutated command on the first message, the batch's messages mutated after.
        let mut msgs = body.clone();
        let c = rng.random_range(0..puts.len());
        let cmd = mutate(&mut rng, &puts[c]);
        msgs[0].flight_descriptor = Some(FlightDescriptor::new_cmd(cmd));
        if rng.random_bool(0.5) {
            let i = rng.random_range(0..msgs.len());
            msgs[i].data_header = mutate(&mut rng, &msgs[i].data_header).into();
        }
        if rng.random_bool(0.3) {
            let i = rng.random_range(0..msgs.len());
            msgs[i].app_metadata = mutate(&mut rng, &msgs[i].app_metadata).into();
        }
        let mut req = tonic::Request::new(futures::stream::iter(msgs));
        req.metadata_mut()
            .insert("authorization", auth.parse().unwrap());
        let put = tokio::time::timeout(deadline, async {
            match raw.do_put(req).await {
                Ok(s) => s.into_inner().try_collect::<Vec<_>>().await.map(|_| ()),
                Err(s) => Err(s),
            }
        })
        .await
        .unwrap_or_else(|_| panic!("do_put did not come back (case {case})"));
        *statuses
            .entry(format!("put:{:?}", put.err().map(|s| s.code())))
            .or_default() += 1;
        if case % 25 == 0 {
            w.health(Duration::from_secs(5))
                .await
                .unwrap_or_else(|e| panic!("worker unhealthy after case {case}: {e}"));
        }
    }
    w.health(Duration::from_secs(5)).await.unwrap();
    assert_eq!(cluster.pids()[0], pid, "the same worker process throughout");
    assert_eq!(cluster.driver.replacements(), 0);
    eprintln!("fuzz: {} cases x 3 calls, seed {seed}: {statuses:?}", cases);
}

fn outcome<T>(r: &flightshuffle::Result<T>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(flightshuffle::Error::Remote { code, .. }) => format!("{code:?}"),
        Err(e) => format!(
            "local:{}",
            e.to_string().chars().take(24).collect::<String>()
        ),
    }
}
