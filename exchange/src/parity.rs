//! Erasure-coded parity of map outputs (EC-Shuffle's forward coding, Reed-Solomon through the
//! `reed-solomon-simd` crate), so a block lost with its worker is rebuilt from the survivors
//! and the parity instead of running its map again.
//!
//! A parity shuffle places every block on its partition's owner ([`Placement::Owner`]), so a
//! map's output is already spread over the workers: its **shard** for worker `w` is the
//! concatenation of its blocks held by `w`, in (partition, seq) order. A stripe protects up
//! to `r` lost pieces, so its pieces and its `r` parity pieces must sit on distinct workers:
//! with N workers a stripe has at most `k = N - r` data pieces. Each shard is cut into `k`
//! pieces and the map's output forms N stripes, stripe `s` made of piece `j` of worker
//! `s + j` (mod N) for j < k, with parity on the `r` workers after them ([`stripes`]). So
//! every worker holds `r` parity pieces per map and the parity is `r / (N - r)` of the data
//! (EC-Shuffle's forward coding assumes parity nodes beyond the N receivers; here they are
//! the receivers). The map encodes each stripe's parity once its blocks are written and
//! sends the parity pieces as blocks of the reserved partition [`PARITY`] (never read as
//! rows) with the attempt's other blocks, so they commit and abort with it. The driver
//! rebuilds a lost worker's pieces by fetching `k` of each stripe's surviving pieces raw and
//! decoding, joins them into the shard, cuts it back into its blocks and checks each against
//! the CRC32C its map reported ([`crate::driver::parity`]).
//!
//! EC-Shuffle's backward coding (each receiver encodes the M chunks it collected) is not
//! built: there the senders keep their outputs (Spark's shuffle files), so the receiver's
//! chunks exist twice and parity only has to cover a re-fetch. Here a block lives once; a
//! receiver's chunks all sit on the receiver, and parity of shards that share a worker
//! cannot survive that worker.
//!
//! [`Placement::Owner`]: crate::strategy::Placement::Owner

use crate::error::{Error, Result};

pub use crate::ids::PARITY;

/// The highest parity a shuffle may ask for.
pub const MAX_PARITY: u32 = 2;

/// One stripe of a map's output: its data pieces as (worker, piece of that worker's shard)
/// and the workers holding its parity pieces (all workers distinct).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stripe {
    pub members: Vec<(usize, usize)>,
    pub parity: Vec<usize>,
}

/// Check that `r` parity shards fit a cluster of `workers`.
pub fn check(workers: usize, r: u32) -> Result<()> {
    if r > MAX_PARITY {
        return Err(Error::invalid(format!(
            "parity={r}: at most {MAX_PARITY} parity shards per stripe are supported"
        )));
    }
    if r > 0 && workers < r as usize + 1 {
        return Err(Error::invalid(format!(
            "parity={r} needs at least {} workers (a stripe's shards and its parity must sit \
             on distinct workers); this cluster has {workers}",
            r + 1
        )));
    }
    Ok(())
}

/// The stripes of a map's output over `workers` workers with `r` parity pieces each (none
/// for r = 0): stripe `s` holds piece `j` of worker `(s + j) mod N` for `j < N - r`, its
/// parity on the next `r` workers.
pub fn stripes(workers: usize, r: u32) -> Result<Vec<Stripe>> {
    check(workers, r)?;
    let r = r as usize;
    if r == 0 {
        return Ok(Vec::new());
    }
    let n = workers;
    let k = n - r;
    Ok((0..n)
        .map(|s| Stripe {
            members: (0..k).map(|j| ((s + j) % n, j)).collect(),
            parity: (0..r).map(|i| (s + k + i) % n).collect(),
        })
        .collect())
}

/// The pieces each worker's shard is cut into.
pub fn pieces(workers: usize, r: u32) -> usize {
    workers.saturating_sub(r as usize).max(1)
}

/// The byte range of piece `j` of a shard of `len` bytes cut into `k` pieces.
pub fn piece(len: usize, k: usize, j: usize) -> std::ops::Range<usize> {
    let c = len.div_ceil(k.max(1));
    (j * c).min(len)..((j + 1) * c).min(len)
}

/// The `seq` of parity piece `j` of stripe `s` (its block key's sequence number).
pub fn parity_seq(stripe: usize, r: u32, j: usize) -> u32 {
    (stripe * r as usize + j) as u32
}

/// The shard length a stripe is coded at: its longest shard, rounded up to an even 64 bytes
/// (0: every shard is empty and the stripe needs no parity).
pub fn shard_len(lens: &[usize]) -> usize {
    lens.iter().copied().max().unwrap_or(0).div_ceil(64) * 64
}

fn padded(shard: &[u8], len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(shard);
    v.resize(len, 0);
    v
}

fn coding(e: reed_solomon_simd::Error) -> Error {
    Error::Cluster(format!("erasure coding failed: {e}"))
}

/// The `r` parity shards of one stripe's data shards (empty if every shard is empty).
pub fn encode(shards: &[Vec<u8>], r: u32) -> Result<Vec<Vec<u8>>> {
    let len = shard_len(&shards.iter().map(Vec::len).collect::<Vec<_>>());
    if len == 0 || r == 0 || shards.is_empty() {
        return Ok(Vec::new());
    }
    let originals: Vec<Vec<u8>> = shards.iter().map(|s| padded(s, len)).collect();
    reed_solomon_simd::encode(shards.len(), r as usize, &originals).map_err(coding)
}

/// Rebuild the missing data shards of a stripe of `lens.len()` shards coded with `r` parity
/// shards: `present` holds the surviving data shards by index, `parity` the surviving parity
/// shards by index. Returns the missing shards cut to their lengths in `lens`.
pub fn decode(
    lens: &[usize],
    r: u32,
    present: &[(usize, Vec<u8>)],
    parity: &[(usize, Vec<u8>)],
) -> Result<Vec<(usize, Vec<u8>)>> {
    let k = lens.len();
    let len = shard_len(lens);
    let missing: Vec<usize> = (0..k)
        .filter(|i| !present.iter().any(|(j, _)| j == i))
        .collect();
    if missing.is_empty() {
        return Ok(Vec::new());
    }
    if len == 0 {
        return Ok(missing.into_iter().map(|i| (i, Vec::new())).collect());
    }
    if present.len() + parity.len() < k {
        return Err(Error::Cluster(format!(
            "a stripe of {k} shards lost {} of them and only {} of its {r} parity shards \
             survive: it cannot be rebuilt",
            missing.len(),
            parity.len()
        )));
    }
    for (i, s) in present {
        if s.len() != lens.get(*i).copied().unwrap_or(usize::MAX) {
            return Err(Error::Cluster(format!(
                "shard {i} of a stripe is {} bytes, its map reported {:?}",
                s.len(),
                lens.get(*i)
            )));
        }
    }
    if let Some((j, p)) = parity.iter().find(|(_, p)| p.len() != len) {
        return Err(Error::Cluster(format!(
            "parity shard {j} is {} bytes, the stripe is coded at {len}",
            p.len()
        )));
    }
    let originals: Vec<(usize, Vec<u8>)> =
        present.iter().map(|(i, s)| (*i, padded(s, len))).collect();
    let mut restored = reed_solomon_simd::decode(
        k,
        r as usize,
        originals,
        parity.iter().map(|(j, p)| (*j, p)),
    )
    .map_err(coding)?;
    missing
        .into_iter()
        .map(|i| {
            let mut shard = restored
                .remove(&i)
                .ok_or_else(|| Error::Cluster(format!("decoding did not restore shard {i}")))?;
            shard.truncate(lens[i]);
            Ok((i, shard))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stripes_put_each_piece_once_and_parity_on_other_workers() {
        for n in 1..=9 {
            for r in 0..=MAX_PARITY {
                let Ok(stripes) = stripes(n, r) else {
                    assert!(r > 0 && n < r as usize + 1, "n={n} r={r}");
                    continue;
                };
                if r == 0 {
                    assert!(stripes.is_empty());
                    continue;
                }
                let k = pieces(n, r);
                // Every piece of every worker's shard in exactly one stripe.
                let mut seen: Vec<(usize, usize)> =
                    stripes.iter().flat_map(|s| s.members.clone()).collect();
                seen.sort();
                let all: Vec<(usize, usize)> =
                    (0..n).flat_map(|w| (0..k).map(move |j| (w, j))).collect();
                assert_eq!(seen, all, "n={n} r={r}");
                for s in &stripes {
                    let mut ws: Vec<usize> = s.members.iter().map(|m| m.0).collect();
                    ws.extend(&s.parity);
                    let len = ws.len();
                    ws.sort();
                    ws.dedup();
                    assert_eq!(ws.len(), len, "n={n} r={r} {s:?}");
                    assert_eq!(s.parity.len(), r as usize);
                }
                // Parity spread evenly: r pieces per worker.
                for w in 0..n {
                    let held = stripes.iter().filter(|s| s.parity.contains(&w)).count();
                    assert_eq!(held, r as usize);
                }
            }
        }
        assert!(stripes(2, 2).is_err());
        assert!(stripes(5, 3).is_err());
        // Pieces cover a shard exactly, in order.
        for len in [0usize, 1, 5, 64, 1000] {
            for k in 1..5 {
                let joined: Vec<usize> = (0..k).flat_map(|j| piece(len, k, j)).collect();
                assert_eq!(joined, (0..len).collect::<Vec<_>>());
            }
        }
    }

    proptest! {
        #[test]
        fn any_r_lost_shards_are_rebuilt(
            shards in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 1..6),
            r in 1u32..=2,
            lose in prop::collection::vec(any::<prop::sample::Index>(), 1..3),
        ) {
            let parity = encode(&shards, r).unwrap();
            let lens: Vec<usize> = shards.iter().map(Vec::len).collect();
            let mut lost: Vec<usize> = lose.iter().map(|i| i.index(shards.len())).collect();
            lost.sort();
            lost.dedup();
            lost.truncate(r as usize);
            let present: Vec<(usize, Vec<u8>)> = (0..shards.len())
                .filter(|i| !lost.contains(i))
                .map(|i| (i, shards[i].clone()))
                .collect();
            // Lose as many parity shards as the stripe can spare: keep exactly as many as
            // data shards were lost.
            let kept: Vec<(usize, Vec<u8>)> =
                parity.iter().cloned().enumerate().skip(r as usize - lost.len()).collect();
            let rebuilt = decode(&lens, r, &present, &kept).unwrap();
            prop_assert_eq!(rebuilt.len(), lost.len());
            for (i, s) in rebuilt {
                prop_assert_eq!(&s, &shards[i]);
            }
        }
    }

    #[test]
    fn too_many_losses_is_an_error_not_a_wrong_answer() {
        let shards = vec![vec![1u8; 100], vec![2u8; 50], vec![3u8; 70]];
        let parity = encode(&shards, 1).unwrap();
        let lens = [100, 50, 70];
        // Two shards lost, one parity shard: cannot be rebuilt.
        let present = vec![(0, shards[0].clone())];
        assert!(decode(&lens, 1, &present, &[(0, parity[0].clone())]).is_err());
        // A shard of the wrong length is refused.
        let present = vec![(0, vec![1u8; 99]), (1, shards[1].clone())];
        assert!(decode(&lens, 1, &present, &[(0, parity[0].clone())]).is_err());
    }
}
