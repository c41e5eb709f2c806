//! The local cluster, the embedded default: N worker processes on this machine (loopback,
//! ephemeral ports, a random token), started healthy and stopped on drop — also when the
//! driver fails. Workers also exit by themselves when the driver process dies (their stdin
//! closes).

use crate::driver::{Driver, DriverConfig};
use crate::error::{Error, Result};
use crate::worker::{READY_LINE, TOKEN_ENV};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct LocalClusterConfig {
    pub workers: usize,
    /// Block store budget of each worker, in bytes.
    pub memory_budget: u64,
    /// Parent of the workers' spill dirs; a temporary dir when `None`.
    pub spill_dir: Option<PathBuf>,
    /// none, lz4, zstd or auto (none: every worker shares this host).
    pub compression: String,
    /// Program and leading arguments that start one worker.
    pub worker_command: Vec<String>,
    pub driver: DriverConfig,
    pub startup_timeout: Duration,
}

impl LocalClusterConfig {
    pub fn new(workers: usize, worker_command: Vec<String>) -> Self {
        LocalClusterConfig {
            workers,
            memory_budget: 1 << 30,
            spill_dir: None,
            compression: "auto".into(),
            worker_command,
            driver: DriverConfig::default(),
            startup_timeout: Duration::from_secs(60),
        }
    }
}

/// Resolve `auto`: every local-cluster worker shares this host, where LZ4 encodes slower
/// than loopback carries bytes (FACTS.md), so blocks stay uncompressed.
pub fn resolve_compression(setting: &str, all_local: bool) -> Result<String> {
    match setting.to_ascii_lowercase().as_str() {
        "auto" => Ok(if all_local { "none" } else { "lz4" }.into()),
        other => other.parse::<crate::Compression>().map(|c| c.to_string()),
    }
}

pub struct LocalCluster {
    children: Vec<Child>,
    pub driver: Arc<Driver>,
    pub spill_root: PathBuf,
    _tempdir: Option<tempfile::TempDir>,
}

/// In a default spill root, the pid of the process that owns it.
const OWNER_FILE: &str = "owner.pid";

/// Remove default spill roots (`flightshuffle-*` in `tmp`, other than `keep`) whose owner
/// process is gone: a driver killed with SIGKILL cannot remove its own (its workers remove
/// their directories inside it when they see it go). Roots without an owner file are left
/// alone.
pub fn sweep_stale_roots(tmp: &Path, keep: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return 0;
    };
    let mut swept = 0;
    for e in entries.flatten() {
        let path = e.path();
        let named = e
            .file_name()
            .to_string_lossy()
            .starts_with("flightshuffle-");
        if !named || path == keep || !path.is_dir() {
            continue;
        }
        let Ok(owner) = std::fs::read_to_string(path.join(OWNER_FILE)) else {
            continue;
        };
        let alive = match owner.trim().parse::<u32>() {
            Ok(pid) => Path::new(&format!("/proc/{pid}")).exists(),
            Err(_) => true,
        };
        if !alive && std::fs::remove_dir_all(&path).is_ok() {
            tracing::info!(path = %path.display(), "removed the spill root of a dead driver");
            swept += 1;
        }
    }
    swept
}

impl LocalCluster {
    pub async fn start(cfg: LocalClusterConfig) -> Result<Self> {
        if cfg.workers == 0 {
            return Err(Error::invalid("a local cluster needs at least one worker"));
        }
        let (program, lead) = cfg
            .worker_command
            .split_first()
            .ok_or_else(|| Error::invalid("empty worker command"))?;
        let compression = resolve_compression(&cfg.compression, true)?;
        let (tempdir, spill_root) = match &cfg.spill_dir {
            Some(d) => (None, d.clone()),
            None => {
                let t = tempfile::Builder::new()
                    .prefix("flightshuffle-")
                    .tempdir()
                    .map_err(|e| Error::io(std::env::temp_dir(), e))?;
                let p = t.path().to_path_buf();
                sweep_stale_roots(&std::env::temp_dir(), &p);
                let owner = p.join(OWNER_FILE);
                std::fs::write(&owner, std::process::id().to_string())
                    .map_err(|e| Error::io(&owner, e))?;
                (Some(t), p)
            }
        };
        let token = format!("{:032x}", rand::random::<u128>());
        let mut cluster = LocalCluster {
            children: Vec::new(),
            driver: Driver::connect(&["127.0.0.1:1".into()], &token, cfg.driver.clone())?,
            spill_root: spill_root.clone(),
            _tempdir: tempdir,
        };
        let (tx, rx) = std::sync::mpsc::channel::<(usize, Option<String>)>();
        for i in 0..cfg.workers {
            let mut child = Command::new(program)
                .args(lead)
                .arg("--id")
                .arg(format!("worker-{i}"))
                .arg("--listen")
                .arg("127.0.0.1:0")
                .arg("--memory-budget")
                .arg(cfg.memory_budget.to_string())
                .arg("--spill-dir")
                .arg(spill_root.join(format!("worker-{i}")))
                .arg("--compression")
                .arg(&compression)
                .arg("--timeout-secs")
                .arg(cfg.driver.rpc_timeout.as_secs().max(1).to_string())
                .arg("--exit-with-stdin")
                .env(TOKEN_ENV, &token)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| Error::Cluster(format!("cannot start worker {program:?}: {e}")))?;
            let stdout = child.stdout.take();
            cluster.children.push(child);
            let tx = tx.clone();
            std::thread::spawn(move || {
                let Some(out) = stdout else {
                    let _ = tx.send((i, None));
                    return;
                };
                let mut sent = false;
                // Keep draining stdout after the ready line so the worker never blocks on it.
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if !sent {
                        if let Some(addr) = line.strip_prefix(READY_LINE) {
                            let _ = tx.send((i, Some(addr.trim().to_string())));
                            sent = true;
                        }
                    }
                }
                if !sent {
                    let _ = tx.send((i, None));
                }
            });
        }
        drop(tx);
        let mut addrs = vec![String::new(); cfg.workers];
        let deadline = Instant::now() + cfg.startup_timeout;
        for _ in 0..cfg.workers {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((i, Some(addr))) => addrs[i] = addr,
                Ok((i, None)) => {
                    let status = cluster.children[i].try_wait().ok().flatten();
                    return Err(Error::Cluster(format!(
                        "worker {i} exited before it was ready ({status:?}); see its stderr above"
                    )));
                }
                Err(_) => {
                    return Err(Error::Timeout {
                        what: format!("{} workers to start", cfg.workers),
                        seconds: cfg.startup_timeout.as_secs_f64(),
                    })
                }
            }
        }
        cluster.driver = Driver::connect(&addrs, &token, cfg.driver.clone())?;
        cluster.driver.check_health().await?;
        tracing::info!(workers = cfg.workers, "local cluster ready");
        Ok(cluster)
    }

    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.id()).collect()
    }

    /// SIGKILL one worker, as a crash would (fault-injection in tests and chaos runs).
    pub fn kill_worker(&mut self, i: usize) -> Result<()> {
        let c = self
            .children
            .get_mut(i)
            .ok_or_else(|| Error::invalid(format!("no worker {i}")))?;
        c.kill()
            .map_err(|e| Error::Cluster(format!("cannot kill worker {i}: {e}")))?;
        let _ = c.wait();
        Ok(())
    }

    /// Stop every worker (kill, then reap). Safe to call more than once.
    pub fn stop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
        }
        for c in &mut self.children {
            let _ = c.wait();
        }
        self.children.clear();
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.stop();
    }
}
