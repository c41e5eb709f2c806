//! `auto`: the strategy of each exchange chosen late by a cost model over this machine's
//! calibration (Seer's idea; Daft's `auto` is the floor to beat). The maps start as in
//! [`super::pull`], in place. Once the first wave has committed (one map per worker, or all
//! of them if fewer), the sizes are known: bytes and blocks per map, spill so far, M so far,
//! R and N. The model predicts each strategy's time for the exchange from the calibration
//! ([`crate::driver::Driver::calibration`]) and the cheapest wins: `pull` lets the rest run as
//! they are; `merged` merges on each worker, the first wave included; `push` and `two-level`
//! send the blocks of the maps still to run to their holders and merge there, and forward the
//! first wave's blocks, unchanged, to the same holders ([`crate::forward`]), where they are
//! merged with the rest, so readers read the holders only, as under push or two-level run
//! fixed (if a map cannot be forwarded, it stays and readers read every worker). The first
//! wave runs one map per worker and the next maps start once the choice is made, so only the
//! first wave's maps write unpacked blocks in place. The pick, the predicted times and the
//! forwards are noted on the driver and shown by `EXPLAIN ANALYZE`.
//!
//! A durable shuffle whose readers start after the seal may also go through the store
//! ([`super::store`]): the model then has the store's calibrated rates, and a pick of `store`
//! or `store-two-level` marks the exchange read through the store while the rest of the maps
//! run, unpacked, and runs the second level (two-level) before the seal.
//!
//! The model itself is [`crate::cost`].

use super::options::{Strategy, StrategyOptions};
use super::{merged, pull, store};
use crate::cost::{ranking, Shape};
use crate::driver::Placement;
use crate::driver::{Driver, MapDone, MapInput, ShuffleSpec};
use crate::error::{Error, Result};
use futures::{Stream, StreamExt};
use std::sync::Arc;
use tokio::sync::mpsc;

/// The shape of an exchange from its first wave of committed maps.
fn shape_of(
    wave: &[MapDone],
    workers: usize,
    partitions: u32,
    maps: usize,
    in_place: usize,
    pack: bool,
) -> Shape {
    let bytes: u64 = wave
        .iter()
        .flat_map(|d| &d.blocks)
        .map(|b| b.meta.bytes)
        .sum();
    // The calibrated rates are per in-memory Arrow byte. Encoded blocks overstate it when
    // they are small (each carries its own IPC framing: the first wave's blocks at M = R =
    // 1000 came to 4.2 GB for 1.96 GB of rows), the input's in-memory size when it is a slice
    // of a larger batch (which reports the whole buffer): the smaller of the two counts.
    let input: u64 = wave.iter().map(|d| d.input_bytes).sum();
    let data = if input > 0 { input.min(bytes) } else { bytes };
    let spilled: u64 = wave.iter().map(|d| d.spilled_bytes).sum();
    let seen = wave.len().max(1);
    let maps = maps.max(seen);
    Shape {
        workers,
        maps,
        partitions,
        bytes: data as f64 * maps as f64 / seen as f64,
        spill_fraction: if bytes > 0 {
            spilled as f64 / bytes as f64
        } else {
            0.0
        },
        blocks_per_map: wave.iter().map(|d| d.blocks.len()).sum::<usize>() as f64 / seen as f64,
        maps_in_place: in_place,
        pack,
    }
}

/// Forward the first wave's maps, run in place, to the holders `placement` names, one forward
/// per map, all at once ([`Driver::forward`]), and send each forward on `to_merge` (merged
/// on the holders with the maps pushed there). A map that could not go (refused because a
/// reader started there, or any failure before its rows moved) is sent on `to_merge` itself
/// and stays where it ran; a lost worker or rows half moved fail the shuffle. Once every one
/// went, readers read the holders only. Returns what happened, for `EXPLAIN ANALYZE`.
async fn forward_wave(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    wave: Vec<MapDone>,
    placement: Placement,
    to_merge: &mpsc::UnboundedSender<MapDone>,
) -> Result<String> {
    let total = wave.len();
    let calls = wave.into_iter().enumerate().map(|(i, d)| async move {
        let group = crate::forward::FORWARD_GROUP_BASE + i as u32;
        let r = driver
            .forward(spec.id, group, d.worker, vec![d.map], placement)
            .await;
        (d, r)
    });
    let mut stayed = 0;
    for (d, r) in futures::future::join_all(calls).await {
        match r {
            Ok(forwarded) => {
                let _ = to_merge.send(forwarded);
            }
            // The maps' rows are gone with a worker, or half forwarded: the shuffle fails.
            Err(e @ (Error::PartialCommit { .. } | Error::WorkerLost { .. })) => return Err(e),
            Err(e) => {
                tracing::warn!(shuffle = %spec.id, map = d.map, error = %e, "map not forwarded");
                stayed += 1;
                let _ = to_merge.send(d);
            }
        }
    }
    if stayed == 0 {
        driver.place(spec.id, placement);
        return Ok(format!(
            "the first wave's {total} maps forwarded to their holders"
        ));
    }
    Ok(format!(
        "{stayed} of the first wave's {total} maps stayed where they ran: readers read every worker"
    ))
}

/// The map side of an `auto` exchange: the first wave as pull, then the predicted best.
pub async fn map_side(
    driver: &Arc<Driver>,
    spec: &ShuffleSpec,
    inputs: impl Stream<Item = MapInput> + Unpin,
    opts: StrategyOptions,
) -> Result<pull::Mapped> {
    let mut calibration = driver.calibration().await?;
    // A durable shuffle whose readers start after the seal may also go through the store:
    // the model then weighs it with the store's own rates.
    if opts.pack && opts.parity == 0 && driver.is_durable(spec.id) {
        if let Some(store) = driver.store_of(spec.id) {
            let [request, read, write] = crate::calibrate::store_rates(&store).await?;
            calibration.store_request_s = request;
            calibration.store_read_bytes_per_s = read;
            calibration.store_write_bytes_per_s = write;
        }
    }
    // The number of maps, where the input says it (SQL stages, benchmarks) or the caller
    // estimated it (a Python shuffle of a table); otherwise the maps submitted by the time
    // of the choice (at least the first wave).
    let expected_maps = inputs.size_hint().1.or(opts.expected_maps);
    let submitted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let exhausted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (counted, ended) = (submitted.clone(), exhausted.clone());
    // The first wave runs alone (one map per worker) and the maps after it wait for the
    // choice: they then run packed or placed as the pick wants, and the maps left in place
    // unpacked (each R blocks) are the first wave only.
    let n = driver.num_workers();
    let (decided, choice) = tokio::sync::watch::channel(false);
    let inputs = super::maps::held_after(inputs, n, choice)
        .inspect(move |_| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        })
        .chain(futures::stream::poll_fn(move |_| {
            ended.store(true, std::sync::atomic::Ordering::SeqCst);
            std::task::Poll::Ready(None)
        }));
    let (tx, mut rx) = mpsc::unbounded_channel::<MapDone>();
    let alone = StrategyOptions {
        first_wave_alone: true,
        ..opts
    };
    let maps = pull::run_maps_observed(driver, spec, Box::pin(inputs), 0, alone, move |done| {
        let _ = tx.send(done.clone());
    });
    let decide = async {
        let mut wave = Vec::new();
        while wave.len() < n {
            match rx.recv().await {
                Some(d) => wave.push(d),
                None => break,
            }
        }
        let maps_so_far = submitted.load(std::sync::atomic::Ordering::SeqCst);
        let shape = shape_of(
            &wave,
            n,
            spec.partitions,
            expected_maps.unwrap_or(0).max(maps_so_far),
            maps_so_far,
            opts.pack,
        );
        let ranked = ranking(&calibration, &shape);
        // Every map has been submitted in place already: only pull and merged are open
        // (push and two-level are still shown, marked).
        let in_place = exhausted.load(std::sync::atomic::Ordering::SeqCst);
        let open = |s: Strategy| {
            !in_place
                || matches!(
                    s,
                    Strategy::Pull | Strategy::Merged | Strategy::Store | Strategy::StoreTwoLevel
                )
        };
        let pick = ranked
            .iter()
            .find(|(s, _)| open(*s))
            .map_or(Strategy::Pull, |(s, _)| *s);
        let predicted: Vec<String> = ranked
            .iter()
            .map(|(s, t)| {
                let closed = if open(*s) { "" } else { " [maps already ran]" };
                format!("{s} {t:.3} s{closed}")
            })
            .collect();
        let m_from = match expected_maps {
            Some(_) => "",
            None => " so far, the input's size unknown",
        };
        let note = format!(
            "auto: {pick} (predicted for {:.1} MB, {} maps{m_from}, {} run before the choice: {})",
            shape.bytes / 1e6,
            shape.maps,
            shape.maps_in_place,
            predicted.join(", ")
        );
        tracing::info!(shuffle = %spec.id, %note, "strategy chosen");
        driver.note_choice(spec.id, note.clone());
        if matches!(pick, Strategy::Store | Strategy::StoreTwoLevel) {
            // Readers wait for the objects; the maps to come run unpacked, in place.
            driver.exchange_via_store(spec.id).await?;
            let _ = decided.send(true);
            while rx.recv().await.is_some() {}
            return Ok((Vec::new(), Some((pick, note))));
        }
        let placement = match pick {
            Strategy::Push => Some(Placement::Owner),
            Strategy::TwoLevel => Some(Placement::Grid),
            _ => None,
        };
        if pick != Strategy::Pull && opts.pack {
            driver.pack_maps(spec.id);
        }
        if let Some(p) = placement {
            driver.place_maps(spec.id, p);
        }
        let _ = decided.send(true);
        if pick == Strategy::Pull {
            while rx.recv().await.is_some() {}
            return Ok((Vec::new(), None));
        }
        // The first wave's maps are merged where they ran, or forwarded to the holders
        // beside the maps that follow and merged there (those that could not go stay and
        // are merged where they ran).
        let (to_merge, wave_done) = mpsc::unbounded_channel::<MapDone>();
        let forward = async move {
            match placement {
                None => wave.into_iter().for_each(|d| {
                    let _ = to_merge.send(d);
                }),
                Some(p) => {
                    let went = forward_wave(driver, spec, wave, p, &to_merge).await?;
                    driver.note_choice(spec.id, format!("{note}; {went}"));
                }
            }
            Ok(())
        };
        let rest = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
        let wave_done = tokio_stream::wrappers::UnboundedReceiverStream::new(wave_done);
        let commits = futures::stream::select(wave_done, rest);
        let ((), merges) =
            futures::future::try_join(forward, merged::merge(driver, spec, commits, opts)).await?;
        Ok((merges, None))
    };
    let (mut mapped, (merges, through)) = futures::future::try_join(maps, decide).await?;
    mapped.merges = merges;
    match through {
        Some((pick, note)) => store::finish(driver, spec, pick, &format!("{note}; "), opts).await?,
        None => pull::seal(driver, spec, opts).await?,
    }
    Ok(mapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bytes_are_the_rows_in_memory_not_their_framing_nor_a_parent_buffer() {
        use crate::block::{BlockId, BlockMeta, ShuffleId};
        use crate::driver::{BlockRef, MapDone};
        // One map of 1000 small blocks of 2 KB: 2 MB encoded, 1 MB of rows in memory.
        let done = |input_bytes: u64| MapDone {
            map: 0,
            attempt: 0,
            worker: 0,
            blocks: (0..1000)
                .map(|p| BlockRef {
                    meta: BlockMeta {
                        id: BlockId {
                            shuffle: ShuffleId(1),
                            map: 0,
                            partition: p,
                            attempt: 0,
                            seq: 0,
                        },
                        rows: 10,
                        bytes: 2000,
                        crc32c: 0,
                    },
                    worker: 0,
                })
                .collect(),
            input: Default::default(),
            input_bytes,
            spilled_bytes: 0,
            admission_wait_seconds: 0.0,
            committed_at: std::time::Instant::now(),
        };
        let bytes = |d: MapDone| shape_of(&[d], 4, 1000, 10, 1, false).bytes;
        assert_eq!(bytes(done(1_000_000)), 10e6, "framing is not data");
        // A slice of a larger batch reports the whole buffer: the blocks bound it.
        assert_eq!(bytes(done(500_000_000)), 20e6);
        // No input size reported: the blocks.
        assert_eq!(bytes(done(0)), 20e6);
    }
}
