//! Task admission: the tasks a worker runs share its one memory budget.
//!
//! Every map, merge and stage task asks for a grant (its buffers' bytes) before it starts.
//! Grants are handed out while their sum stays within the worker's budget; a task that does
//! not fit waits, so N concurrent jobs share the budget instead of each taking its own. The
//! block store keeps what the grants hold out of its in-memory share ([`Admission::reserved`]),
//! spilling earlier instead of growing past the budget.
//!
//! Waiting must not deadlock pipelined stages: a consumer stage's task waits on its producers'
//! blocks while it holds its grant. The driver numbers shuffles in the order it creates them
//! (`CreateShuffle.order`), producers before their consumers, so a task only ever waits on
//! tasks of lower order. Grants go out lowest order first, and a task whose order is below
//! every running task's is admitted even over the budget once no grant has come back for
//! [`OVERDRAFT_AFTER`] while it waited (what a deadlock looks like): the lowest task in the
//! cluster then runs, so some task always makes progress. (Admitting it at once would let
//! every task of a job that started before the running ones go over the budget, where most
//! only need the running ones to end.)
//!
//! Within one job the driver says more: the shuffles of a query's stages are created together
//! and share a `group`. A task of such a shuffle is admitted at once while a task of a later
//! shuffle of its group runs (that task may be waiting on it), over the budget if need be but
//! then only one task of the job at a time.
//! (Without this, TPC-H at a 64 MiB budget stalled 1 s for the overdraft in about one run in
//! two: four consumer tasks held every grant, waiting on a producer task queued behind them.)

use crate::sync::lock;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How long no grant may come back, while a task below every running one waits, before that
/// task is admitted over the budget (see the module doc).
pub const OVERDRAFT_AFTER: Duration = Duration::from_secs(1);

/// False when `FLIGHTSHUFFLE_ADMISSION=off`: every task runs at once, the block store keeps
/// the whole budget and query engines get no memory pool (as before admission; for measuring
/// what it changes).
pub fn enabled() -> bool {
    std::env::var("FLIGHTSHUFFLE_ADMISSION").as_deref() != Ok("off")
}

/// A waiting or running task: (its shuffle's order, a ticket in arrival order).
type Key = (u64, u64);

/// Where a task's shuffle stands: its creation `order`, and the `group` of shuffles created
/// together for one job (0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rank {
    pub order: u64,
    pub group: u64,
}

impl From<u64> for Rank {
    fn from(order: u64) -> Self {
        Rank { order, group: 0 }
    }
}

/// The grants of one worker (see the module doc).
#[derive(Debug)]
pub struct Admission {
    capacity: u64,
    inner: Mutex<Inner>,
    changed: Notify,
    /// Notified when the last running task's grant comes back.
    idle: Notify,
}

#[derive(Debug, Default)]
struct Inner {
    /// Running tasks: their bytes, their group, and whether they went over the budget.
    running: BTreeMap<Key, (u64, u64, bool)>,
    waiting: BTreeSet<Key>,
    next_ticket: u64,
    reserved: u64,
    /// When a grant last came back.
    last_release: Option<Instant>,
    metrics: AdmissionMetrics,
}

/// Cumulative figures of one worker's admission.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionMetrics {
    /// Grants handed out.
    pub admitted: u64,
    /// Grants that had to wait for others to end first.
    pub waited: u64,
    /// Grants handed out over the budget, to the lowest-order task (see the module doc).
    pub overdrafts: u64,
    /// The most bytes granted at once.
    pub peak_reserved: u64,
    /// The most tasks running at once.
    pub peak_running: u64,
}

/// Bytes granted to one running task; returned when dropped.
#[derive(Debug)]
pub struct Grant {
    admission: Arc<Admission>,
    key: Key,
    bytes: u64,
}

impl Drop for Grant {
    fn drop(&mut self) {
        let mut inner = lock(&self.admission.inner);
        if inner.running.remove(&self.key).is_some() {
            inner.reserved -= self.bytes;
            inner.last_release = Some(Instant::now());
        }
        let idle = inner.running.is_empty();
        drop(inner);
        self.admission.changed.notify_waiters();
        if idle {
            self.admission.idle.notify_one();
        }
    }
}

/// Takes a waiting task out of the queue if its `admit` future is dropped before a grant.
struct Waiting<'a> {
    admission: &'a Admission,
    key: Key,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if lock(&self.admission.inner).waiting.remove(&self.key) {
            self.admission.changed.notify_waiters();
        }
    }
}

impl Admission {
    /// Admission within `capacity` bytes of grants.
    pub fn new(capacity: u64) -> Arc<Self> {
        Arc::new(Admission {
            capacity,
            inner: Mutex::new(Inner::default()),
            changed: Notify::new(),
            idle: Notify::new(),
        })
    }

    /// Wait for a grant of `bytes` for a task of a shuffle of `rank` (an order alone: no group).
    pub async fn admit(self: &Arc<Self>, rank: impl Into<Rank>, bytes: u64) -> Grant {
        let rank = rank.into();
        let key = {
            let mut inner = lock(&self.inner);
            let key = (rank.order, inner.next_ticket);
            inner.next_ticket += 1;
            inner.waiting.insert(key);
            key
        };
        let waiting = Waiting {
            admission: self,
            key,
        };
        let start = Instant::now();
        let mut waited = false;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a release between the check and the await
            // still wakes this task.
            notified.as_mut().enable();
            let since = lock(&self.inner)
                .last_release
                .map_or(start, |r| r.max(start));
            let overdue = since.elapsed() >= OVERDRAFT_AFTER;
            if let Some(grant) = self.try_grant(key, rank.group, bytes, waited, overdue) {
                std::mem::forget(waiting);
                return grant;
            }
            waited = true;
            if overdue {
                notified.await;
            } else {
                let left = OVERDRAFT_AFTER.saturating_sub(since.elapsed());
                let _ = tokio::time::timeout(left, notified).await;
            }
        }
    }

    fn try_grant(
        self: &Arc<Self>,
        key: Key,
        group: u64,
        bytes: u64,
        waited: bool,
        overdue: bool,
    ) -> Option<Grant> {
        let mut inner = lock(&self.inner);
        let first_waiting = inner.waiting.first() == Some(&key);
        let fits =
            inner.running.is_empty() || inner.reserved.saturating_add(bytes) <= self.capacity;
        let below_all = overdue && inner.running.keys().next().is_none_or(|r| key.0 < r.0);
        // A later shuffle of the same job runs: it may be waiting on this task, which goes in
        // at once; over the budget only while no other task of the job is over it.
        let feeds_running = group != 0
            && inner
                .running
                .iter()
                .any(|(r, (_, g, _))| *g == group && r.0 > key.0);
        let job_over = inner
            .running
            .values()
            .any(|(_, g, over)| *g == group && *over);
        let admitted =
            below_all || (feeds_running && (fits || !job_over)) || (first_waiting && fits);
        if !admitted {
            return None;
        }
        if !fits {
            tracing::debug!(
                order = key.0,
                group,
                bytes,
                feeds_running,
                running = ?inner.running,
                "task admitted over the budget"
            );
        }
        inner.waiting.remove(&key);
        inner.running.insert(key, (bytes, group, !fits));
        inner.reserved += bytes;
        let m = &mut inner.metrics;
        m.admitted += 1;
        m.waited += u64::from(waited);
        m.overdrafts += u64::from(!fits);
        let (reserved, running) = (inner.reserved, inner.running.len() as u64);
        let m = &mut inner.metrics;
        m.peak_reserved = m.peak_reserved.max(reserved);
        m.peak_running = m.peak_running.max(running);
        drop(inner);
        // The next waiter may fit too.
        self.changed.notify_waiters();
        Some(Grant {
            admission: self.clone(),
            key,
            bytes,
        })
    }

    /// Wait until the last running task's grant comes back (a permit is kept if that happened
    /// while nobody waited).
    pub async fn idle(&self) {
        self.idle.notified().await
    }

    /// No task is running.
    pub fn is_idle(&self) -> bool {
        lock(&self.inner).running.is_empty()
    }

    /// Bytes granted now.
    pub fn reserved(&self) -> u64 {
        lock(&self.inner).reserved
    }

    /// Tasks holding a grant now.
    pub fn running(&self) -> u64 {
        lock(&self.inner).running.len() as u64
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn metrics(&self) -> AdmissionMetrics {
        lock(&self.inner).metrics
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn pending<F: std::future::Future>(f: &mut std::pin::Pin<Box<F>>) -> bool {
        tokio::time::timeout(Duration::from_millis(50), f.as_mut())
            .await
            .is_err()
    }

    #[tokio::test]
    async fn grants_stay_within_capacity_and_wait_in_order() {
        let a = Admission::new(100);
        let g1 = a.admit(5, 60).await;
        let mut second = Box::pin(a.admit(5, 60));
        assert!(pending(&mut second).await, "60 + 60 is over 100: waits");
        assert_eq!(a.reserved(), 60);
        drop(g1);
        let g2 = second.await;
        assert_eq!(a.reserved(), 60);
        let m = a.metrics();
        assert_eq!((m.admitted, m.waited, m.overdrafts), (2, 1, 0));
        drop(g2);
        assert_eq!(a.reserved(), 0);
    }

    #[tokio::test]
    async fn a_task_below_every_running_one_is_admitted_over_budget() {
        // A consumer (order 7) holds the budget and waits on its producer (order 3): the
        // producer must run or the two deadlock.
        let a = Admission::new(100);
        let consumer = a.admit(7, 100).await;
        let start = Instant::now();
        let producer = a.admit(3, 50).await;
        assert!(start.elapsed() >= OVERDRAFT_AFTER);
        assert_eq!(a.reserved(), 150);
        assert_eq!(a.metrics().overdrafts, 1);
        // Another task of the consumer's order (or higher) waits.
        let mut later = Box::pin(a.admit(7, 10));
        assert!(pending(&mut later).await);
        drop(producer);
        drop(consumer);
        let _g = later.await;
    }

    #[tokio::test]
    async fn lower_order_goes_first_and_a_dropped_waiter_leaves_the_queue() {
        let a = Admission::new(100);
        let g = a.admit(1, 100).await;
        let mut high = Box::pin(a.admit(9, 10));
        let mut low = Box::pin(a.admit(4, 10));
        let mut gone = Box::pin(a.admit(2, 10));
        assert!(pending(&mut high).await && pending(&mut low).await && pending(&mut gone).await);
        drop(gone); // cancelled while waiting: must not block the queue
        drop(g);
        let l = low.await;
        let h = high.await;
        assert_eq!(a.reserved(), 20);
        drop((l, h));
        assert_eq!(a.reserved(), 0);
    }

    #[tokio::test]
    async fn one_task_larger_than_the_budget_still_runs_alone() {
        let a = Admission::new(10);
        let g = a.admit(1, 1000).await;
        assert_eq!(a.reserved(), 1000);
        drop(g);
    }

    #[tokio::test]
    async fn idle_once_the_last_grant_comes_back() {
        let a = Admission::new(100);
        assert!(a.is_idle());
        let g1 = a.admit(1, 10).await;
        let g2 = a.admit(1, 10).await;
        let mut idle = Box::pin(a.idle());
        drop(g1);
        assert!(pending(&mut idle).await, "one task still runs");
        assert!(!a.is_idle());
        drop(g2);
        idle.await;
        assert!(a.is_idle());
    }

    #[tokio::test]
    async fn a_producer_of_a_running_consumer_of_its_job_is_admitted_at_once() {
        let a = Admission::new(20);
        let job = |order| Rank { order, group: 7 };
        // Two consumer tasks (order 2) hold the whole budget, waiting on their producer.
        let c1 = a.admit(job(2), 10).await;
        let c2 = a.admit(job(2), 10).await;
        // A producer of another job, or of no job, waits its turn.
        let mut other = Box::pin(a.admit(Rank { order: 1, group: 3 }, 10));
        assert!(pending(&mut other).await);
        let mut alone = Box::pin(a.admit(1, 10));
        assert!(pending(&mut alone).await);
        // Its own job's producer (order 1) goes in at once, over the budget.
        let p = tokio::time::timeout(Duration::from_millis(200), a.admit(job(1), 10))
            .await
            .expect("a producer of a running consumer must not wait");
        assert_eq!(a.reserved(), 30);
        assert_eq!(a.metrics().overdrafts, 1);
        // One task of the job over the budget at a time: the next producer waits for it.
        let mut second = Box::pin(a.admit(job(1), 10));
        assert!(pending(&mut second).await);
        drop(p);
        let p = tokio::time::timeout(Duration::from_millis(200), second)
            .await
            .expect("the next producer goes once the first is done");
        assert_eq!(a.metrics().overdrafts, 2);
        // A later stage of the job does not jump the queue.
        let mut later = Box::pin(a.admit(job(3), 10));
        assert!(pending(&mut later).await);
        drop((c1, c2, p, other, alone, later));
    }
}
