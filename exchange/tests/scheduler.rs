//! The map runner and the pipelined scheduler with real worker processes: a worker killed
//! while a run's stages are half done is replaced, and the run goes on from where it was
//! (only the missing maps run again), without starting over; a first wave runs one map per
//! worker, and an online query's maps after its first round wait for its fold.

use arrow::array::RecordBatch;
use flightshuffle::checksum::Checksum;
use flightshuffle::cluster::LocalCluster;
use flightshuffle::driver::{Driver, MapInput, ShuffleSpec};
use flightshuffle::scheduler::{run_pipelined, StageRun};
use flightshuffle::strategy::{Strategy, StrategyOptions};
use flightshuffle::synthetic::LineitemSlice;
use futures::TryStreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

mod common;
use common::*;

const MAPS: u64 = 6;
const ROWS: u64 = 4_000;

/// A stage of `MAPS` lineitem maps of `ROWS` rows each; their first attempts wait `delay_ms`.
fn stage(first: u64, delay_ms: u64) -> (StageRun, Checksum) {
    let mut spec: ShuffleSpec = lineitem_spec(false);
    spec.partitions = 4;
    let mut want = Checksum::default();
    let inputs = (0..MAPS)
        .map(|m| {
            let from = first + m * ROWS;
            let slice = LineitemSlice {
                first_attempt_delay_ms: delay_ms,
                first: from,
                rows: ROWS,
                seed: 7,
                batch_rows: 1000,
            };
            for b in slice.batches() {
                want.add(Checksum::of_batch(&b.unwrap()).unwrap());
            }
            MapInput::Source(lineitem_slice(from, ROWS, 1000, delay_ms))
        })
        .collect();
    let run = StageRun {
        spec,
        inputs,
        strategy: Strategy::Pull,
        deferred: None,
        reads: vec![],
        refresh: None,
    };
    (run, want)
}

async fn read_all(driver: &Arc<Driver>, spec: &ShuffleSpec) -> flightshuffle::Result<Checksum> {
    let mut sum = Checksum::default();
    for p in 0..spec.partitions {
        let stream = driver.read_partition(spec.id, p, true).await?;
        let batches: Vec<RecordBatch> = stream.try_collect().await?;
        sum.add(checksum(&batches));
    }
    Ok(sum)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_lost_mid_run_reruns_only_the_missing_maps() {
    let cluster = LocalCluster::start(config(3, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    // Stage A is quick and sealed before the kill; stage B's first attempts wait 4 s, so all
    // of its maps are unfinished when the worker goes.
    let (a, want_a) = stage(0, 0);
    let (b, want_b) = stage(MAPS * ROWS, 4_000);
    let (spec_a, spec_b) = (a.spec.clone(), b.spec.clone());
    let victim = cluster.pids()[1];
    let calls = AtomicUsize::new(0);
    let recomputed = driver.recomputed_maps();
    let consumer = || async {
        let call = calls.fetch_add(1, Ordering::SeqCst);
        let got_a = read_all(&driver, &spec_a).await?;
        if call == 0 {
            let killed = std::process::Command::new("kill")
                .args(["-9", &victim.to_string()])
                .status()
                .map(|s| s.success());
            assert!(matches!(killed, Ok(true)), "kill -9 {victim}");
        }
        let got_b = read_all(&driver, &spec_b).await?;
        Ok((got_a, got_b))
    };
    let started = Instant::now();
    let ((got_a, got_b), reports) = run_pipelined(
        &driver,
        vec![a, b],
        &[spec_a.id, spec_b.id],
        consumer,
        started,
        StrategyOptions::named("pull").unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(got_a, want_a, "stage A exact");
    assert_eq!(got_b, want_b, "stage B exact");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the consumer ran again once"
    );
    assert_eq!(driver.generation(1), 1, "worker 1 was replaced");
    // Only A's outputs on the lost worker ran again; B's maps had not finished.
    let lost = driver.recomputed_maps() - recomputed;
    assert!(
        lost > 0 && lost < MAPS,
        "{lost} of {MAPS} lost outputs ran again"
    );
    assert!(
        reports[0]
            .strategy
            .contains(&format!("{lost} lost map outputs ran again"))
            && reports[0].strategy.contains("kept"),
        "{:?}",
        reports[0].strategy
    );
    assert!(
        reports[1].strategy.contains("0 lost map outputs"),
        "{:?}",
        reports[1].strategy
    );
    assert_eq!(driver.reruns(), 0, "nothing ran again whole");
    for s in [spec_a.id, spec_b.id] {
        driver.drop_shuffle(s).await.unwrap();
    }
}

/// `first_wave_alone`: each worker runs one map until one map per worker has committed
/// (`auto`'s first wave, which its choice waits for, then commits in the time of one map
/// alone), then `maps_per_worker` again. Map inputs here are driver streams that count when
/// they are first read and wait for a permit: with 2 workers, 2 maps start, not 4; once the
/// first 2 commit, up to 4 run; every map commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_wave_runs_one_map_per_worker() {
    use flightshuffle::strategy::pull;
    let cluster = LocalCluster::start(config(2, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let g = gated(&driver, 8).await;
    let (spec, inputs, want) = (g.spec, g.inputs, g.want);
    let (started, permits) = (g.started, g.permits);
    let opts = StrategyOptions {
        first_wave_alone: true,
        ..StrategyOptions::default()
    };
    let committed = Arc::new(AtomicUsize::new(0));
    let run = {
        let (driver, spec, committed) = (driver.clone(), spec.clone(), committed.clone());
        tokio::spawn(async move {
            pull::run_maps_observed(
                &driver,
                &spec,
                futures::stream::iter(inputs),
                0,
                opts,
                |_| {
                    committed.fetch_add(1, Ordering::SeqCst);
                },
            )
            .await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        started.load(Ordering::SeqCst),
        2,
        "one map per worker first"
    );
    permits.add_permits(2);
    until("2 maps committed", || committed.load(Ordering::SeqCst) >= 2).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        started.load(Ordering::SeqCst),
        6,
        "then maps_per_worker (2) each"
    );
    permits.add_permits(6);
    let mapped = run.await.unwrap().unwrap();
    assert_eq!(mapped.maps.len(), 8);
    assert_eq!(mapped.input, want, "every map's rows committed once");
    driver.drop_shuffle(spec.id).await.unwrap();
}

/// Online rounds by completion run a first wave of one map per worker and hold the other maps
/// until the first round is folded (its fold then reads from idle workers). Where the fold
/// fails (an unknown reducer), no map after the first wave may ever start: 2 of 8 with 2
/// workers; 3 of 4 with 3 workers, where the first round is one map (4 maps in 4 rounds) yet
/// every worker gets one. Let go once the first round had committed, 6 of 8 started
/// (checked). Where the fold works, every map runs and the final is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_maps_after_the_first_online_round_wait_for_its_fold() {
    assert_eq!(online_first_wave(2, 8, false).await, 2);
    assert_eq!(online_first_wave(3, 4, false).await, 3);
    assert_eq!(online_first_wave(2, 8, true).await, 8);
}

/// Run `maps` gated inputs (every permit given) as an online job of 4 rounds by completion on
/// `workers` workers, folding with the checksum reducer (`works`: the final must be exact) or
/// an unknown one (the first fold must fail); the maps that started.
async fn online_first_wave(workers: usize, maps: usize, works: bool) -> usize {
    use flightshuffle::strategy::streaming::{self, StreamingJob};
    let cluster = LocalCluster::start(config(workers, 1 << 30)).await.unwrap();
    let driver = cluster.driver.clone();
    let g = gated(&driver, maps).await;
    driver.drop_shuffle(g.spec.id).await.unwrap();
    g.permits.add_permits(maps);
    let reducer = match works {
        true => flightshuffle::source::CHECKSUM_REDUCER,
        false => "no-such-reducer",
    };
    let job = StreamingJob {
        spec: spec_k(3),
        weights: vec![200; maps],
        unit_sizes: Vec::new(),
        inputs: g.inputs,
        rounds: 4,
        by_completion: true,
        reducer: reducer.into(),
        payload: vec![],
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    streaming::run(&driver, job, StrategyOptions::default(), tx).await;
    let mut last = None;
    while let Some(partial) = rx.recv().await {
        match partial {
            Ok(p) => last = Some(p),
            Err(e) if !works => {
                assert!(e.to_string().contains("unknown reducer"), "{e}");
                return g.started.load(Ordering::SeqCst);
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(works, "the first fold must fail");
    let last = last.expect("a final partial");
    let mut total = Checksum::default();
    for part in &last.partitions {
        total.add(checksum_rows(part));
    }
    assert!(last.is_final);
    assert_eq!(total, g.want, "every map folded once");
    g.started.load(Ordering::SeqCst)
}
