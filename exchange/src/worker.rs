//! The worker: a block store, a Flight server and the tasks it runs, as one unit. Its state
//! ([`WorkerState`]) is built from a [`WorkerConfig`]; its Flight service ([`flight_service`]) is
//! a tonic service a host adds to a server of its own; [`main_with_args`] is the one process
//! entry that every worker program calls (the `flightshuffle-worker` and
//! `flightshuffle-sql-worker` binaries, `python -m flightshuffle.worker`, the `tpch` and
//! `flightshuffle-slt` runners): it parses the command line ([`WorkerArgs`]), serves, and
//! prints one ready line with the bound address.

mod args;
mod config;
mod durable;
mod fence;
pub mod probe;
mod service;
mod stand_in;
mod state;

use crate::error::{Error, Result};
use crate::source::SourceRegistry;
use crate::transport::{bearer, CONNECTION_WINDOW, MAX_MESSAGE_BYTES, STREAM_WINDOW, TOKEN_HEADER};
pub use args::WorkerArgs;
use arrow_flight::flight_service_server::FlightServiceServer;
pub use config::WorkerConfig;
pub use service::WorkerService;
pub use state::{WorkerState, READY_LINE, TOKEN_ENV};
use std::net::SocketAddr;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tonic::service::interceptor::InterceptedService;

/// The sources and reducers every worker knows: the lineitem generator and the checksum
/// reducer (engines add theirs).
pub fn builtin_sources() -> SourceRegistry {
    let mut r = SourceRegistry::default();
    r.register(
        crate::synthetic::LINEITEM_SOURCE,
        Arc::new(crate::synthetic::LineitemSource),
    );
    r.register_reducer(
        crate::source::CHECKSUM_REDUCER,
        Arc::new(crate::source::ChecksumReducer),
    );
    r
}

/// A worker's Flight service over `state`, every call checked for the cluster `token` (in
/// constant time) and counted: what a host adds to its own tonic server, beside services of
/// its own.
pub fn flight_service(state: Arc<WorkerState>, token: &str) -> WorkerFlightService {
    let flight = FlightServiceServer::new(WorkerService {
        state: state.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    InterceptedService::new(
        flight,
        TokenCheck {
            expected: bearer(token),
            state,
        },
    )
}

/// The type of [`flight_service`].
pub type WorkerFlightService = InterceptedService<FlightServiceServer<WorkerService>, TokenCheck>;

/// Lets a call through when it carries the cluster token; counts the calls.
#[derive(Clone)]
pub struct TokenCheck {
    expected: String,
    state: Arc<WorkerState>,
}

impl std::fmt::Debug for TokenCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCheck { .. }") // never the token
    }
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        self.state
            .rpcs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match req
            .metadata()
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
        {
            // In constant time: how long a wrong token takes to refuse tells nothing of it.
            Some(v) if bool::from(v.as_bytes().ct_eq(self.expected.as_bytes())) => Ok(req),
            Some(_) => Err(tonic::Status::unauthenticated("wrong cluster token")),
            None => Err(tonic::Status::unauthenticated("missing cluster token")),
        }
    }
}

/// Serve Flight on `args.listen` until the process ends; `ready` gets the bound address.
pub async fn serve(
    args: WorkerArgs,
    token: String,
    sources: SourceRegistry,
    ready: impl FnOnce(SocketAddr, &Arc<WorkerState>),
) -> Result<()> {
    if token.is_empty() {
        return Err(Error::invalid(format!(
            "the worker needs a token: in ${TOKEN_ENV}, on stdin with --token-stdin, or in a file \
             with --token-file"
        )));
    }
    let tls = args.tls()?;
    if tls.is_none() && !args.listen.ip().is_loopback() && !args.insecure {
        return Err(Error::invalid(format!(
            "refusing to listen on {} without TLS: the token and every block would cross the \
             network in clear (pass --tls-cert, --tls-key and --tls-ca, or --insecure)",
            args.listen
        )));
    }
    let creds = crate::transport::Credentials {
        token: token.clone(),
        tls: tls.as_ref().map(|t| t.client()),
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::Cluster(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Cluster(format!("no local address: {e}")))?;
    let advertised = match &args.advertise {
        // `HOST:0`: this host at the port bound (how a stand-in is started).
        Some(a) if a.ends_with(":0") => format!("{}:{}", &a[..a.len() - 2], addr.port()),
        Some(a) => a.clone(),
        None if addr.ip().is_unspecified() => {
            return Err(Error::invalid(format!(
                "listening on {addr}, an address nobody can dial: pass --advertise HOST:PORT, \
                 the address the driver and the other workers reach this worker at"
            )))
        }
        None => addr.to_string(),
    };
    let state = Arc::new(WorkerState::new(
        &args.config()?,
        &creds,
        sources,
        advertised,
    )?);
    tokio::spawn(crate::allocator::trim_when_idle(state.admission.clone()));
    let service = flight_service(state.clone(), &token);
    ready(addr, &state);
    let incoming = crate::transport::listen::capped(listener, args.max_connections);
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = &tls {
        server = server
            .tls_config(tls.config())
            .map_err(|e| Error::invalid(format!("bad TLS certificate or key: {e}")))?;
    }
    server
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(Some(crate::transport::MAX_STREAMS_PER_CONNECTION))
        .http2_keepalive_interval(Some(crate::transport::KEEPALIVE))
        .http2_keepalive_timeout(Some(crate::transport::KEEPALIVE_TIMEOUT))
        .add_service(service)
        .serve_with_incoming(incoming)
        .await
        .map_err(|e| Error::Cluster(format!("worker server failed: {e}")))
}

/// Log to stderr, filtered by `$FLIGHTSHUFFLE_LOG` (e.g. `info`, `exchange=debug`); default
/// `warn`. Does nothing when a subscriber is already set.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FLIGHTSHUFFLE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// Entry point shared by the worker binary and the Python module: parse `argv`, start a
/// runtime, serve, and print the ready line. Returns when the server stops.
pub fn main_with_args(argv: Vec<String>, sources: SourceRegistry) -> Result<()> {
    use clap::Parser;
    let args = match WorkerArgs::try_parse_from(&argv) {
        Ok(args) => args,
        // `--help`: the help on stdout, and a clean exit.
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => {
            print!("{e}");
            return Ok(());
        }
        Err(e) => return Err(Error::invalid(e.to_string())),
    };
    crate::allocator::limit_malloc_arenas();
    init_logging();
    let token = args.token()?;
    stand_in::remember(&argv, &args, &token);
    // Out of the environment before any thread starts: user code running in this process
    // (Python map tasks) and every process it starts would otherwise see the token.
    std::env::remove_var(TOKEN_ENV);
    if args.exit_with_stdin {
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
            tracing::info!("standard input closed: the driver is gone, exiting");
            // Nobody will read these blocks again; a driver killed without cleaning up leaves
            // no spill files behind (its own directory is swept by the next local cluster).
            // Only what the store wrote goes: `--spill-dir` may name a directory with other
            // files in it.
            fence::exit_now(0);
        });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("flightshuffle-worker")
        .build()
        .map_err(|e| Error::Cluster(format!("cannot start runtime: {e}")))?;
    let id = args.id.clone();
    rt.block_on(serve(args, token, sources, |addr, state| {
        use std::io::Write;
        fence::own_process(state.store.clone());
        let mut out = std::io::stdout();
        let _ = writeln!(out, "{READY_LINE} {addr}");
        let _ = out.flush();
        tracing::info!(worker = %id, %addr, "worker listening");
    }))
}
