//! End-to-end tests of the data plane with real worker processes on loopback.

use arrow::array::{Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, Ticket};
use flightshuffle::block::Slice;
use flightshuffle::checksum::Checksum;
use flightshuffle::cluster::LocalCluster;
use flightshuffle::driver::{MapInput, ShuffleSpec};
use flightshuffle::strategy::{pull, StrategyOptions};
use flightshuffle::{partitioner, proto, Error, ShuffleId};
use futures::TryStreamExt;
use prost::Message;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_shuffle_preserves_the_multiset_in_memory_and_spilling() {
    let input = batches(40, 2_500);
    let total: usize = input.iter().map(|b| b.get_array_memory_size()).sum();
    for budget in [1u64 << 30, (total / 8 / 3) as u64] {
        let cluster = LocalCluster::start(config(3, budget)).await.unwrap();
        let parts = shuffle(&cluster, &input, 6, 7).await.unwrap();
        let all: Vec<RecordBatch> = parts.iter().flatten().cloned().collect();
        assert_eq!(checksum(&all), checksum(&input));
        assert_keys_not_split(&parts);
        let stats = cluster.driver.stats().await.unwrap();
        let spilled: u64 = stats.iter().map(|s| s.spilled_bytes).sum();
        if budget < (1 << 30) {
            assert!(spilled > 0, "budget {budget} of {total} should spill");
            assert!(stats.iter().all(|s| s.memory_bytes <= budget));
        } else {
            assert_eq!(spilled, 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_fails_the_shuffle_quickly_names_it_and_is_replaced() {
    let mut cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let spec = ShuffleSpec {
        id: ShuffleId::random(),
        schema: flightshuffle::synthetic::lineitem_schema(),
        partitions: 8,
        partitioner: partitioner::hash(&["l_orderkey"]),
        checksum_inputs: true,
        combine: None,
    };
    driver.create_shuffle(&spec).await.unwrap();
    let inputs = (0..60u64).map(|m| {
        let slice = flightshuffle::synthetic::LineitemSlice {
            first_attempt_delay_ms: 0,
            first: m * 200_000,
            rows: 200_000,
            seed: 1,
            batch_rows: 8192,
        };
        MapInput::Source(proto::TaskSource {
            kind: flightshuffle::synthetic::LINEITEM_SOURCE.into(),
            payload: serde_json::to_vec(&slice).unwrap(),
        })
    });
    let run = tokio::spawn({
        let driver = driver.clone();
        let spec = spec.clone();
        async move {
            pull::map_side(
                &driver,
                &spec,
                futures::stream::iter(inputs),
                StrategyOptions::default(),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let victim_pid = cluster.pids()[1];
    let victim_addr = driver.worker(1).unwrap().addr;
    let killed_at = Instant::now();
    cluster.kill_worker(1).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the shuffle must fail within 30 s")
        .unwrap()
        .unwrap_err();
    assert!(killed_at.elapsed() < Duration::from_secs(30));
    match &err {
        Error::WorkerLost { worker, addr, .. } => {
            assert_eq!(*worker, 1, "{err}");
            assert_eq!(addr, &victim_addr);
        }
        other => panic!("expected WorkerLost, got {other}"),
    }
    let _ = driver.drop_shuffle(spec.id).await;
    // The lost worker is replaced by a new process in its slot (its spill dir removed), and
    // the cluster works again: the next shuffle waits for the replacement and is exact.
    driver
        .wait_all_live(flightshuffle::driver::REPLACE_TIMEOUT)
        .await
        .unwrap();
    assert_ne!(cluster.pids()[1], victim_pid);
    assert_ne!(driver.worker(1).unwrap().addr, victim_addr);
    assert_eq!(driver.generation(1), 1);
    assert!(!cluster.spill_root.join("worker-1").exists());
    let again = ShuffleSpec {
        id: ShuffleId::random(),
        ..spec.clone()
    };
    driver.create_shuffle(&again).await.unwrap();
    let inputs = (0..6u64).map(|m| {
        let slice = flightshuffle::synthetic::LineitemSlice {
            first_attempt_delay_ms: 0,
            first: m * 10_000,
            rows: 10_000,
            seed: 1,
            batch_rows: 4096,
        };
        MapInput::Source(proto::TaskSource {
            kind: flightshuffle::synthetic::LINEITEM_SOURCE.into(),
            payload: serde_json::to_vec(&slice).unwrap(),
        })
    });
    let mapped = pull::map_side(
        &driver,
        &again,
        futures::stream::iter(inputs),
        Default::default(),
    )
    .await
    .unwrap();
    let mut out = flightshuffle::checksum::Checksum::default();
    for p in 0..again.partitions {
        let s = driver.read_partition(again.id, p, true).await.unwrap();
        for b in s.try_collect::<Vec<_>>().await.unwrap() {
            out.add(flightshuffle::checksum::Checksum::of_batch(&b).unwrap());
        }
    }
    assert_eq!((out, out.rows), (mapped.input, 60_000));
    let pids = cluster.pids();
    drop(cluster);
    for pid in pids.into_iter().chain([victim_pid]) {
        let alive = std::path::Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z ");
        assert!(!alive, "worker process {pid} left behind");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_statuses() {
    let cluster = LocalCluster::start(config(1, 1 << 20)).await.unwrap();
    let mut raw = raw_client(&cluster, 0).await;
    // No token, then a wrong one.
    let status = raw
        .do_action(Action {
            r#type: "health".into(),
            body: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(Action {
        r#type: "health".into(),
        body: Default::default(),
    });
    req.metadata_mut()
        .insert("authorization", "Bearer wrong".parse().unwrap());
    assert_eq!(
        raw.do_action(req).await.unwrap_err().code(),
        tonic::Code::Unauthenticated
    );

    let w = cluster.driver.worker(0).unwrap();
    let code = |e: Error| match e {
        Error::Remote { code, .. } => code,
        other => panic!("expected a remote status, got {other}"),
    };
    // Malformed bodies and unknown actions.
    assert_eq!(
        code(
            w.action("run_map", vec![0xff, 0xff, 0xff], Duration::from_secs(5))
                .await
                .unwrap_err()
        ),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(
            w.action("explode", vec![], Duration::from_secs(5))
                .await
                .unwrap_err()
        ),
        tonic::Code::InvalidArgument
    );
    // Unknown shuffle.
    assert_eq!(
        code(
            w.read_partition(42, 0, false, Slice::WHOLE)
                .await
                .err()
                .unwrap()
        ),
        tonic::Code::NotFound
    );
    assert_eq!(
        code(w.shuffle_action("drop_shuffle", 42).await.unwrap_err()),
        tonic::Code::NotFound
    );
    // Malformed ticket, through a client that carries the right token.
    let token_hdr = format!("Bearer {}", cluster.driver.token());
    // The token reached the worker on its stdin, not in its environment (user code there
    // must not see it).
    let environ = std::fs::read_to_string(format!("/proc/{}/environ", cluster.pids()[0])).unwrap();
    assert!(
        !environ.contains(cluster.driver.token()),
        "token in a worker's environment"
    );
    assert!(!environ.contains("FLIGHTSHUFFLE_TOKEN"));
    let mut req = tonic::Request::new(Ticket {
        ticket: vec![0x0a, 0xff, 0x01].into(),
    });
    req.metadata_mut()
        .insert("authorization", token_hdr.parse().unwrap());
    let status = match raw.do_get(req).await {
        Err(s) => s,
        Ok(_) => panic!("a malformed ticket must fail"),
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");

    // A map input with another schema than the shuffle's.
    let spec = spec_k(2);
    cluster.driver.create_shuffle(&spec).await.unwrap();
    let other = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, false)]));
    let b =
        RecordBatch::try_new(other.clone(), vec![Arc::new(StringArray::from(vec!["x"]))]).unwrap();
    let task = proto::MapTask {
        shuffle_id: spec.id.0,
        map_id: 0,
        attempt: 0,
        source: None,
        skip_checksum: false,
        ..Default::default()
    };
    // A push placement that names no valid holder is refused before any row is read.
    let bad_push = proto::MapTask {
        push_peers: vec!["127.0.0.1:1".into()],
        push_to: vec![5],
        ..task.clone()
    };
    let err = w
        .put_map(
            &bad_push,
            other.clone(),
            Box::pin(futures::stream::iter(vec![Ok(b.clone())])),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Remote { code: tonic::Code::InvalidArgument, message, .. } if message.contains("push placement")),
        "{err}"
    );
    let err = w
        .put_map(&task, other, Box::pin(futures::stream::iter(vec![Ok(b)])))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("schema mismatch"), "{err}");
    assert_eq!(code(err), tonic::Code::InvalidArgument);
    // A partitioner naming a missing column is refused when the shuffle is created.
    let bad = ShuffleSpec {
        partitioner: partitioner::hash(&["missing"]),
        id: ShuffleId::random(),
        ..spec
    };
    let err = cluster.driver.create_shuffle(&bad).await.unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
    let _ = proto::Ticket::default().encode_to_vec();

    // Bounded inputs: a partition count over the cap, on the driver and on the worker.
    let huge = ShuffleSpec {
        partitions: 1 << 31,
        id: ShuffleId::random(),
        partitioner: partitioner::hash(&["k"]),
        ..bad
    };
    let err = cluster.driver.create_shuffle(&huge).await.unwrap_err();
    assert!(err.to_string().contains("at most 65536"), "{err}");
    let create = |partitions: u32, schema_ipc: Vec<u8>| proto::CreateShuffle {
        shuffle_id: 7,
        schema_ipc,
        partitions,
        partitioner: Some(partitioner::hash(&["k"])),
        combine: None,
        order: 1,
        group: 0,
        storage: None,
    };
    let schema_ipc = flightshuffle::block::encode_schema(&schema())
        .unwrap()
        .to_vec();
    let err = w
        .create_shuffle(&create(u32::MAX, schema_ipc.clone()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("at most 65536"), "{err}");
    assert_eq!(code(err), tonic::Code::InvalidArgument);
    // Garbage where a schema should be.
    for garbage in [vec![], vec![0xff; 9], (0..200u8).collect::<Vec<_>>()] {
        let err = w.create_shuffle(&create(2, garbage)).await.unwrap_err();
        assert_eq!(code(err), tonic::Code::InvalidArgument);
    }
    // A store the worker cannot open (an unknown scheme, an option that is not one): refused,
    // naming it.
    for (url, option) in [("gopher://x/y", None), ("s3://b/p", Some("no_such_option"))] {
        let mut msg = create(2, schema_ipc.clone());
        msg.storage = Some(proto::Storage {
            url: url.into(),
            options: option
                .map(|o| (o.to_string(), "v".to_string()))
                .into_iter()
                .collect(),
            prefix: "p".into(),
            ..Default::default()
        });
        let err = w.create_shuffle(&msg).await.unwrap_err();
        let text = err.to_string();
        assert!(text.contains(option.unwrap_or(url)), "{text}");
        assert_eq!(code(err), tonic::Code::InvalidArgument);
    }
    // Map input whose buffers are compressed (they name the length to allocate): refused.
    let lz4 = arrow::ipc::writer::IpcWriteOptions::default()
        .try_with_compression(Some(arrow::ipc::CompressionType::LZ4_FRAME))
        .unwrap();
    let batch = RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(vec![1, 2, 3])),
            Arc::new(StringArray::from(vec!["a", "b", "c"])),
        ],
    )
    .unwrap();
    let put = proto::PutCommand {
        kind: Some(proto::put_command::Kind::Map(proto::MapTask {
            shuffle_id: spec.id.0,
            map_id: 9,
            ..Default::default()
        })),
    };
    let flights: Vec<arrow_flight::FlightData> =
        arrow_flight::encode::FlightDataEncoderBuilder::new()
            .with_options(lz4)
            .with_flight_descriptor(Some(arrow_flight::FlightDescriptor::new_cmd(
                put.encode_to_vec(),
            )))
            .build(futures::stream::iter(vec![Ok(batch)]))
            .try_collect()
            .await
            .unwrap();
    let mut req = tonic::Request::new(futures::stream::iter(flights));
    req.metadata_mut()
        .insert("authorization", token_hdr.parse().unwrap());
    let status = match raw.do_put(req).await {
        Err(s) => s,
        Ok(r) => match r.into_inner().message().await {
            Err(s) => s,
            Ok(m) => panic!("a compressed map input must be refused, got {m:?}"),
        },
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
    assert!(status.message().contains("compressed"), "{status}");
    // The worker is still well.
    w.health(Duration::from_secs(5)).await.unwrap();
}

/// Streaming strategy: one partial result per round, the row count folded so far grows with
/// progress, and the final partial's rows and checksum equal the input's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_rounds_fold_to_the_exact_multiset() {
    let partials = streaming_partials(false, 4).await;
    assert_eq!(partials.len(), 4);
    for (i, p) in partials.iter().enumerate() {
        assert_eq!(p.is_final, i == 3);
    }
}

/// Rounds by completion: the first round folds one map per worker (2), then the other 10
/// committed maps are folded in 2 rounds of 5; every map is folded exactly once and only the
/// last round is final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_rounds_by_completion_fold_every_map_once() {
    let partials = streaming_partials(true, 2).await;
    assert_eq!(partials.len(), 3);
    for (i, p) in partials.iter().enumerate() {
        assert_eq!(p.maps_done, [2, 7, 12][i]);
        assert_eq!((p.rounds, p.is_final), (3, i == 2));
    }
}

/// Run a 12-map streaming job in `rounds` rounds (fixed, or by completion) and check what
/// every mode shares: rounds in order, folded rows growing with progress, an exact final
/// multiset.
async fn streaming_partials(
    by_completion: bool,
    rounds: usize,
) -> Vec<flightshuffle::strategy::streaming::Partial> {
    use flightshuffle::strategy::streaming::{self, StreamingJob};
    let mut cluster = LocalCluster::start(config(2, 1 << 30)).await.unwrap();
    let input = batches(12, 500);
    let expected = checksum(&input);
    let inputs: Vec<MapInput> = input
        .iter()
        .map(|b| MapInput::Stream(Box::pin(futures::stream::iter(vec![Ok(b.clone())]))))
        .collect();
    let job = StreamingJob {
        spec: spec_k(3),
        weights: vec![500; inputs.len()],
        unit_sizes: Vec::new(),
        inputs,
        rounds,
        by_completion,
        reducer: flightshuffle::source::CHECKSUM_REDUCER.to_string(),
        payload: vec![],
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(8);
    let driver = cluster.driver.clone();
    let run =
        tokio::spawn(
            async move { streaming::run(&driver, job, StrategyOptions::default(), tx).await },
        );
    let mut partials = Vec::new();
    while let Some(p) = rx.recv().await {
        partials.push(p.unwrap());
    }
    run.await.unwrap();
    assert!(partials.last().is_some_and(|p| p.is_final));
    let mut last_rows = 0;
    for (i, p) in partials.iter().enumerate() {
        assert_eq!(p.round, i);
        assert_eq!(p.partitions.len(), 3);
        let mut total = Checksum::default();
        for part in &p.partitions {
            total.add(checksum_rows(part));
        }
        assert!(total.rows > last_rows, "rows folded grow with every round");
        assert!((p.progress - total.rows as f64 / 6000.0).abs() < 1e-9);
        last_rows = total.rows;
        if p.is_final {
            assert_eq!(total, expected);
        }
    }
    cluster.stop();
    partials
}

/// Small replies are not held back by Nagle + delayed ACK (≈40 ms each on Linux): two
/// concurrent actions on one connection come back in well under a millisecond typically;
/// the bound leaves room for a loaded CI machine yet fails with delayed ACKs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_small_calls_on_one_connection_are_not_delayed() {
    let cluster = LocalCluster::start(config(1, 1 << 20)).await.unwrap();
    let w = cluster.driver.worker(0).unwrap();
    let t = Duration::from_secs(5);
    w.health(t).await.unwrap();
    let mut pairs = Vec::new();
    for _ in 0..60 {
        let start = Instant::now();
        let (a, b) = futures::join!(w.health(t), w.stats());
        a.unwrap();
        b.unwrap();
        pairs.push(start.elapsed());
    }
    pairs.sort();
    let p50 = pairs[pairs.len() / 2];
    assert!(
        p50 < Duration::from_millis(15),
        "p50 of two concurrent calls: {p50:?}"
    );
}

/// `skip_checksum` reaches the worker: a map of a shuffle that does not checksum its inputs
/// reports the rows but no checksum; one that does reports both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_tasks_checksum_only_when_the_shuffle_asks() {
    let cluster = LocalCluster::start(config(1, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let mut seen = Vec::new();
    for checksum in [true, false] {
        let spec = lineitem_spec(checksum);
        driver.create_shuffle(&spec).await.unwrap();
        let done = driver
            .submit_map(spec.id, 0, 0, MapInput::Source(lineitem_task(5000)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(done.input.rows, 5000);
        seen.push(done.input.sum);
        driver.drop_shuffle(spec.id).await.unwrap();
    }
    assert_ne!(seen[0], 0, "a checksummed map reports its checksum");
    assert_eq!(seen[1], 0, "a map told to skip the checksum computes none");
}

async fn rows_visible(
    w: &flightshuffle::transport::client::WorkerClient,
    spec: &ShuffleSpec,
) -> usize {
    let mut rows = 0;
    for p in 0..spec.partitions {
        let s = w
            .read_partition(spec.id.0, p, false, Slice::WHOLE)
            .await
            .unwrap();
        let batches: Vec<RecordBatch> = s.try_collect().await.unwrap();
        rows += batches.iter().map(|b| b.num_rows()).sum::<usize>();
    }
    rows
}

/// The commit protocol over real Flight: a finished attempt is invisible until committed, a
/// second attempt of a committed map is refused and leaves nothing, and an attempt whose call
/// is dropped mid-way is aborted with its blocks removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_are_visible_only_once_committed() {
    let cluster = LocalCluster::start(config(1, 1 << 30)).await.unwrap();
    let w = cluster.driver.worker(0).unwrap();
    let spec = lineitem_spec(false);
    cluster.driver.create_shuffle(&spec).await.unwrap();
    let task = |map_id, attempt, rows| proto::MapTask {
        shuffle_id: spec.id.0,
        map_id,
        attempt,
        source: Some(lineitem_task(rows)),
        skip_checksum: true,
        ..Default::default()
    };
    let done = w.run_map(&task(0, 0, 3000)).await.unwrap();
    assert!(!done.blocks.is_empty());
    assert_eq!(
        rows_visible(&w, &spec).await,
        0,
        "pending blocks are invisible"
    );
    let commit = |map_id, attempt, blocks| proto::CommitTask {
        shuffle_id: spec.id.0,
        map_id,
        attempt,
        blocks,
        merged_maps: vec![],
    };
    let wrong = w.commit(&commit(0, 0, 99)).await.unwrap_err();
    assert!(wrong.to_string().contains("reported 99 blocks"), "{wrong}");
    w.commit(&commit(0, 0, done.blocks.len() as u32))
        .await
        .unwrap();
    assert_eq!(rows_visible(&w, &spec).await, 3000);
    let blocks_before = w.stats().await.unwrap().blocks;
    // A duplicate attempt of the committed map: refused, nothing left behind.
    let err = w.run_map(&task(0, 1, 3000)).await.unwrap_err();
    assert!(err.to_string().contains("already committed"), "{err}");
    assert_eq!(w.stats().await.unwrap().blocks, blocks_before);
    // An attempt whose caller goes away mid-way: aborted, its blocks removed.
    let slow_task = task(1, 0, 4_000_000);
    let slow = w.run_map(&slow_task);
    assert!(tokio::time::timeout(Duration::from_millis(300), slow)
        .await
        .is_err());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let blocks = w.stats().await.unwrap().blocks;
        if blocks == blocks_before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{blocks} blocks left by a dropped attempt"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rows_visible(&w, &spec).await, 3000);
    // Seal: no more commits or puts.
    w.shuffle_action("seal_shuffle", spec.id.0).await.unwrap();
    let late = w.run_map(&task(2, 0, 10)).await.unwrap_err();
    assert!(late.to_string().contains("sealed"), "{late}");
}

/// A reducer reads the blocks its own worker holds from the store, not over Flight: reducing a
/// partition whose blocks all live on the reducer's worker costs that worker exactly the one
/// call that runs the reduce (a loopback read would add a `do_get`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_reads_its_own_workers_blocks_without_a_call() {
    let cluster = LocalCluster::start(config(1, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let spec = lineitem_spec(true);
    driver.create_shuffle(&spec).await.unwrap();
    let done = driver
        .submit_map(spec.id, 0, 0, MapInput::Source(lineitem_task(20_000)))
        .await
        .unwrap()
        .unwrap();
    driver.seal(spec.id).await.unwrap();
    let w = driver.worker(0).unwrap();
    let mut rows = 0;
    for p in 0..spec.partitions {
        let before = w.stats().await.unwrap().rpcs;
        let r = driver.run_reduce(spec.id, p, 0, "checksum").await.unwrap();
        let after = w.stats().await.unwrap().rpcs;
        assert_eq!(
            after - before,
            2,
            "the reduce call and this stats call, nothing else"
        );
        rows += r.input_rows;
    }
    assert_eq!(rows, done.input.rows);
}

/// A user shuffle job (`flightshuffle::job`, what the bindings run) keeps the multiset with every
/// partitioner, range partitions come back ordered, and bad options are clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shuffle_jobs_keep_the_multiset_with_every_partitioner() {
    use flightshuffle::job::{self, ShuffleJob, ShuffleOptions};
    let cluster = LocalCluster::start(config(2, 1 << 30)).await.unwrap();
    let input = batches(12, 500);
    let want = checksum(&input);
    for (name, partitions) in [("hash", 5), ("range", 4), ("round_robin", 3), ("range", 1)] {
        let opts = ShuffleOptions {
            by: vec!["k".into()],
            partitions,
            partitioner: name.parse().unwrap(),
            map_bytes: 20_000,
            strategy: StrategyOptions::named("pull").unwrap(),
        };
        let it: job::Input = Box::new(input.clone().into_iter().map(Ok));
        let (spec, it) = job::prepare(&schema(), it, &opts).unwrap();
        let job = ShuffleJob::start(cluster.driver.clone(), spec, it, &opts)
            .await
            .unwrap();
        let mut parts = Vec::new();
        while let Some(p) = job.next_partition().await {
            let (i, b) = p.unwrap();
            assert_eq!(i as usize, parts.len(), "{name}: partitions in order");
            parts.push(b);
        }
        assert_eq!(parts.len(), partitions as usize);
        let summary = job.mapped().await.unwrap();
        assert!(summary.maps > 1, "{name}: input cut into map tasks");
        assert_eq!(summary.rows, want.rows);
        assert_eq!(checksum(&parts.concat()), want, "{name}");
        if name == "hash" {
            assert_keys_not_split(&parts);
        }
        if name == "range" {
            let bounds: Vec<(i64, i64)> = parts
                .iter()
                .filter(|p| p.iter().any(|b| b.num_rows() > 0))
                .map(|p| {
                    let keys: Vec<i64> = p
                        .iter()
                        .flat_map(|b| {
                            let a = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                            a.values().to_vec()
                        })
                        .collect();
                    (*keys.iter().min().unwrap(), *keys.iter().max().unwrap())
                })
                .collect();
            assert!(bounds.windows(2).all(|w| w[0].1 <= w[1].0), "{bounds:?}");
        }
        job.close().await.unwrap();
    }
    assert!("zigzag".parse::<job::PartitionerKind>().is_err());
    assert!(StrategyOptions::named("scatter").is_err());
    let opts = ShuffleOptions {
        by: vec!["k".into()],
        partitions: 0,
        partitioner: job::PartitionerKind::Hash,
        map_bytes: 1,
        strategy: StrategyOptions::default(),
    };
    let empty: job::Input = Box::new(std::iter::empty());
    let err = job::prepare(&schema(), empty, &opts).err().unwrap();
    assert!(err.to_string().contains("at least 1"), "{err}");
    let narrow = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])),
        vec![Arc::new(Int64Array::from(vec![1]))],
    )
    .unwrap();
    let err = flightshuffle::block::cast_to(narrow, &schema())
        .err()
        .unwrap();
    assert!(err.to_string().contains("columns"), "{err}");
}

/// A health call with the cluster token through `endpoint` (TLS as configured on it).
async fn health_through(endpoint: tonic::transport::Endpoint, token: &str) -> Result<(), String> {
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    let mut req = tonic::Request::new(Action {
        r#type: "health".into(),
        body: Default::default(),
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    FlightServiceClient::new(channel)
        .do_action(req)
        .await
        .map(|_| ())
        .map_err(|s| format!("{s}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_on_by_default_and_refuses_plaintext_and_other_cas() {
    use flightshuffle::cluster::TlsSetting;
    use flightshuffle::transport::tls::{ClientTls, LocalTls};
    use tonic::transport::Endpoint;
    let cluster = LocalCluster::start(config(1, 1 << 20)).await.unwrap();
    let tls = cluster
        .driver
        .credentials()
        .tls
        .clone()
        .expect("TLS by default");
    let token = cluster.driver.token().to_string();
    let addr = cluster.driver.worker(0).unwrap().addr.clone();
    let https = || Endpoint::from_shared(format!("https://{addr}")).unwrap();
    // The cluster's CA and token: served.
    health_through(https().tls_config(tls.config()).unwrap(), &token)
        .await
        .unwrap();
    // Plaintext, even with the token: refused.
    let plain = Endpoint::from_shared(format!("http://{addr}")).unwrap();
    assert!(
        health_through(plain, &token).await.is_err(),
        "plaintext served"
    );
    // A client trusting another CA: the worker's certificate fails verification.
    let dir = tempfile::tempdir().unwrap();
    let other = LocalTls::generate(dir.path())
        .unwrap()
        .client(false)
        .unwrap();
    let err = health_through(https().tls_config(other.config()).unwrap(), &token)
        .await
        .unwrap_err();
    assert!(err.contains("InvalidCertificate"), "{err}");

    // Mutual TLS: the driver works; a client with the CA but no certificate is refused.
    let mut cfg = config(1, 1 << 20);
    cfg.tls = TlsSetting::Local { mutual: true };
    let mutual = LocalCluster::start(cfg).await.unwrap();
    mutual.driver.check_health().await.unwrap();
    let creds = mutual.driver.credentials().tls.clone().unwrap();
    assert!(creds.identity.is_some());
    let addr = mutual.driver.worker(0).unwrap().addr.clone();
    let ca_only = ClientTls {
        ca: creds.ca.clone(),
        identity: None,
    };
    let endpoint = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(ca_only.config())
        .unwrap();
    assert!(
        health_through(endpoint, mutual.driver.token())
            .await
            .is_err(),
        "a client without a certificate was served under mutual TLS"
    );

    // A worker refuses a non-loopback address without TLS, unless told it is insecure.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flightshuffle-worker"))
        .args(["--listen", "0.0.0.0:0", "--spill-dir"])
        .arg(dir.path().join("spill"))
        .env("FLIGHTSHUFFLE_TOKEN", "t")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("without TLS"),
        "{stderr}"
    );
}
