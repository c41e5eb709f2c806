//! A static cluster's replacer ([`super::HostedCluster::connect_static`]): a lost worker's
//! slot waits for a new process at its address (what its supervisor restarts), the lost one
//! fenced should it answer again; failing that, a surviving worker starts a stand-in beside
//! itself for the slot (`crate::worker::stand_in`).

use crate::driver::Driver;
use crate::error::{Error, Result};
use crate::sync::lock;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The replacer of a static cluster (see [`HostedCluster::connect_static`]).
pub(super) struct Restarts {
    /// Weak: the driver holds the replacer.
    pub(super) driver: std::sync::Weak<Driver>,
    pub(super) creds: crate::transport::Credentials,
    /// The process instance last seen at each address.
    pub(super) seen: Arc<Mutex<std::collections::HashMap<String, u64>>>,
    pub(super) wait: Duration,
    /// A survivor takes the slot over when no new process answers within `wait`.
    pub(super) take_over: bool,
    /// The stand-ins started (their addresses).
    pub(super) stand_ins: Arc<Mutex<Vec<String>>>,
    pub(super) handle: tokio::runtime::Handle,
}

impl Restarts {
    /// Wait (on a blocking thread) for a new process at lost slot `i`'s address; returns the
    /// address once one answers.
    pub(super) fn wait_for(&self, i: usize) -> Result<String> {
        use crate::transport::client::WorkerClient;
        let driver = self
            .driver
            .upgrade()
            .ok_or_else(|| Error::Cluster("the cluster is stopping".into()))?;
        let addr = driver.worker(i)?.addr;
        let probe = driver.config().health_timeout;
        drop(driver);
        let deadline = Instant::now() + self.wait;
        let old = lock(&self.seen).get(&addr).copied();
        let mut fenced = false;
        loop {
            let client = WorkerClient::new(i, &addr, &self.creds, probe)?;
            match self.handle.block_on(client.health(probe)) {
                Ok(h) if Some(h.instance) != old => {
                    tracing::warn!(worker = i, %addr, "a new worker process answers: it takes the slot");
                    lock(&self.seen).insert(addr.clone(), h.instance);
                    return Ok(addr);
                }
                Ok(_) if !fenced => {
                    // The lost process is back; its outputs were given up: make it exit.
                    let exit = client.action(crate::transport::actions::EXIT, Vec::new(), probe);
                    fenced = self.handle.block_on(exit).is_ok();
                    tracing::warn!(worker = i, %addr, fenced, "the lost worker answers again: told to exit");
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                if self.take_over {
                    if let Some(survivor) = self.survivor_for(i, &addr, probe) {
                        return Ok(survivor);
                    }
                }
                let survivors = match self.take_over {
                    true => " and no surviving worker could start a stand-in for it",
                    false => "",
                };
                return Err(Error::Cluster(format!(
                    "worker {i} at {addr} was lost and no new worker process answered there \
                     within {:?}{survivors}: restart it at the same address (a supervisor such \
                     as systemd Restart=always or a Kubernetes StatefulSet does this), or \
                     remove it with remove_worker",
                    self.wait
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Restarts {
    /// Start a stand-in for lost slot `i` (last at `lost`) on a surviving host: a worker of
    /// another live slot starts a second worker process beside itself (see
    /// `worker::stand_in`); hosts serving the fewest slots are asked first (ties: the lowest
    /// slot). Returns the stand-in's address; None when no survivor could start one.
    fn survivor_for(&self, i: usize, lost: &str, probe: Duration) -> Option<String> {
        use crate::transport::client::WorkerClient;
        let driver = self.driver.upgrade()?;
        let n = driver.num_workers();
        let addrs: Vec<Option<String>> = (0..n)
            .map(|s| driver.worker(s).ok().map(|w| w.addr))
            .collect();
        let host = |a: &str| {
            a.rsplit_once(':')
                .map_or(a.to_string(), |(h, _)| h.to_string())
        };
        let serving = |a: &str| {
            let h = host(a);
            addrs.iter().flatten().filter(|b| host(b) == h).count()
        };
        let mut candidates: Vec<(usize, usize, String)> = (0..n)
            .filter(|&s| s != i && driver.is_alive(s))
            .filter_map(|s| addrs[s].clone().map(|a| (s, a)))
            .filter(|(_, a)| a != lost)
            .map(|(s, a)| (serving(&a), s, a))
            .collect();
        drop(driver);
        candidates.sort();
        for (_, s, addr) in candidates {
            let Ok(client) = WorkerClient::new(s, &addr, &self.creds, probe) else {
                continue;
            };
            let started = client.action(
                crate::transport::actions::STAND_IN,
                Vec::new(),
                STAND_IN_TIMEOUT,
            );
            let stand_in = match self.handle.block_on(started) {
                Ok(reply) => String::from_utf8_lossy(&reply).into_owned(),
                Err(e) => {
                    tracing::warn!(worker = i, by = s, error = %e, "a survivor could not start a stand-in");
                    continue;
                }
            };
            // Its instance, so that should it be lost later and answer again, it is fenced
            // like any lost process rather than taken back.
            let answered = WorkerClient::new(i, &stand_in, &self.creds, probe)
                .map(|c| (self.handle.block_on(c.health(probe)), c));
            let client = match answered {
                Ok((Ok(h), c)) => {
                    lock(&self.seen).insert(stand_in.clone(), h.instance);
                    c
                }
                Ok((Err(_), c)) => {
                    // Started but not answering: not left running.
                    let exit = c.action(crate::transport::actions::EXIT, Vec::new(), probe);
                    let _ = self.handle.block_on(exit);
                    continue;
                }
                Err(_) => continue,
            };
            // Listed before the check: a cluster closing now either finds it in the list or
            // is seen stopping here (it stops replacing before it takes the list).
            lock(&self.stand_ins).push(stand_in.clone());
            if self.driver.upgrade().is_none_or(|d| d.is_stopping()) {
                let exit = client.action(crate::transport::actions::EXIT, Vec::new(), probe);
                let _ = self.handle.block_on(exit);
                return None;
            }
            tracing::warn!(
                worker = i,
                lost,
                by = s,
                %stand_in,
                "no new worker process answered: a stand-in on a surviving host takes the slot"
            );
            if let Some(d) = self.driver.upgrade() {
                d.event(
                    "worker_stand_in",
                    || serde_json::json!({"worker": i, "by": s}),
                );
            }
            return Some(stand_in);
        }
        None
    }
}

/// How long a survivor may take to start a stand-in (a Python worker imports its modules).
const STAND_IN_TIMEOUT: Duration = Duration::from_secs(90);
