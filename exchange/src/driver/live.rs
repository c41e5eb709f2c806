//! The live set: a lost worker's slot gets a replacement process (the local cluster starts
//! it, see [`Driver::set_replacer`]) that the driver puts in place after a health check; work
//! that needs every worker waits for it ([`Driver::wait_all_live`]). Calls that fail are
//! classified here: a worker that does not answer a health check is lost. On a cluster that does
//! not replace workers a lost worker is only suspected: the job that found it lost fails, and
//! once it answers a health check again (it was paused or starved) it is cleared.

use super::{Driver, Replacer};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::transport::client::WorkerClient;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Driver {
    /// How many times worker slot `i` was given a replacement.
    pub fn generation(&self, i: usize) -> u64 {
        self.generations
            .get(i)
            .map_or(0, |g| g.load(Ordering::SeqCst))
    }

    /// The processes `onto` ((slot, generation)) that blocks were just put on are still their
    /// slots' live ones; otherwise [`Error::WorkerLost`] naming the first that is not (a slot
    /// found lost meanwhile may have taken the puts on its old process). `what` says what was
    /// put there, e.g. "map 3 was rebuilt".
    pub(super) fn still_live(&self, onto: &[(usize, u64)], what: &str) -> Result<()> {
        match onto
            .iter()
            .find(|&&(s, g)| self.generation(s) != g || !self.is_alive(s))
        {
            Some(&(slot, _)) => Err(Error::WorkerLost {
                worker: slot,
                addr: String::new(),
                reason: format!("lost while {what} onto it"),
                lost_blocks: 0,
            }),
            None => Ok(()),
        }
    }

    /// Replacements started so far, over all slots (changes when a worker is found lost).
    pub fn replacements(&self) -> u64 {
        self.replaced.load(Ordering::SeqCst)
    }

    /// Let the driver replace lost workers: `replacer` starts a new worker process for a slot
    /// and returns its address (the local cluster sets one; a cluster of workers started
    /// elsewhere has none, and a lost worker stays lost).
    pub fn set_replacer(&self, replacer: Replacer) {
        *lock(&self.replacer) = Some(replacer);
    }

    /// Whether lost workers are replaced (a replacer is set).
    pub fn replaces_workers(&self) -> bool {
        lock(&self.replacer).is_some()
    }

    /// Replace no more lost workers: the cluster is stopping, and a worker found gone from
    /// here on (a job still running when its cluster was closed) is logged at debug level
    /// only.
    pub fn stop_replacing(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        *lock(&self.replacer) = None;
    }

    /// Whether the cluster is stopping ([`Self::stop_replacing`] was called).
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Put worker `addr` in slot `i` (a lost worker's replacement): it must answer a health
    /// check; readers on the driver connect to it on first use.
    pub async fn replace_worker(&self, i: usize, addr: &str) -> Result<()> {
        let client = WorkerClient::new(i, addr, &self.creds, self.cfg.rpc_timeout)?;
        client.health(self.cfg.health_timeout).await?;
        {
            let mut slots = self.workers.write().unwrap_or_else(|p| p.into_inner());
            let slot = slots
                .get_mut(i)
                .ok_or_else(|| Error::invalid(format!("no worker slot {i}")))?;
            *slot = client;
        }
        self.alive[i].store(true, Ordering::SeqCst);
        lock(&self.replace_failures).remove(&i);
        self.live.send_modify(|v| *v += 1);
        tracing::warn!(worker = i, %addr, generation = self.generation(i), "lost worker replaced");
        self.event(
            "worker_replaced",
            || serde_json::json!({"worker": i, "generation": self.generation(i)}),
        );
        Ok(())
    }

    /// Start replacing lost worker `i` in the background, once (a replacer is set and no
    /// replacement of this generation runs yet). `again`: a replacement of it failed before
    /// (not counted as one more replacement).
    pub(super) fn start_replacement(&self, i: usize, again: bool) {
        let Some(replacer) = lock(&self.replacer).clone() else {
            return;
        };
        let (Some(me), Ok(rt)) = (self.me.upgrade(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        self.generations[i].fetch_add(1, Ordering::SeqCst);
        if !again {
            self.replaced.fetch_add(1, Ordering::SeqCst);
        }
        rt.spawn(async move {
            let started = tokio::task::spawn_blocking(move || replacer(i)).await;
            let result = match started {
                Ok(Ok(addr)) => me.replace_worker(i, &addr).await,
                Ok(Err(e)) => Err(e),
                Err(e) => Err(Error::Cluster(format!("replacement task failed: {e}"))),
            };
            if let Err(e) = result {
                tracing::error!(worker = i, error = %e, "could not replace a lost worker");
                lock(&me.replace_failures).insert(i, e.to_string());
                me.live.send_modify(|v| *v += 1);
            }
        });
    }

    /// Wait until every worker slot is live (a lost worker's replacement is up), at most
    /// `timeout`; a lost worker that is not being replaced is an error at once, and so is one
    /// whose replacement fails. A slot whose replacement failed before this call is given one
    /// more try (a static cluster's worker may have been restarted since).
    pub async fn wait_all_live(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.live.subscribe();
        let failed_before: Vec<usize> = lock(&self.replace_failures)
            .drain()
            .map(|(i, _)| i)
            .collect();
        for i in failed_before {
            if !self.is_alive(i) {
                self.start_replacement(i, true);
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let dead = (0..self.num_workers()).find(|&i| !self.is_alive(i));
            let Some(i) = dead else { return Ok(()) };
            if lock(&self.replacer).is_none() {
                // Not replaced: only suspected. A worker that answers again (it was paused or
                // starved) is cleared: its process and blocks are the same, and nothing ran
                // again in its place (recovery needs a replacer).
                let client = self.worker(i)?;
                if let Err(e) = client.health(self.cfg.health_timeout).await {
                    return Err(self.lost(
                        i,
                        format!("lost earlier, no replacement on this cluster; still: {e}"),
                    ));
                }
                self.alive[i].store(true, Ordering::SeqCst);
                self.live.send_modify(|v| *v += 1);
                tracing::warn!(worker = i, "a worker found lost answers again: cleared");
                continue;
            }
            if let Some(why) = lock(&self.replace_failures).get(&i).cloned() {
                return Err(self.lost(i, format!("lost earlier, and {why}")));
            }
            let changed = tokio::time::timeout_at(deadline, rx.changed()).await;
            if !matches!(changed, Ok(Ok(()))) {
                return Err(self.lost(
                    i,
                    format!("lost earlier; its replacement was not up within {timeout:?}"),
                ));
            }
        }
    }

    pub(super) fn lost(&self, worker: usize, reason: String) -> Error {
        let was_alive = self.alive[worker].swap(false, Ordering::SeqCst);
        let lost_blocks = self.blocks_on(worker).len();
        // Logged once, when the worker is first found lost (every task that was waiting on it
        // reports the loss too, at debug level).
        let addr = self.worker(worker).map(|w| w.addr).unwrap_or_default();
        if was_alive && self.stopping.load(Ordering::SeqCst) {
            tracing::debug!(worker, %addr, %reason, "worker gone: the cluster is stopping");
        } else if was_alive {
            tracing::warn!(worker, %addr, %reason, lost_blocks, "worker lost");
            self.event("worker_lost", || {
                serde_json::json!({"worker": worker, "reason": reason, "lost_blocks": lost_blocks})
            });
            self.start_replacement(worker, false);
        } else {
            tracing::debug!(worker, %reason, "worker already lost");
        }
        Error::WorkerLost {
            worker,
            addr,
            reason,
            lost_blocks,
        }
    }

    /// Turn a failed call into `WorkerLost` when the worker no longer answers health checks,
    /// or when the call went to a process its slot has replaced since (the new one answers,
    /// but what the call was about went with the old one).
    pub async fn classify(&self, err: Error) -> Error {
        if let Error::Remote { worker, addr, .. } = &err {
            let now = self.worker(*worker).map(|c| c.addr);
            if now.as_ref().is_ok_and(|a| a != addr) {
                return Error::WorkerLost {
                    worker: *worker,
                    addr: addr.clone(),
                    reason: format!("replaced since the call was made; the call: {err}"),
                    lost_blocks: 0,
                };
            }
        }
        let worker = match &err {
            Error::Remote { worker, code, .. }
                if !matches!(
                    code,
                    tonic::Code::InvalidArgument
                        | tonic::Code::NotFound
                        | tonic::Code::DataLoss
                        | tonic::Code::Unauthenticated
                        | tonic::Code::ResourceExhausted
                        | tonic::Code::FailedPrecondition
                ) =>
            {
                *worker
            }
            Error::Timeout { .. } => match self.first_dead().await {
                Some((w, reason)) => return self.lost(w, format!("{reason}; after: {err}")),
                None => return err,
            },
            _ => return err,
        };
        if !self.is_alive(worker) {
            return self.lost(worker, err.to_string());
        }
        let client = match self.worker(worker) {
            Ok(c) => c,
            Err(_) => return err,
        };
        match client.health(self.cfg.health_timeout).await {
            // The worker that answered is alive, but the failure may be a peer's it was
            // talking to (a push, a read): name a lost peer as the cause when there is one.
            Ok(_) => match self.first_dead().await {
                Some((w, reason)) => self.lost(w, format!("{reason}; after: {err}")),
                None => err,
            },
            Err(h) => self.lost(worker, format!("{err}; health check: {h}")),
        }
    }

    async fn first_dead(&self) -> Option<(usize, String)> {
        let clients = self.clients();
        let checks = clients
            .iter()
            .map(|w| async move { (w.index, w.health(self.cfg.health_timeout).await) });
        futures::future::join_all(checks)
            .await
            .into_iter()
            .find_map(|(i, r)| r.err().map(|e| (i, format!("health check failed: {e}"))))
    }

    /// Check every worker once; the first that does not answer is reported lost.
    pub async fn check_health(&self) -> Result<()> {
        match self.first_dead().await {
            Some((w, reason)) => Err(self.lost(w, reason)),
            None => Ok(()),
        }
    }
}
