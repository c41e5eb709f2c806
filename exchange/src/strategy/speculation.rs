//! Speculative execution of map tasks (as Spark's `spark.speculation`, MapReduce's backup
//! tasks): once half of a stage's maps are done, a map still running after `k` times the median
//! duration of the finished ones (and at least [`MIN_RUNTIME`]) gets a second attempt on
//! another worker. The first attempt to finish commits; the driver refuses the other's commit
//! and aborts it, so its blocks never become visible (the commit protocol makes this safe).
//! Only maps whose input a worker can re-read (a task source) are copied; batches pushed from
//! the driver are consumed once.

use crate::proto;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A map must have run at least this long to be copied (short stages are left alone).
pub const MIN_RUNTIME: Duration = Duration::from_secs(1);

/// What the speculator knows of one running map.
struct Running {
    source: Option<proto::TaskSource>,
    worker: usize,
    started: Instant,
    copied: bool,
}

/// Tracks a stage's maps and picks the stragglers to copy.
pub struct Speculator {
    multiplier: f64,
    running: HashMap<u32, Running>,
    durations: Vec<Duration>,
    submitted: usize,
}

impl Speculator {
    /// `multiplier` is k: a map slower than k × the median is copied.
    pub fn new(multiplier: f64) -> Self {
        Speculator {
            multiplier,
            running: HashMap::new(),
            durations: Vec::new(),
            submitted: 0,
        }
    }

    /// A map's first attempt started on `worker`; `source` is its input if it can be re-run.
    pub fn started(&mut self, map: u32, worker: usize, source: Option<proto::TaskSource>) {
        self.submitted += 1;
        self.running.insert(
            map,
            Running {
                source,
                worker,
                started: Instant::now(),
                copied: false,
            },
        );
    }

    /// A map committed (by any attempt).
    pub fn finished(&mut self, map: u32) {
        if let Some(r) = self.running.remove(&map) {
            self.durations.push(r.started.elapsed());
        }
    }

    /// The maps to copy now, each with its input and the worker of its first attempt; each
    /// map is copied at most once.
    pub fn stragglers(&mut self, now: Instant) -> Vec<(u32, proto::TaskSource, usize)> {
        if self.durations.is_empty() || self.durations.len() * 2 < self.submitted {
            return Vec::new();
        }
        let mut sorted = self.durations.clone();
        sorted.sort();
        let median = sorted[sorted.len() / 2];
        let bound = median.mul_f64(self.multiplier).max(MIN_RUNTIME);
        let mut out = Vec::new();
        for (map, r) in &mut self.running {
            if r.copied || now.duration_since(r.started) < bound {
                continue;
            }
            if let Some(source) = &r.source {
                r.copied = true;
                out.push((*map, source.clone(), r.worker));
            }
        }
        out.sort_by_key(|(m, _, _)| *m);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> Option<proto::TaskSource> {
        Some(proto::TaskSource {
            kind: "k".into(),
            payload: vec![],
        })
    }

    #[test]
    fn only_slow_rerunnable_maps_are_copied_once_half_are_done() {
        let mut s = Speculator::new(2.0);
        for m in 0..4 {
            s.started(m, m as usize % 2, if m == 3 { None } else { source() });
        }
        let later = Instant::now() + Duration::from_secs(5);
        assert!(s.stragglers(later).is_empty(), "nothing finished yet");
        s.finished(0);
        assert!(s.stragglers(later).is_empty(), "fewer than half finished");
        s.finished(1);
        let copies = s.stragglers(later);
        assert_eq!(copies.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2]);
        assert_eq!(copies[0].2, 0, "the first attempt's worker");
        assert!(s.stragglers(later).is_empty(), "copied once");
        assert!(
            Speculator::new(2.0).stragglers(Instant::now()).is_empty(),
            "no maps"
        );
        let mut fresh = Speculator::new(2.0);
        fresh.started(0, 0, source());
        fresh.started(1, 0, source());
        fresh.finished(0);
        assert!(
            fresh.stragglers(Instant::now()).is_empty(),
            "under the minimum runtime"
        );
    }
}
