//! The worker: a block store, a Flight server and the tasks it runs. Hosted by the
//! `flightshuffle-worker` binary and by `python -m flightshuffle.worker`; both parse the same
//! command line ([`WorkerArgs`]) and print one ready line with the bound address.

mod args;
pub mod probe;
mod service;
mod state;

use crate::admission::Admission;
use crate::block::Compression;
use crate::error::{Error, Result};
use crate::source::SourceRegistry;
use crate::store::{BlockStore, StoreConfig};
use crate::task::MapConfig;
use crate::transport::peers::PeerReader;
use crate::transport::{bearer, CONNECTION_WINDOW, MAX_MESSAGE_BYTES, STREAM_WINDOW, TOKEN_HEADER};
pub use args::WorkerArgs;
use arrow_flight::flight_service_server::FlightServiceServer;
use service::WorkerService;
pub use state::{WorkerState, READY_LINE, TOKEN_ENV};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use subtle::ConstantTimeEq;

/// The sources and reducers every worker knows: the lineitem generator and the checksum
/// reducer (engines add theirs).
pub fn builtin_sources() -> SourceRegistry {
    let mut r = SourceRegistry::default();
    r.register(
        crate::gen::LINEITEM_SOURCE,
        Arc::new(crate::gen::LineitemSource),
    );
    r.register_reducer(
        crate::source::CHECKSUM_REDUCER,
        Arc::new(crate::source::ChecksumReducer),
    );
    r
}

/// Build the worker state from its arguments, the token and the address it advertises.
pub fn build_state(
    args: &WorkerArgs,
    creds: &crate::transport::Credentials,
    sources: SourceRegistry,
    addr: String,
) -> Result<WorkerState> {
    let compression: Compression = args.compression.parse()?;
    let store = BlockStore::new(StoreConfig {
        memory_budget: args.memory_budget,
        spill_dir: args.spill_dir.clone(),
        segment_bytes: args.segment_bytes.max(1),
    })?;
    let (admission, store) = if !crate::admission::enabled() {
        (Admission::new(u64::MAX), store)
    } else {
        // Map buffers are at least 4 MiB whatever the budget: under four tasks' grants (a
        // budget set tiny to make the store spill) the tasks would run one at a time.
        let grant = MapConfig::for_budget(args.memory_budget).task_grant();
        let a = Admission::new(args.memory_budget.max(4 * grant));
        (a.clone(), store.sharing(a))
    };
    let store = Arc::new(store);
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let reader = Arc::new(PeerReader::new(
        creds,
        timeout,
        Some((addr.clone(), store.clone())),
    ));
    Ok(WorkerState {
        id: args.id.clone(),
        store,
        addr,
        reader,
        sources,
        map_cfg: MapConfig {
            compression,
            ..MapConfig::for_budget(args.memory_budget)
        },
        admission,
        read_timeout: Duration::from_secs(args.timeout_secs.max(1)),
        rpcs: std::sync::atomic::AtomicU64::new(0),
        tasks: Mutex::new(HashMap::new()),
        fold_states: Default::default(),
        fold_rounds: Default::default(),
        folding: Default::default(),
        lose_commit_replies: args.fault_lose_commit_replies.into(),
    })
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
            "the worker needs a token: in ${TOKEN_ENV}, or on stdin with --token-stdin"
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
    let state = Arc::new(build_state(&args, &creds, sources, addr.to_string())?);
    tokio::spawn(crate::allocator::trim_when_idle(state.admission.clone()));
    let expected = bearer(&token);
    let counted = state.clone();
    let check = move |req: tonic::Request<()>| -> Result<tonic::Request<()>, tonic::Status> {
        counted
            .rpcs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match req
            .metadata()
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
        {
            // In constant time: how long a wrong token takes to refuse tells nothing of it.
            Some(v) if bool::from(v.as_bytes().ct_eq(expected.as_bytes())) => Ok(req),
            Some(_) => Err(tonic::Status::unauthenticated("wrong cluster token")),
            None => Err(tonic::Status::unauthenticated("missing cluster token")),
        }
    };
    let flight = FlightServiceServer::new(WorkerService {
        state: state.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let service = tonic::service::interceptor::InterceptedService::new(flight, check);
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
    let args = WorkerArgs::try_parse_from(argv).map_err(|e| Error::invalid(e.to_string()))?;
    crate::allocator::limit_malloc_arenas();
    init_logging();
    let token = if args.token_stdin {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| Error::Cluster(format!("cannot read the token from stdin: {e}")))?;
        line.trim().to_string()
    } else {
        std::env::var(TOKEN_ENV).unwrap_or_default()
    };
    // Out of the environment before any thread starts: user code running in this process
    // (Python map tasks) and every process it starts would otherwise see the token.
    std::env::remove_var(TOKEN_ENV);
    let store_files = Arc::new(std::sync::OnceLock::<Arc<BlockStore>>::new());
    if args.exit_with_stdin {
        let store_files = store_files.clone();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
            tracing::info!("standard input closed: the driver is gone, exiting");
            // Nobody will read these blocks again; a driver killed without cleaning up leaves
            // no spill files behind (its own directory is swept by the next local cluster).
            // Only what the store wrote goes: `--spill-dir` may name a directory with other
            // files in it.
            if let Some(store) = store_files.get() {
                store.remove_files();
            }
            std::process::exit(0);
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
        let _ = store_files.set(state.store.clone());
        let mut out = std::io::stdout();
        let _ = writeln!(out, "{READY_LINE} {addr}");
        let _ = out.flush();
        tracing::info!(worker = %id, %addr, "worker listening");
    }))
}
