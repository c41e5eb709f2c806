//! Stand-ins: a worker of a static cluster starts, when the driver asks, a second worker
//! process on its own host to take over the slot of a worker that was lost and that nothing
//! restarted (see `HostedCluster::connect_static`). A process per slot keeps what the
//! worker holds per shuffle (its registration, its seal, the blocks it serves a partition
//! from) apart for each slot, as a replacement would.
//!
//! The stand-in runs this process's own command line (same program and flags: budget,
//! compression, TLS files) with its own port, spill directory and id. The token goes on its
//! standard input, which this process holds open: a stand-in exits with the worker that
//! started it, and when the driver that asked for it closes (it tells it to exit). It has
//! the same memory budget as its parent, so their host commits twice that.

use super::args::WorkerArgs;
use super::state::READY_LINE;
use crate::error::{Error, Result};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

/// How long a stand-in may take to print its ready line.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Flags this module sets itself for a stand-in (each takes a value).
const OWN_VALUED: &[&str] = &[
    "--listen",
    "--advertise",
    "--spill-dir",
    "--id",
    "--token-file",
];
/// Flags without a value this module sets itself.
const OWN_SWITCHES: &[&str] = &["--token-stdin", "--exit-with-stdin"];

/// How this process starts a stand-in; set once, by [`remember`].
static LAUNCH: OnceLock<Launch> = OnceLock::new();

struct Launch {
    /// The program and the arguments before the worker's flags (`python -m
    /// flightshuffle.worker`, `flightshuffle worker`, or the worker binary alone).
    program: OsString,
    prefix: Vec<OsString>,
    /// The worker's flags, without those in `OWN_VALUED` / `OWN_SWITCHES`.
    flags: Vec<String>,
    id: String,
    listen_ip: std::net::IpAddr,
    /// The host part of `--advertise`, if given.
    advertise_host: Option<String>,
    spill_dir: PathBuf,
    token: String,
    started: AtomicU64,
}

impl std::fmt::Debug for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("program", &self.program)
            .field("flags", &self.flags)
            .finish_non_exhaustive() // never the token
    }
}

/// Remember how this worker was started (`argv`: its own flags after a program name, as
/// `main_with_args` got them), to start stand-ins later. Does nothing when this process's
/// command line does not end with those flags (a worker embedded in another program).
pub fn remember(argv: &[String], args: &WorkerArgs, token: &str) {
    let os: Vec<OsString> = std::env::args_os().collect();
    let flags = argv.get(1..).unwrap_or_default();
    let Some(cut) = os.len().checked_sub(flags.len()).filter(|&c| c >= 1) else {
        return;
    };
    if os[cut..]
        .iter()
        .zip(flags)
        .any(|(a, b)| a.as_os_str() != b.as_str())
    {
        return;
    }
    let advertise_host = args
        .advertise
        .as_deref()
        .and_then(|a| a.rsplit_once(':'))
        .map(|(host, _)| host.to_string());
    let _ = LAUNCH.set(Launch {
        program: os[0].clone(),
        prefix: os[1..cut].to_vec(),
        flags: without_own_flags(flags),
        id: args.id.clone(),
        listen_ip: args.listen.ip(),
        advertise_host,
        spill_dir: args.spill_dir.clone(),
        token: token.to_string(),
        started: AtomicU64::new(0),
    });
}

/// `flags` without the flags a stand-in gets its own values for (`--flag value` and
/// `--flag=value` forms).
fn without_own_flags(flags: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = flags.iter();
    while let Some(f) = it.next() {
        let name = f.split_once('=').map_or(f.as_str(), |(n, _)| n);
        if OWN_VALUED.contains(&name) {
            if !f.contains('=') {
                it.next(); // its value
            }
        } else if !OWN_SWITCHES.contains(&name) {
            out.push(f.clone());
        }
    }
    out
}

/// Start a stand-in on this host; returns the address the driver and the other workers
/// reach it at, once it listens.
pub async fn start() -> Result<String> {
    let launch = LAUNCH.get().ok_or_else(|| {
        Error::Cluster(
            "this worker cannot start a stand-in: it was not started from a command line \
             (flightshuffle worker) it can run again"
                .into(),
        )
    })?;
    let k = launch.started.fetch_add(1, Ordering::SeqCst) + 1;
    let spill = launch.spill_dir.join(format!("stand-in-{k}"));
    let mut cmd = tokio::process::Command::new(&launch.program);
    cmd.args(&launch.prefix)
        .args(&launch.flags)
        .arg("--listen")
        .arg(std::net::SocketAddr::new(launch.listen_ip, 0).to_string())
        .arg("--spill-dir")
        .arg(&spill)
        .arg("--id")
        .arg(format!("{}-stand-in-{k}", launch.id))
        .arg("--token-stdin")
        .arg("--exit-with-stdin");
    if let Some(host) = &launch.advertise_host {
        // Port 0: the port it binds (see `serve`).
        cmd.arg("--advertise").arg(format!("{host}:0"));
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::Cluster(format!("cannot start a stand-in worker: {e}")))?;
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(Error::Cluster("a stand-in worker has no pipes".into()));
    };
    let token_line = format!("{}\n", launch.token);
    stdin
        .write_all(token_line.as_bytes())
        .await
        .map_err(|e| Error::Cluster(format!("cannot give a stand-in worker its token: {e}")))?;
    stdin
        .flush()
        .await
        .map_err(|e| Error::Cluster(format!("cannot give a stand-in worker its token: {e}")))?;
    child.stdin = Some(stdin); // held open: the stand-in exits when this process does
                               // Read as bytes: a line that is not UTF-8 (a task's print) must not stop the reading.
    let mut out = tokio::io::BufReader::new(stdout);
    let ready = tokio::time::timeout(START_TIMEOUT, async {
        let mut line = Vec::new();
        loop {
            line.clear();
            match out.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
            let text = String::from_utf8_lossy(&line);
            if let Some(addr) = text.strip_prefix(READY_LINE) {
                return Some(addr.trim().to_string());
            }
        }
    })
    .await;
    let bound = match ready {
        Ok(Some(addr)) => addr,
        other => {
            let _ = child.kill().await;
            let why = match other {
                Err(_) => format!("it did not listen within {START_TIMEOUT:?}"),
                _ => "it exited before listening (its log is this worker's stderr)".into(),
            };
            return Err(Error::Cluster(format!(
                "cannot start a stand-in worker: {why}"
            )));
        }
    };
    // Whatever it prints from here on is read and dropped (a full pipe would stall it).
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut out, &mut tokio::io::sink()).await;
    });
    let port = bound
        .rsplit_once(':')
        .map(|(_, p)| p.to_string())
        .ok_or_else(|| Error::Cluster(format!("a stand-in worker listens at {bound:?}")))?;
    let addr = match &launch.advertise_host {
        Some(host) => format!("{host}:{port}"),
        None => bound,
    };
    // Held open for as long as the stand-in runs (closing it stops the stand-in), and the
    // stand-in reaped as soon as it exits (told to by its driver).
    let stdin = child.stdin.take();
    tokio::spawn(async move {
        let _open = stdin;
        let _ = child.wait().await;
    });
    tracing::warn!(%addr, "started a stand-in worker on this host for a lost slot");
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::without_own_flags;

    #[test]
    fn a_stand_in_gets_its_own_listen_spill_id_and_token_flags() {
        let flags: Vec<String> = [
            "--listen",
            "10.0.0.1:7000",
            "--advertise=h1:7000",
            "--memory-budget",
            "1000",
            "--token-file",
            "/t",
            "--exit-with-stdin",
            "--spill-dir",
            "/s",
            "--tls-cert",
            "c.pem",
            "--id",
            "w",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            without_own_flags(&flags),
            ["--memory-budget", "1000", "--tls-cert", "c.pem"]
        );
    }
}
