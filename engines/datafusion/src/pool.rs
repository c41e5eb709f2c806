//! `WorkerPool`: the DataFusion memory pool of a worker, shared by every stage it runs, so
//! DataFusion's operators come out of the worker's one budget.
//!
//! Operators that can spill (sorts, aggregations, the sort-merge join's buffers) get a fair
//! share of the budget left after the ones that cannot (at least [`MIN_SHARE`] each), and
//! spill when they reach it.
//! Operators that cannot spill (a hash join's build side) are always granted what they ask
//! for and counted: DataFusion would fail the query instead ("Resources exhausted"), and a
//! query that fits in the machine but not the budget should run. What they took is the
//! pool's `peak_unspillable`, which the worker reports.

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::{
    MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};
use std::sync::Mutex;

/// What every spilling operator may hold however many share the pool, and however small the
/// budget: an external sort needs room for a batch and its merge reservation
/// (`sort_spill_reservation_bytes`, 10 MiB by default) or it fails instead of spilling.
pub const MIN_SHARE: usize = 16 << 20;

/// See the module doc.
#[derive(Debug)]
pub struct WorkerPool {
    limit: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    spillers: usize,
    spillable: usize,
    unspillable: usize,
    peak: usize,
    peak_unspillable: usize,
}

impl WorkerPool {
    /// A pool of `limit` bytes for spillable operators (less what unspillable ones hold, but
    /// never under a quarter of it).
    pub fn new(limit: usize) -> Self {
        WorkerPool {
            limit: limit.max(1),
            state: Mutex::new(State::default()),
        }
    }

    /// The most bytes reserved at once, and the most by operators that cannot spill.
    pub fn peaks(&self) -> (usize, usize) {
        let s = self.lock();
        (s.peak, s.peak_unspillable)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    fn add(&mut self, can_spill: bool, bytes: usize) {
        if can_spill {
            self.spillable += bytes;
        } else {
            self.unspillable += bytes;
            self.peak_unspillable = self.peak_unspillable.max(self.unspillable);
        }
        self.peak = self.peak.max(self.spillable + self.unspillable);
    }
}

impl std::fmt::Display for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkerPool(limit {} bytes)", self.limit)
    }
}

impl MemoryPool for WorkerPool {
    fn name(&self) -> &str {
        "flightshuffle-worker"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        if consumer.can_spill() {
            self.lock().spillers += 1;
        }
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        if consumer.can_spill() {
            let mut s = self.lock();
            s.spillers = s.spillers.saturating_sub(1);
        }
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.lock()
            .add(reservation.consumer().can_spill(), additional);
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        let mut s = self.lock();
        if reservation.consumer().can_spill() {
            s.spillable = s.spillable.saturating_sub(shrink);
        } else {
            s.unspillable = s.unspillable.saturating_sub(shrink);
        }
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        let mut s = self.lock();
        let can_spill = reservation.consumer().can_spill();
        if can_spill {
            let room = self.limit.saturating_sub(s.unspillable).max(self.limit / 4);
            let share = (room / s.spillers.max(1)).max(MIN_SHARE);
            if reservation.size() + additional > share {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "{} may hold {share} bytes of this worker's memory budget and has {}; \
                     it asked for {additional} more",
                    reservation.consumer().name(),
                    reservation.size()
                )));
            }
        }
        s.add(can_spill, additional);
        Ok(())
    }

    fn reserved(&self) -> usize {
        let s = self.lock();
        s.spillable + s.unspillable
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn spillers_share_what_unspillable_operators_leave_and_those_always_fit() {
        const M: usize = 1 << 20;
        let pool: Arc<dyn MemoryPool> = Arc::new(WorkerPool::new(256 * M));
        let join = MemoryConsumer::new("join").register(&pool);
        let a = MemoryConsumer::new("sort a")
            .with_can_spill(true)
            .register(&pool);
        let b = MemoryConsumer::new("sort b")
            .with_can_spill(true)
            .register(&pool);
        // Over the limit, but a build side cannot spill: granted and counted.
        join.try_grow(300 * M).unwrap();
        // Nothing is left, but spillers keep a quarter of the limit: 32 MiB each.
        a.try_grow(32 * M).unwrap();
        let err = a.try_grow(1).unwrap_err().to_string();
        assert!(err.contains(&format!("may hold {} bytes", 32 * M)), "{err}");
        join.free();
        // Now 256 MiB shared by two.
        a.try_grow(96 * M).unwrap();
        assert!(a.try_grow(1).is_err());
        b.try_grow(128 * M).unwrap();
        drop(b);
        a.try_grow(128 * M).unwrap(); // alone now: the whole limit
        let p = pool.downcast_ref::<WorkerPool>().unwrap();
        assert_eq!(p.peaks(), (332 * M, 300 * M));
        assert_eq!(pool.reserved(), 256 * M);
    }

    #[test]
    fn many_spillers_each_keep_the_minimum_share() {
        let pool: Arc<dyn MemoryPool> = Arc::new(WorkerPool::new(32 << 20));
        let sorts: Vec<_> = (0..50)
            .map(|i| {
                MemoryConsumer::new(format!("sort {i}"))
                    .with_can_spill(true)
                    .register(&pool)
            })
            .collect();
        // 32 MiB / 50 would be 671 KB, under what a sort needs to spill at all.
        sorts[0].try_grow(MIN_SHARE).unwrap();
        assert!(sorts[0].try_grow(1).is_err());
        // A budget far under it (tests that make the store spill use 256 KiB) still leaves
        // each spiller the minimum: a query must not fail where it ran before.
        let tiny: Arc<dyn MemoryPool> = Arc::new(WorkerPool::new(128 << 10));
        let sort = MemoryConsumer::new("sort")
            .with_can_spill(true)
            .register(&tiny);
        sort.try_grow(MIN_SHARE).unwrap();
        assert!(sort.try_grow(1).is_err());
    }
}
