//! The cost model of the `auto` strategy ([`crate::strategy::auto`]): predicted seconds of each
//! strategy for an exchange, from this machine's calibration ([`crate::calibrate`]).
//!
//! The model (seconds, P = parallel cores): every strategy pays partitioning and encoding on
//! the map side and decoding on the reduce side per byte, a per-block cost for every block a
//! reducer reads, a request latency per reducer request, the transport for the bytes that
//! cross workers, and disk for the bytes that spill. Merging strategies add a merge of every
//! byte at the calibrated merge rate (and, when spilling, write the merged bytes again) but
//! read ~N blocks per partition instead of M; push hides a quarter of its transfer behind the
//! map side; two-level moves a byte up to twice (within its row as a push, a quarter of it
//! hidden behind the map side, then within its column: 1 - 1/√N of the bytes each time) but
//! makes ~√N requests per map and per reducer. Under `auto` the maps run before the choice are merged
//! where they ran (merged) or forwarded to the holders and merged there (push, two-level):
//! their blocks are read back once more.
//!
//! Through the store (Seer §4, with this store's calibrated request time and byte rates, taken
//! as the cluster's, not divided by the cores): `store` makes one ranged GET per map object
//! per reducer and reads every byte once; `store-two-level` reads every byte twice and writes
//! it once more, in M·√R + √M·√R + R·√M requests. The map objects themselves are written under
//! every strategy of a durable shuffle, so they are not counted. A calibration without the
//! store's figures ranks neither.

use crate::proto::Calibration;
use crate::strategy::options::Strategy;

/// The share of a push's transfer that counts: the rest hides behind the map side. Fitted on
/// a 2-core host, where every stage is CPU-bound and little hides: with 0.5 `auto` picked
/// push at M = R = 100 where pull was 18% faster, with 1 merged at 118 MiB / M = R = 1000
/// where it was 7% slower than push (`docs/bench/strategies.md`, 2026-11-25).
const OVERLAP: f64 = 0.75;

/// What the model knows of an exchange when it decides.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub workers: usize,
    /// Map tasks (at least those seen so far).
    pub maps: usize,
    pub partitions: u32,
    /// Bytes the exchange moves (extrapolated from the maps seen).
    pub bytes: f64,
    /// Fraction of the bytes that spill.
    pub spill_fraction: f64,
    /// Blocks one map writes (at most R; 0: assume R).
    pub blocks_per_map: f64,
    /// Maps already run in place when the choice is made: under `auto` push and two-level
    /// forward their blocks to the holders ([`crate::forward`]), which merge them.
    pub maps_in_place: usize,
    /// Maps of merging strategies write packed blocks ([`crate::packed`]): one per holder
    /// instead of one per partition (the maps run in place before the choice excepted).
    pub pack: bool,
}

/// Predicted seconds of `strategy` for `shape` on the machine `c` describes.
pub fn predict(c: &Calibration, shape: &Shape, strategy: Strategy) -> f64 {
    let rate = |r: f64| if r > 0.0 { r } else { 1e9 };
    let n = shape.workers.max(1) as f64;
    let p = (c.parallelism.max(1) as f64).min(n);
    let m = shape.maps.max(1) as f64;
    let r = shape.partitions.max(1) as f64;
    let per_map = if shape.blocks_per_map > 0.0 {
        shape.blocks_per_map.min(r)
    } else {
        r
    };
    // Map blocks: at most R per map; a merging strategy's packed maps write one per holder.
    let map_blocks = m * per_map;
    let in_place = (shape.maps_in_place as f64).min(m);
    let blocks_to = |holders: f64| {
        if shape.pack {
            in_place * per_map + (m - in_place) * holders.min(per_map)
        } else {
            map_blocks
        }
    };
    // Blocks of the maps run in place before the choice: under push and two-level `auto`
    // forwards them, unchanged, to the holders, which merge them with the pushed ones.
    let forwarded = in_place * per_map;
    let b = shape.bytes.max(0.0);
    let spilled = b * shape.spill_fraction.clamp(0.0, 1.0);
    let remote = (n - 1.0) / n;
    let cols = n.sqrt().ceil();
    let (local_block, remote_block) =
        (c.block_overhead_s, c.remote_block_s.max(c.block_overhead_s));
    // Every strategy: partition and encode on the map side, decode on the reduce side, spill
    // what does not fit (and write its map blocks, counted below).
    let common = b / rate(c.partition_bytes_per_s)
        + b / rate(c.encode_bytes_per_s)
        + b / rate(c.decode_bytes_per_s)
        + spilled / rate(c.disk_write_bytes_per_s)
        + spilled / rate(c.disk_read_bytes_per_s);
    let transfer = b * remote / rate(c.network_bytes_per_s);
    // A merge reads, decodes, gathers and re-encodes every byte (the calibrated merge rate;
    // a calibration without one: a decode and an encode), reads its map blocks locally and
    // writes the merged bytes to disk again when spilling; the map blocks were written first.
    let merge_per_byte = if c.merge_bytes_per_s > 0.0 {
        1.0 / c.merge_bytes_per_s
    } else {
        1.0 / rate(c.decode_bytes_per_s) + 1.0 / rate(c.encode_bytes_per_s)
    };
    let merge = |blocks: f64| {
        b * merge_per_byte + 2.0 * blocks * local_block + spilled / rate(c.disk_write_bytes_per_s)
    };
    // Reducers read R partitions, each as one block per worker holding some (after a merge).
    let reads = |holders: f64| r * holders.min(m);
    // Reading `blocks` blocks over `sources` workers per partition, mostly from other workers.
    let read = |blocks: f64, sources: f64| {
        blocks * (remote * remote_block + local_block / n) + r * sources * c.request_s
    };
    let merged_reads = read(reads(n), n) + transfer;
    let specific = match strategy {
        // Every reducer streams its blocks from N workers.
        Strategy::Pull | Strategy::Auto => {
            map_blocks * local_block + read(map_blocks, n) + transfer
        }
        // Readers decode every block; the store's part is added apart, below (the second
        // level of two-level copies blocks as bytes: a CRC and a copy, not a decode).
        Strategy::Store | Strategy::StoreTwoLevel => map_blocks * local_block,
        Strategy::Merged => merge(blocks_to(1.0)) + merged_reads,
        // Blocks cross once, as pushes (a quarter of the transfer hides behind the map side);
        // a reducer reads its own store. The maps run in place before the choice are
        // forwarded to the same holders as they would have pushed to: their blocks are read
        // back, cross as pushed ones do and are merged there with them.
        Strategy::Push => {
            let blocks = blocks_to(n);
            let pushes = (blocks - forwarded) * remote * remote_block
                + (m - in_place) * (n - 1.0) * c.request_s;
            let forwards = forwarded * (remote * remote_block + local_block)
                + in_place * (n - 1.0) * c.request_s;
            let reduce = reads(1.0) * local_block + r * c.request_s + OVERLAP * transfer;
            merge(blocks) + pushes + forwards + reduce
        }
        // Pushes within a row, reads within a column: a byte crosses to another worker of
        // its row with probability 1 - 1/cols (a push, overlapping the map side as push's
        // do), then to its reducer with 1 - 1/rows (its column's other workers). The maps run
        // in place are forwarded within their row as their pushes would have gone.
        Strategy::TwoLevel => {
            let rows = (n / cols).ceil();
            let blocks = blocks_to(cols);
            let pushes = (blocks - forwarded) * (1.0 - 1.0 / cols) * remote_block
                + (m - in_place) * cols * c.request_s;
            let forwards = forwarded * ((1.0 - 1.0 / cols) * remote_block + local_block)
                + in_place * cols * c.request_s;
            let hops = OVERLAP * (1.0 - 1.0 / cols) + (1.0 - 1.0 / rows);
            let grid = b * hops / rate(c.network_bytes_per_s);
            let reduce = reads(rows) * remote_block + r * rows * c.request_s + grid;
            merge(blocks) + pushes + forwards + reduce
        }
    };
    (common + specific) / p + store_part(c, shape, strategy, map_blocks)
}

/// Seconds of the requests and bytes an exchange through the store makes of it (0 for the
/// others): see the module doc.
fn store_part(c: &Calibration, shape: &Shape, strategy: Strategy, map_blocks: f64) -> f64 {
    let rate = |r: f64| if r > 0.0 { r } else { 1e9 };
    let m = shape.maps.max(1) as f64;
    let r = shape.partitions.max(1) as f64;
    let b = shape.bytes.max(0.0);
    let (read, write) = (
        b / rate(c.store_read_bytes_per_s),
        b / rate(c.store_write_bytes_per_s),
    );
    match strategy {
        Strategy::Store => map_blocks * c.store_request_s + read,
        Strategy::StoreTwoLevel => {
            let (groups, columns) = (m.sqrt().ceil(), r.sqrt().ceil());
            let requests = (m * columns).min(map_blocks) + groups * columns + r * groups;
            requests * c.store_request_s + 2.0 * read + write
        }
        _ => 0.0,
    }
}

/// Every strategy with its predicted seconds, cheapest first; the two through the store only
/// when `c` has the store's figures.
pub fn ranking(c: &Calibration, shape: &Shape) -> Vec<(Strategy, f64)> {
    let store: &[Strategy] = match c.store_request_s > 0.0 {
        true => &[Strategy::Store, Strategy::StoreTwoLevel],
        false => &[],
    };
    let mut all: Vec<(Strategy, f64)> = [
        Strategy::Pull,
        Strategy::Merged,
        Strategy::Push,
        Strategy::TwoLevel,
    ]
    .iter()
    .chain(store)
    .map(|&s| (s, predict(c, shape, s)))
    .collect();
    all.sort_by(|a, b| a.1.total_cmp(&b.1));
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Calibration {
        Calibration {
            partition_bytes_per_s: 1.5e9,
            encode_bytes_per_s: 3e9,
            decode_bytes_per_s: 3e9,
            block_overhead_s: 60e-6,
            disk_write_bytes_per_s: 1e9,
            disk_read_bytes_per_s: 3e9,
            request_s: 200e-6,
            network_bytes_per_s: 2e9,
            parallelism: 2,
            remote_block_s: 150e-6,
            merge_bytes_per_s: 1e9,
            ..Default::default()
        }
    }

    /// Seer's trade-off with a store like S3 seen from many clients (20 ms a request, 1000
    /// in flight: 20 µs each; 1 GB/s each way), and Flight made slow (a shared 50 MB/s link):
    /// direct wins with few large objects, two-level with p² tiny ranges; no store figures,
    /// neither is ranked.
    #[test]
    fn the_store_two_level_pays_twice_the_bytes_for_fewer_requests() {
        let c = Calibration {
            store_request_s: 20e-6,
            store_read_bytes_per_s: 1e9,
            store_write_bytes_per_s: 1e9,
            network_bytes_per_s: 50e6,
            remote_block_s: 5e-3,
            ..machine()
        };
        let order = |s: &Shape| {
            ranking(&c, s)
                .iter()
                .map(|(s, _)| *s)
                .filter(|s| matches!(s, Strategy::Store | Strategy::StoreTwoLevel))
                .collect::<Vec<_>>()
        };
        assert_eq!(order(&shape(50, 50))[0], Strategy::Store);
        let big = Shape {
            bytes: 2e9,
            ..shape(10_000, 10_000)
        };
        assert_eq!(order(&big)[0], Strategy::StoreTwoLevel);
        assert!(ranking(&machine(), &big)
            .iter()
            .all(|(s, _)| !matches!(s, Strategy::Store | Strategy::StoreTwoLevel)));
        // Predictions of the store's two-level count its requests: 10 000 × 100 + 100 × 100
        // + 10 000 × 100, against direct's 10⁸ (both decode the same blocks).
        let direct = predict(&c, &big, Strategy::Store);
        let two = predict(&c, &big, Strategy::StoreTwoLevel);
        assert!(direct - two > 0.95 * 1e8 * 20e-6, "{direct} {two}");
    }

    fn shape(partitions: u32, maps: usize) -> Shape {
        Shape {
            workers: 4,
            maps,
            partitions,
            bytes: 600e6,
            spill_fraction: 0.0,
            blocks_per_map: 0.0,
            maps_in_place: 0,
            pack: false,
        }
    }

    #[test]
    fn few_large_blocks_pull_many_small_blocks_merge() {
        let c = machine();
        // 64 maps x 16 partitions: 600 KB blocks, merging only adds work.
        assert_eq!(ranking(&c, &shape(16, 64))[0].0, Strategy::Pull);
        // 1000 maps x 1000 partitions: 600-byte blocks, a million of them.
        assert_ne!(ranking(&c, &shape(1000, 1000))[0].0, Strategy::Pull);
        // Predictions grow with bytes.
        let big = Shape {
            bytes: 6e9,
            ..shape(16, 64)
        };
        assert!(predict(&c, &big, Strategy::Pull) > predict(&c, &shape(16, 64), Strategy::Pull));
        // Packed maps write far fewer blocks: merging gets cheaper, pull does not change.
        let packed = Shape {
            pack: true,
            ..shape(1000, 1000)
        };
        let s = shape(1000, 1000);
        assert!(predict(&c, &packed, Strategy::Merged) < predict(&c, &s, Strategy::Merged));
        assert!(predict(&c, &packed, Strategy::Push) < predict(&c, &s, Strategy::Push));
        assert_eq!(
            predict(&c, &packed, Strategy::Pull),
            predict(&c, &s, Strategy::Pull)
        );
    }

    /// The transport's share of `strategy`'s prediction for `s`, in seconds of one crossing
    /// of every byte: only the transport differs between the two calibrations.
    fn crossings(s: &Shape, strategy: Strategy) -> f64 {
        let fast = Calibration {
            network_bytes_per_s: 1e12,
            ..machine()
        };
        let slow = Calibration {
            network_bytes_per_s: 1e8,
            ..machine()
        };
        let byte = s.bytes / 1e8 / 2.0; // one crossing of every byte, on 2 cores
        (predict(&slow, s, strategy) - predict(&fast, s, strategy)) / byte
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 0.01
    }

    #[test]
    fn two_level_bytes_cross_once_per_hop_of_the_grid() {
        // 4 workers on a 2 x 2 grid: half the bytes leave their mapper within its row (a
        // push: a quarter of it hides behind the map side), half of them again within the
        // reducer's column: one crossing per byte in all, 0.875 of it charged; pull crosses
        // 3/4, push 3/4 with a quarter hidden.
        let s = shape(16, 64);
        let two_level = crossings(&s, Strategy::TwoLevel);
        assert!(close(two_level, OVERLAP * 0.5 + 0.5), "{two_level}");
        assert!(close(two_level, 0.875), "{two_level}");
        assert!(close(crossings(&s, Strategy::Pull), 0.75));
        assert!(close(crossings(&s, Strategy::Push), 0.75 * 0.75));
    }

    #[test]
    fn maps_run_in_place_are_forwarded_at_the_cost_of_reading_their_blocks_back() {
        // Under auto, 4 of 64 maps ran in place: push and two-level forward them to the
        // holders, so every byte crosses as under the strategy run fixed (the bytes of the
        // forwards as pushes') and readers read the holders only.
        let fixed = shape(16, 64);
        let late = Shape {
            maps_in_place: 4,
            ..fixed
        };
        for strategy in [Strategy::Push, Strategy::TwoLevel] {
            let (a, b) = (crossings(&late, strategy), crossings(&fixed, strategy));
            assert!(close(a, b), "{strategy}: {a} against {b}");
        }
        // The forwards cross and are merged as pushed blocks would be, and are read back
        // first: 64 blocks once more (60 us each, on 2 cores).
        let c = machine();
        let expected = 64.0 * 60e-6 / 2.0;
        for strategy in [Strategy::Push, Strategy::TwoLevel] {
            let extra = predict(&c, &late, strategy) - predict(&c, &fixed, strategy);
            assert!((extra - expected).abs() < 1e-9, "{strategy}: {extra}");
        }
    }
}
