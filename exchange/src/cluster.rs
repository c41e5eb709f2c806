//! The local cluster, the embedded default: N worker processes on this machine (loopback,
//! ephemeral ports, a random token, TLS with a CA made for the cluster), started healthy and
//! stopped on drop — also when the driver fails. Workers also exit by themselves when the
//! driver process dies (their stdin closes). Besides it, workers hosted elsewhere: by another
//! runtime that can start them (Ray), or by a supervisor at fixed addresses (a static cluster).

use crate::driver::{Driver, DriverConfig};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::worker::{READY_LINE, TOKEN_ENV};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

mod restarts;
use restarts::Restarts;

/// How to start a local cluster: its workers, their budget, and its driver.
#[derive(Debug, Clone)]
pub struct LocalClusterConfig {
    /// Worker processes to start.
    pub workers: usize,
    /// Block store budget of each worker, in bytes.
    pub memory_budget: u64,
    /// Spill file bytes of each worker past which segments move to the cluster's store
    /// (`driver.storage`); None: no limit.
    pub disk_budget: Option<u64>,
    /// Parent of the workers' spill dirs; a temporary dir when `None`.
    pub spill_dir: Option<PathBuf>,
    /// none, lz4, zstd or auto (none: every worker shares this host).
    pub compression: String,
    /// Program and leading arguments that start one worker.
    pub worker_command: Vec<String>,
    /// Settings of the cluster's driver.
    pub driver: DriverConfig,
    /// How long the workers get to start and report ready.
    pub startup_timeout: Duration,
    /// How the cluster's connections are secured.
    pub tls: TlsSetting,
}

/// How a local cluster's connections are secured.
#[derive(Debug, Clone, PartialEq)]
pub enum TlsSetting {
    /// Plaintext on loopback: the token and blocks in clear to anyone who can read it.
    Off,
    /// TLS with a CA and certificate made for this cluster at start (the default);
    /// `mutual`: workers also ask their clients for a certificate signed by that CA.
    Local {
        /// Workers also ask their clients for a certificate signed by the cluster's CA.
        mutual: bool,
    },
    /// TLS with certificate files of your own (the certificate must name `127.0.0.1`).
    Files {
        /// The CA certificate file (PEM) that signed `cert`.
        ca: PathBuf,
        /// The certificate file (PEM) the workers serve (and the driver shows, with `mutual`).
        cert: PathBuf,
        /// The private key file (PEM) of `cert`.
        key: PathBuf,
        /// Whether workers also ask their clients for a certificate signed by `ca`.
        mutual: bool,
    },
}

impl Default for TlsSetting {
    fn default() -> Self {
        TlsSetting::Local { mutual: false }
    }
}

impl LocalClusterConfig {
    /// A cluster of `workers` started by `worker_command`, with 1 GiB budgets, `auto`
    /// compression, TLS made for the cluster and 60 seconds to start.
    pub fn new(workers: usize, worker_command: Vec<String>) -> Self {
        LocalClusterConfig {
            workers,
            memory_budget: 1 << 30,
            disk_budget: None,
            spill_dir: None,
            compression: "auto".into(),
            worker_command,
            driver: DriverConfig::default(),
            startup_timeout: Duration::from_secs(60),
            tls: TlsSetting::default(),
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

/// A running local cluster: its worker processes and a driver connected to them.
pub struct LocalCluster {
    /// The worker process of each slot (its replacement's, once a lost worker was replaced).
    children: Arc<Mutex<Vec<Option<Child>>>>,
    /// The driver connected to the workers.
    pub driver: Arc<Driver>,
    /// The cluster's private directory under which each worker spills.
    pub spill_root: PathBuf,
    _tempdir: Option<tempfile::TempDir>,
    /// Where a made CA and certificate are (removed with the cluster).
    _tls_dir: Option<tempfile::TempDir>,
}

/// How this cluster starts a worker process (the first ones, and replacements).
#[derive(Clone)]
struct Launcher {
    program: String,
    lead: Vec<String>,
    memory_budget: u64,
    disk_budget: Option<u64>,
    spill_root: PathBuf,
    compression: String,
    rpc_timeout: Duration,
    token: String,
    startup_timeout: Duration,
    /// TLS flags of every worker (empty: plaintext).
    tls_args: Vec<String>,
}

impl Launcher {
    /// The spill dir of slot `i`'s worker of generation `g` (0: the first one).
    fn spill_dir(&self, i: usize, g: u64) -> PathBuf {
        match g {
            0 => self.spill_root.join(format!("worker-{i}")),
            g => self.spill_root.join(format!("worker-{i}.{g}")),
        }
    }

    /// Start slot `i`'s worker of generation `g`; the receiver gets its address (None if it
    /// exits first).
    fn launch(&self, i: usize, g: u64) -> Result<(Child, mpsc::Receiver<Option<String>>)> {
        let mut child = Command::new(&self.program)
            .args(&self.lead)
            .arg("--id")
            .arg(format!("worker-{i}"))
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--memory-budget")
            .arg(self.memory_budget.to_string())
            .arg("--spill-dir")
            .arg(self.spill_dir(i, g))
            .arg("--compression")
            .arg(&self.compression)
            .arg("--timeout-secs")
            .arg(self.rpc_timeout.as_secs().max(1).to_string())
            .arg("--exit-with-stdin")
            .arg("--token-stdin")
            .args(
                self.disk_budget
                    .map(|b| vec!["--disk-budget".to_string(), b.to_string()])
                    .unwrap_or_default(),
            )
            .args(&self.tls_args)
            .env_remove(TOKEN_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::Cluster(format!("cannot start worker {:?}: {e}", self.program)))?;
        // The token goes on the worker's stdin, which stays open (the worker exits when it
        // closes): not in its environment, where its user code would see it.
        let sent = child.stdin.as_mut().map(|stdin| {
            stdin
                .write_all(format!("{}\n", self.token).as_bytes())
                .and_then(|_| stdin.flush())
        });
        if !matches!(sent, Some(Ok(()))) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Cluster(format!(
                "cannot pass the token to worker {i}: {sent:?}"
            )));
        }
        let stdout = child.stdout.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let Some(out) = stdout else {
                let _ = tx.send(None);
                return;
            };
            let mut sent = false;
            // Keep draining stdout after the ready line so the worker never blocks on it.
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if !sent {
                    if let Some(addr) = line.strip_prefix(READY_LINE) {
                        let _ = tx.send(Some(addr.trim().to_string()));
                        sent = true;
                    }
                }
            }
            if !sent {
                let _ = tx.send(None);
            }
        });
        Ok((child, rx))
    }

    /// Wait (until `deadline`) for a launched worker's address.
    fn ready(
        &self,
        i: usize,
        child: &mut Child,
        rx: &mpsc::Receiver<Option<String>>,
        deadline: Instant,
    ) -> Result<String> {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Some(addr)) => Ok(addr),
            Ok(None) => {
                let status = child.try_wait().ok().flatten();
                Err(Error::Cluster(format!(
                    "worker {i} exited before it was ready ({status:?}); see its stderr above"
                )))
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(Error::Timeout {
                    what: format!("worker {i} to start"),
                    seconds: self.startup_timeout.as_secs_f64(),
                })
            }
        }
    }

    /// Replace slot `i`'s worker: kill the old process (a paused one too), remove its spill
    /// dir, start generation `g`. Returns the new worker's address.
    fn replace(&self, children: &Mutex<Vec<Option<Child>>>, i: usize, g: u64) -> Result<String> {
        if lock(children).len() <= i {
            return Err(Error::Cluster(format!(
                "no worker slot {i}: the cluster stopped"
            )));
        }
        if let Some(mut old) = lock(children).get_mut(i).and_then(Option::take) {
            let _ = old.kill();
            let _ = old.wait();
        }
        for old in 0..g {
            let _ = std::fs::remove_dir_all(self.spill_dir(i, old));
        }
        let (mut child, rx) = self.launch(i, g)?;
        let addr = self.ready(i, &mut child, &rx, Instant::now() + self.startup_timeout)?;
        if let Some(slot) = lock(children).get_mut(i) {
            *slot = Some(child);
        }
        tracing::info!(worker = i, generation = g, %addr, "replacement worker started");
        Ok(addr)
    }
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

/// A new temporary directory named `<prefix>...` holding this process's id in
/// [`OWNER_FILE`], so [`sweep_stale_roots`] removes it if this process dies without doing so.
fn owned_tempdir(prefix: &str) -> Result<tempfile::TempDir> {
    owned_tempdir_in(&std::env::temp_dir(), prefix)
}

/// [`owned_tempdir`] in `parent`: made exclusively (a new random name), mode 0700.
fn owned_tempdir_in(parent: &Path, prefix: &str) -> Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .tempdir_in(parent)
        .map_err(|e| Error::io(parent, e))?;
    let owner = dir.path().join(OWNER_FILE);
    let mut f = crate::private::create_file(&owner)?;
    f.write_all(std::process::id().to_string().as_bytes())
        .map_err(|e| Error::io(&owner, e))?;
    Ok(dir)
}

/// The certificate files `setting` asks for (made in a private temporary directory for
/// [`TlsSetting::Local`]), and whether TLS is mutual; `None`: plaintext.
#[allow(clippy::type_complexity)]
fn local_tls(
    setting: &TlsSetting,
) -> Result<(
    Option<tempfile::TempDir>,
    Option<(crate::transport::tls::LocalTls, bool)>,
)> {
    use crate::transport::tls::LocalTls;
    match setting {
        TlsSetting::Off => Ok((None, None)),
        TlsSetting::Files {
            ca,
            cert,
            key,
            mutual,
        } => {
            let files = LocalTls {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            };
            Ok((None, Some((files, *mutual))))
        }
        TlsSetting::Local { mutual } => {
            // Swept like a spill root if this process dies without removing it.
            let dir = owned_tempdir("flightshuffle-tls-")?;
            let files = LocalTls::generate(dir.path())?;
            Ok((Some(dir), Some((files, *mutual))))
        }
    }
}

impl LocalCluster {
    /// Start the workers, wait until each is ready and connect a driver to them.
    pub async fn start(cfg: LocalClusterConfig) -> Result<Self> {
        if cfg.workers == 0 {
            return Err(Error::invalid("a local cluster needs at least one worker"));
        }
        let (program, lead) = cfg
            .worker_command
            .split_first()
            .ok_or_else(|| Error::invalid("empty worker command"))?;
        let compression = resolve_compression(&cfg.compression, true)?;
        // One private (0700) root per cluster, made exclusively under `spill_dir` (or the
        // temporary directory) and removed with the cluster: clusters sharing a `spill_dir`
        // never see each other's files.
        let parent = match &cfg.spill_dir {
            Some(d) => {
                crate::private::create_dir(d)?;
                d.clone()
            }
            None => std::env::temp_dir(),
        };
        let tempdir = owned_tempdir_in(&parent, "flightshuffle-")?;
        let spill_root = tempdir.path().to_path_buf();
        sweep_stale_roots(&parent, &spill_root);
        crate::kept::sweep_stale(&std::env::temp_dir());
        let tempdir = Some(tempdir);
        let token = format!("{:032x}", rand::random::<u128>());
        let (tls_dir, tls) = local_tls(&cfg.tls)?;
        let creds = crate::transport::Credentials {
            token: token.clone(),
            tls: match &tls {
                Some((files, mutual)) => Some(files.client(*mutual)?),
                None => None,
            },
        };
        let launcher = Launcher {
            tls_args: tls
                .as_ref()
                .map(|(files, mutual)| files.worker_args(*mutual))
                .unwrap_or_default(),
            program: program.clone(),
            lead: lead.to_vec(),
            memory_budget: cfg.memory_budget,
            disk_budget: cfg.disk_budget,
            spill_root: spill_root.clone(),
            compression,
            rpc_timeout: cfg.driver.rpc_timeout,
            token: token.clone(),
            startup_timeout: cfg.startup_timeout,
        };
        let mut cluster = LocalCluster {
            children: Arc::new(Mutex::new(Vec::new())),
            driver: Driver::connect(&["127.0.0.1:1".into()], &creds, cfg.driver.clone())?,
            spill_root: spill_root.clone(),
            _tempdir: tempdir,
            _tls_dir: tls_dir,
        };
        // Start every worker, then wait for each to be ready (they start in parallel).
        let mut waiting = Vec::new();
        for i in 0..cfg.workers {
            let (child, rx) = launcher.launch(i, 0)?;
            lock(&cluster.children).push(Some(child));
            waiting.push(rx);
        }
        let deadline = Instant::now() + cfg.startup_timeout;
        let mut addrs = Vec::new();
        for (i, rx) in waiting.iter().enumerate() {
            let mut children = lock(&cluster.children);
            let Some(child) = children.get_mut(i).and_then(Option::as_mut) else {
                return Err(Error::Cluster(format!(
                    "worker {i} vanished while starting"
                )));
            };
            addrs.push(launcher.ready(i, child, rx, deadline)?);
        }
        cluster.driver = Driver::connect(&addrs, &creds, cfg.driver.clone())?;
        cluster.driver.check_health().await?;
        cluster.driver.check_storage().await?;
        // A lost worker is replaced by a new process in its slot (see `Driver::set_replacer`).
        let children = cluster.children.clone();
        let driver = Arc::downgrade(&cluster.driver);
        cluster
            .driver
            .set_replacer(Arc::new(move |i: usize| -> Result<String> {
                let g = driver.upgrade().map_or(1, |d| d.generation(i));
                launcher.replace(&children, i, g)
            }));
        tracing::info!(workers = cfg.workers, "local cluster ready");
        Ok(cluster)
    }

    /// The worker processes' ids, by slot (0 where a slot's process is gone).
    pub fn pids(&self) -> Vec<u32> {
        lock(&self.children)
            .iter()
            .map(|c| c.as_ref().map_or(0, |c| c.id()))
            .collect()
    }

    /// SIGKILL one worker, as a crash would (fault-injection in tests and chaos runs). The
    /// driver replaces it when it finds it lost.
    pub fn kill_worker(&mut self, i: usize) -> Result<()> {
        let mut children = lock(&self.children);
        let c = children
            .get_mut(i)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::invalid(format!("no worker {i}")))?;
        c.kill()
            .map_err(|e| Error::Cluster(format!("cannot kill worker {i}: {e}")))?;
        let _ = c.wait();
        Ok(())
    }

    /// Take worker `i` out of the cluster for good, losing nothing: the driver lets go of it
    /// (see [`Driver::retire_worker`]: every live shuffle must be durable and sealed, and is
    /// read through the store from then on), then its process is stopped and its spill
    /// directory removed. The last worker takes slot `i`; the cluster has one worker fewer.
    pub async fn remove_worker(&self, i: usize) -> Result<crate::driver::Retired> {
        let retired = self.driver.retire_worker(i).await?;
        self.stop_removed(i);
        Ok(retired)
    }

    /// Stop the process of slot `i` once the driver retired it ([`Driver::retire_worker`]):
    /// the last slot's process takes its place here too; its spill directories are removed.
    pub fn stop_removed(&self, i: usize) {
        let gone = {
            let mut children = lock(&self.children);
            if i < children.len() {
                children.swap_remove(i)
            } else {
                None
            }
        };
        if let Some(mut child) = gone {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Its spill directories, whatever their generation (worker-i, worker-i.g). No live
        // process has one: a process started for a slot moves only out of the last slot,
        // which is then gone for good.
        if let Ok(entries) = std::fs::read_dir(&self.spill_root) {
            let name = format!("worker-{i}");
            for e in entries.flatten() {
                let file = e.file_name();
                let file = file.to_string_lossy();
                let is_its = file == name.as_str()
                    || file
                        .strip_prefix(&format!("{name}."))
                        .is_some_and(|g| g.parse::<u64>().is_ok());
                if is_its {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }

    /// Stop every worker (kill, then reap). Safe to call more than once.
    pub fn stop(&mut self) {
        self.driver.stop_replacing();
        let mut children = lock(&self.children);
        for c in children.iter_mut().flatten() {
            let _ = c.kill();
        }
        for c in children.iter_mut().flatten() {
            let _ = c.wait();
        }
        children.clear();
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Workers started by another runtime (Ray actors, see the Python package): the driver dials
/// their addresses, and a lost one is replaced by `replacer` (which starts a new worker in
/// the same slot and returns its address). `scratch` is a directory of the driver's for
/// files every worker must read (tables from Arrow data), shared with the workers' hosts.
pub struct HostedCluster {
    /// The driver connected to the workers.
    pub driver: Arc<Driver>,
    /// The directory for files every worker must read (shared with the workers' hosts).
    pub scratch: PathBuf,
    _tempdir: Option<tempfile::TempDir>,
    /// Stand-ins started for this driver (a static cluster's, see [`Self::connect_static`]):
    /// told to exit when it closes.
    stand_ins: Arc<Mutex<Vec<String>>>,
    creds: crate::transport::Credentials,
}

impl HostedCluster {
    /// Connect a driver to the workers at `addrs` and check their health; a lost worker is
    /// replaced by `replacer` when given. Without `scratch`, a temporary directory.
    pub async fn connect(
        addrs: &[String],
        creds: &crate::transport::Credentials,
        cfg: DriverConfig,
        scratch: Option<PathBuf>,
        replacer: Option<crate::driver::Replacer>,
    ) -> Result<Self> {
        let (tempdir, scratch) = match scratch {
            Some(d) => (None, d),
            None => {
                let t = owned_tempdir("flightshuffle-")?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        let driver = Driver::connect(addrs, creds, cfg)?;
        driver.check_health().await?;
        driver.check_storage().await?;
        if let Some(r) = replacer {
            driver.set_replacer(r);
        }
        tracing::info!(workers = addrs.len(), "hosted cluster connected");
        Ok(HostedCluster {
            driver,
            scratch,
            _tempdir: tempdir,
            stand_ins: Arc::new(Mutex::new(Vec::new())),
            creds: creds.clone(),
        })
    }
}

impl HostedCluster {
    /// Connect a driver to workers a supervisor runs at fixed addresses (systemd, Kubernetes
    /// pods, a shell loop): a static cluster, with nothing that can start a worker. A lost
    /// worker's slot is given to the next new process that answers at the same address within
    /// `restart_wait` (what its supervisor restarts), and lineage recovery goes on there as on
    /// a local cluster; the lost process itself, should it answer again (it was paused or cut
    /// off), is told to exit first, so that its blocks are never mixed with the recomputed
    /// ones. When nothing answers in time and `take_over` is set, a surviving worker starts a
    /// stand-in process beside itself for the lost slot (see `worker::stand_in`; lineage
    /// recovery recomputes what was lost there); otherwise, or when no survivor can, the job
    /// fails with [`Error::WorkerLost`] naming it.
    pub async fn connect_static(
        addrs: &[String],
        creds: &crate::transport::Credentials,
        cfg: DriverConfig,
        scratch: Option<PathBuf>,
        restart_wait: Duration,
        take_over: bool,
    ) -> Result<Self> {
        let cluster = Self::connect(addrs, creds, cfg, scratch, None).await?;
        let driver = &cluster.driver;
        let mut seen = std::collections::HashMap::new();
        for i in 0..driver.num_workers() {
            let w = driver.worker(i)?;
            let health = w.health(driver.config().health_timeout).await?;
            seen.insert(w.addr.clone(), health.instance);
        }
        let restarts = Restarts {
            driver: Arc::downgrade(driver),
            creds: creds.clone(),
            seen: Arc::new(Mutex::new(seen)),
            wait: restart_wait,
            take_over,
            stand_ins: cluster.stand_ins.clone(),
            handle: tokio::runtime::Handle::current(),
        };
        driver.set_replacer(Arc::new(move |i| restarts.wait_for(i)));
        Ok(cluster)
    }
}

impl Drop for HostedCluster {
    fn drop(&mut self) {
        // The replacer may hold the runtime that hosts the workers (it is dropped here).
        self.driver.stop_replacing();
        // The stand-ins started for this driver: nobody else knows of them.
        let stand_ins = std::mem::take(&mut *lock(&self.stand_ins));
        if stand_ins.is_empty() {
            return;
        }
        let creds = self.creds.clone();
        // On a thread of its own (a runtime may be running here), all at once, 2 s at most.
        let stop = std::thread::Builder::new()
            .name("flightshuffle-stand-ins".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async {
                    let wait = Duration::from_secs(2);
                    let told = stand_ins.iter().enumerate().map(|(i, addr)| {
                        let creds = creds.clone();
                        async move {
                            let c =
                                crate::transport::client::WorkerClient::new(i, addr, &creds, wait)?;
                            let exit = c.action(crate::transport::actions::EXIT, Vec::new(), wait);
                            tokio::time::timeout(wait, exit)
                                .await
                                .map_err(|_| Error::Cluster("timed out".into()))?
                        }
                    });
                    for (addr, r) in stand_ins.iter().zip(futures::future::join_all(told).await) {
                        tracing::info!(%addr, told = r.is_ok(), "stand-in told to exit");
                    }
                });
            });
        if let Ok(stop) = stop {
            let _ = stop.join();
        }
    }
}
