//! A worker process's command line: where it listens, its budget and spill directory, TLS,
//! how it gets the token, and test-only fault injection.

use crate::error::{Error, Result};
use crate::store::DEFAULT_SEGMENT_BYTES;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Command line of a worker process.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "flightshuffle-worker",
    about = "A flightshuffle worker process"
)]
pub struct WorkerArgs {
    /// Worker name used in logs and errors.
    #[arg(long, default_value = "worker")]
    pub id: String,
    /// Address to listen on (port 0 = ephemeral).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The address the driver and the other workers reach this worker at, exactly as the
    /// driver is given it (default: the listen address; needed when listening on 0.0.0.0).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Block store memory budget in bytes; blocks beyond it spill to disk.
    #[arg(long, default_value_t = 2 << 30)]
    pub memory_budget: u64,
    /// Directory for spill segment files.
    #[arg(long)]
    pub spill_dir: PathBuf,
    /// Size at which a spill segment file is closed.
    #[arg(long, default_value_t = DEFAULT_SEGMENT_BYTES)]
    pub segment_bytes: u64,
    /// Bytes of spill files past which the closed segments of shuffles registered with a
    /// store (the cluster's `storage=`) move to it and are read back by range.
    #[arg(long)]
    pub disk_budget: Option<u64>,
    /// IPC compression of blocks: none, lz4, zstd, or auto (none when listening on loopback,
    /// where LZ4 encodes slower than the wire carries bytes; LZ4 on any other address).
    #[arg(long, default_value = "auto")]
    pub compression: String,
    /// Seconds a call or a wait for new blocks may take.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// Exit when standard input closes (the driver that started this worker is gone).
    #[arg(long)]
    pub exit_with_stdin: bool,
    /// Read the cluster token from the first line of standard input (how the local cluster
    /// passes it: not in the environment, where user code on the worker would see it).
    /// Without it, the token is read from `$FLIGHTSHUFFLE_TOKEN`.
    #[arg(long, conflicts_with = "token_file")]
    pub token_stdin: bool,
    /// Read the cluster token from the first line of this file, which only its owner may
    /// read (mode 0600 or stricter).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Serve TLS with this PEM certificate (chain); needs `--tls-key` and `--tls-ca`.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The PEM key of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM of the CA that signed every worker's certificate: peers are verified with it.
    #[arg(long, requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
    /// Mutual TLS: clients must show a certificate signed by `--tls-ca` (this worker shows
    /// its own to its peers).
    #[arg(long, requires = "tls_cert")]
    pub tls_client_auth: bool,
    /// Allow plaintext on an address other than loopback (anyone on the network could read
    /// the token and blocks).
    #[arg(long)]
    pub insecure: bool,
    /// Connections open at once; one more is closed at once (each peer, driver and client
    /// keeps one multiplexed connection).
    #[arg(long, default_value_t = crate::transport::listen::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Fault injection for tests: the replies of this many commits are lost after the commit
    /// took effect (the caller sees `Unavailable`), as a dropped connection would.
    #[arg(long, default_value_t = 0, hide = true)]
    pub fault_lose_commit_replies: u32,
}

impl WorkerArgs {
    /// The worker these arguments describe.
    pub fn config(&self) -> Result<super::config::WorkerConfig> {
        Ok(super::config::WorkerConfig {
            id: self.id.clone(),
            memory_budget: self.memory_budget,
            spill_dir: self.spill_dir.clone(),
            segment_bytes: self.segment_bytes.max(1),
            disk_budget: self.disk_budget,
            // `auto`: LZ4 pays off between hosts, not over loopback (see `cluster`).
            compression: match self.compression.to_ascii_lowercase().as_str() {
                "auto" if self.listen.ip().is_loopback() => "none".parse()?,
                "auto" => "lz4".parse()?,
                other => other.parse()?,
            },
            timeout: std::time::Duration::from_secs(self.timeout_secs.max(1)),
            lose_commit_replies: self.fault_lose_commit_replies,
        })
    }

    /// The cluster token: from the first line of standard input (`--token-stdin`), of
    /// `--token-file`, or else from `$FLIGHTSHUFFLE_TOKEN`.
    pub fn token(&self) -> Result<String> {
        let first_line = |text: &str| text.lines().next().unwrap_or("").trim().to_string();
        if self.token_stdin {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| Error::Cluster(format!("cannot read the token from stdin: {e}")))?;
            return Ok(first_line(&line));
        }
        if let Some(path) = &self.token_file {
            let io = |source| Error::Io {
                path: path.clone(),
                source,
            };
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(path).map_err(io)?.permissions().mode();
                if mode & 0o077 != 0 {
                    return Err(Error::invalid(format!(
                        "the token file {} can be read by other users (mode {:o}): make it \
                         private with chmod 600",
                        path.display(),
                        mode & 0o777
                    )));
                }
            }
            let token = first_line(&std::fs::read_to_string(path).map_err(io)?);
            if token.is_empty() {
                return Err(Error::invalid(format!(
                    "the token file {} is empty",
                    path.display()
                )));
            }
            return Ok(token);
        }
        Ok(std::env::var(super::TOKEN_ENV).unwrap_or_default())
    }

    /// The TLS this worker serves, if any.
    pub fn tls(&self) -> Result<Option<crate::transport::tls::ServerTls>> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Ok(Some(
                crate::transport::tls::ServerTls::from_files(cert, key, ca, self.tls_client_auth)?,
            )),
            (None, None, None) => Ok(None),
            _ => Err(Error::invalid(
                "TLS needs --tls-cert, --tls-key and --tls-ca together",
            )),
        }
    }
}
