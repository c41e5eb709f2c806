//! `PollFlightInfo`: online aggregation for Flight SQL clients that execute incrementally
//! (ADBC's `adbc.statement.exec.incremental`). A polled query that online aggregation runs
//! (see the Python package's `Cluster.online`) streams its rounds: each poll answers with one
//! endpoint per round made so far (a client reads the new ones), the fraction of the input
//! read as `progress`, and a descriptor to poll again until the last, exact round. A round's
//! rows are its estimates: the keys, each aggregate's estimate with its interval bounds, and
//! the round's `__round` and `__fraction`. Any other query runs whole and the first poll
//! answers with its complete result. `arrow-flight`'s Flight SQL server leaves
//! `PollFlightInfo` unimplemented, so the endpoint is served through [`WithPoll`], which
//! hands every other call to it.

use super::kept::{keep, Kept, Polled, Rounds};
use super::FlightSqlEndpoint;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::sql::{Any, CommandPreparedStatementQuery, CommandStatementQuery};
use arrow_flight::sql::{ProstMessageExt, TicketStatementQuery};
use arrow_flight::{
    Action, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, PollInfo, SchemaResult, Ticket,
};
use prost::Message;
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status, Streaming};

/// The command of the descriptors handed out to poll again: this prefix, a handle, and the
/// rounds the answer listed.
const POLL_AGAIN: &str = "flightshuffle-poll:";
/// How long a poll waits for a new round before answering with what there is.
const POLL_WAIT: Duration = Duration::from_secs(5);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FlightSqlEndpoint {
    /// This endpoint as a Flight service that also answers `PollFlightInfo`.
    pub(super) fn with_poll(self) -> WithPoll {
        WithPoll(self)
    }

    async fn poll(&self, descriptor: FlightDescriptor) -> Result<PollInfo, Status> {
        if let Some(again) = std::str::from_utf8(&descriptor.cmd)
            .ok()
            .and_then(|c| c.strip_prefix(POLL_AGAIN))
        {
            let (id, seen) = again
                .rsplit_once(':')
                .and_then(|(id, n)| Some((id.to_string(), n.parse::<usize>().ok()?)))
                .ok_or_else(|| Status::invalid_argument("a malformed poll descriptor"))?;
            return self.answer(&id, seen).await;
        }
        let any = Any::decode(descriptor.cmd.clone())
            .map_err(|e| Status::invalid_argument(format!("not a Flight SQL command: {e}")))?;
        let (sql, params) = if let Ok(Some(q)) = any.unpack::<CommandStatementQuery>() {
            (q.query, None)
        } else if let Ok(Some(q)) = any.unpack::<CommandPreparedStatementQuery>() {
            let h = String::from_utf8_lossy(&q.prepared_statement_handle).to_string();
            let prepared = lock(&self.prepared);
            let p = prepared.get(&h).ok_or_else(|| super::no_statement(&h))?;
            (p.sql.clone(), p.params.clone())
        } else {
            return Err(Status::unimplemented(format!(
                "PollFlightInfo runs queries, not {}",
                any.type_url
            )));
        };
        let rounds = match (&self.online, &params) {
            (Some(runner), None) => {
                let (runner, text) = (runner.clone(), sql.clone());
                tokio::task::spawn_blocking(move || runner(&text))
                    .await
                    .map_err(|e| Status::internal(format!("online aggregation failed: {e}")))?
                    .map_err(Status::invalid_argument)?
            }
            _ => None,
        };
        let Some(rounds) = rounds else {
            // Not online: the whole result, complete at the first poll.
            let info = self.run(&sql, params, descriptor).await?;
            return Ok(PollInfo {
                info: Some(info),
                flight_descriptor: None,
                progress: Some(1.0),
                expiration_time: None,
            });
        };
        let id = super::handle();
        let (changed, _) = tokio::sync::watch::channel(0);
        {
            let mut polls = lock(&self.polls);
            polls.retain(|_, p| p.at.elapsed() < super::RESULT_TTL);
            polls.insert(
                id.clone(),
                Polled {
                    at: Instant::now(),
                    rounds: Vec::new(),
                    schema: None,
                    done: false,
                    error: None,
                    changed,
                },
            );
        }
        let (polls, results, key) = (self.polls.clone(), self.results.clone(), id.clone());
        tokio::task::spawn_blocking(move || collect(rounds, &polls, &results, &key));
        self.answer(&id, 0).await
    }

    /// The poll answer of aggregation `id` once it has more than `seen` rounds, has ended, or
    /// [`POLL_WAIT`] passed.
    async fn answer(&self, id: &str, seen: usize) -> Result<PollInfo, Status> {
        let gone = || Status::not_found(format!("no online query {id:?}: ended, or expired"));
        let mut rx = lock(&self.polls)
            .get(id)
            .ok_or_else(gone)?
            .changed
            .subscribe();
        let deadline = tokio::time::Instant::now() + POLL_WAIT;
        loop {
            {
                let polls = lock(&self.polls);
                let p = polls.get(id).ok_or_else(gone)?;
                if p.rounds.len() > seen || p.done || p.error.is_some() {
                    break;
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => continue,
                _ => break,
            }
        }
        let mut polls = lock(&self.polls);
        let p = polls.get(id).ok_or_else(gone)?;
        if let Some(e) = &p.error {
            let e = e.clone();
            polls.remove(id);
            return Err(Status::invalid_argument(e));
        }
        let mut info = FlightInfo::new().with_ordered(true);
        if let Some(schema) = &p.schema {
            info = info
                .try_with_schema(schema)
                .map_err(|e| Status::internal(e.to_string()))?;
        }
        for (_, kept, _) in &p.rounds {
            let ticket = TicketStatementQuery {
                statement_handle: format!("{kept}/0").into_bytes().into(),
            };
            info = info.with_endpoint(
                FlightEndpoint::new().with_ticket(Ticket::new(ticket.as_any().encode_to_vec())),
            );
        }
        let rows: usize = p.rounds.iter().map(|r| r.2).sum();
        info = info.with_total_records(rows as i64);
        let progress = match p.done {
            true => 1.0,
            false => p.rounds.last().map_or(0.0, |r| r.0),
        };
        let again = (!p.done)
            .then(|| FlightDescriptor::new_cmd(format!("{POLL_AGAIN}{id}:{}", p.rounds.len())));
        if p.done {
            polls.remove(id);
        }
        Ok(PollInfo {
            info: Some(info),
            flight_descriptor: again,
            progress: Some(progress),
            expiration_time: None,
        })
    }
}

/// Pull `rounds` (on a blocking thread), keeping each round's estimates as a result to read
/// and listing it in aggregation `id`; stops early once nobody polls it any more.
fn collect(
    rounds: Rounds,
    polls: &super::kept::Polls,
    results: &super::kept::KeptResults,
    id: &str,
) {
    for round in rounds {
        let mut all = lock(polls);
        let Some(p) = all.get_mut(id) else {
            return; // expired: the iterator is dropped, which ends the aggregation
        };
        match round {
            Ok((fraction, batch)) => {
                let kept = super::handle();
                let rows = batch.num_rows();
                p.schema.get_or_insert_with(|| batch.schema());
                keep(
                    results,
                    kept.clone(),
                    Kept {
                        at: Instant::now(),
                        schema: batch.schema(),
                        chunks: vec![Some(vec![batch])],
                    },
                );
                p.rounds.push((fraction, kept, rows));
            }
            Err(e) => {
                p.error = Some(e);
                p.changed.send_modify(|n| *n += 1);
                return;
            }
        }
        p.changed.send_modify(|n| *n += 1);
    }
    if let Some(p) = lock(polls).get_mut(id) {
        p.done = true;
        p.changed.send_modify(|n| *n += 1);
    }
}

/// The endpoint as a Flight service: `PollFlightInfo` here, every other call as the Flight
/// SQL server answers it.
pub struct WithPoll(FlightSqlEndpoint);

type Inner = FlightSqlEndpoint;

#[tonic::async_trait]
impl FlightService for WithPoll {
    type HandshakeStream = <Inner as FlightService>::HandshakeStream;
    type ListFlightsStream = <Inner as FlightService>::ListFlightsStream;
    type DoGetStream = <Inner as FlightService>::DoGetStream;
    type DoPutStream = <Inner as FlightService>::DoPutStream;
    type DoExchangeStream = <Inner as FlightService>::DoExchangeStream;
    type DoActionStream = <Inner as FlightService>::DoActionStream;
    type ListActionsStream = <Inner as FlightService>::ListActionsStream;

    async fn handshake(
        &self,
        r: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        FlightService::handshake(&self.0, r).await
    }
    async fn list_flights(
        &self,
        r: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        FlightService::list_flights(&self.0, r).await
    }
    async fn get_flight_info(
        &self,
        r: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        FlightService::get_flight_info(&self.0, r).await
    }
    async fn poll_flight_info(
        &self,
        r: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        self.0.poll(r.into_inner()).await.map(Response::new)
    }
    async fn get_schema(
        &self,
        r: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        FlightService::get_schema(&self.0, r).await
    }
    async fn do_get(&self, r: Request<Ticket>) -> Result<Response<Self::DoGetStream>, Status> {
        FlightService::do_get(&self.0, r).await
    }
    async fn do_put(
        &self,
        r: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        FlightService::do_put(&self.0, r).await
    }
    async fn do_exchange(
        &self,
        r: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        FlightService::do_exchange(&self.0, r).await
    }
    async fn do_action(
        &self,
        r: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        FlightService::do_action(&self.0, r).await
    }
    async fn list_actions(
        &self,
        r: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        FlightService::list_actions(&self.0, r).await
    }
}
