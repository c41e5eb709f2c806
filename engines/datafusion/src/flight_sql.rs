//! An Arrow Flight SQL endpoint over a [`DistributedContext`]: any Flight SQL client (the ADBC
//! driver, the JDBC driver behind BI tools) runs distributed SQL on the cluster.
//!
//! - Statements and prepared statements run through [`DistributedContext::sql`];
//!   `SET flightshuffle.*` and `CREATE EXTERNAL TABLE` work as there. A prepared statement's
//!   placeholders (`$1`, `$2`, ...) are listed in its parameter schema and bound by `DoPut`
//!   with one row of values, kept for each execution until bound again.
//!   With results on the workers ([`Results::Workers`], the default of `serve`'s callers), a
//!   query's last stage runs on the workers too and its rows stay there
//!   ([`crate::held`]): the answer has **one endpoint per worker holding rows, located at that
//!   worker**, whose ticket is the worker's own read of its share, so a client reads the
//!   partitions in parallel straight from the workers (with the cluster token; its TLS roots
//!   must include the cluster's CA). A query that cannot end on the workers, and every result
//!   with [`Results::Driver`], is kept on the driver under a random handle and handed out as
//!   endpoints there, one per contiguous run of result batches (at most one per worker),
//!   `ordered`: reading them in order gives the query's order; each is read once. Results
//!   nobody reads are dropped after [`RESULT_TTL`] or when [`MAX_RESULTS`] newer ones are kept
//!   (rows on the workers: their shuffle is dropped then).
//! - `CancelFlightInfo` (a Flight action): a query runs within `GetFlightInfo`, so what is
//!   cancelled is its result: the rows kept for it (on the workers: its shuffle) are freed at
//!   once, and reading an endpoint of it afterwards fails naming it.
//! - Metadata: `GetSqlInfo` (name, version, read-only, no transactions), `GetCatalogs`,
//!   `GetDbSchemas`, `GetTables` (with table schemas), `GetTableTypes`.
//! - Auth: every call carries `authorization: Bearer <token>` (checked in constant time by
//!   [`TokenCheck`]), a `Handshake` too (answered with the same bearer, as the JDBC driver
//!   expects); a wrong or missing token is `Unauthenticated`. TLS with the cluster's
//!   certificate when the cluster has one.
//! - Errors: SQL and planning errors are `InvalidArgument` with DataFusion's message; anything
//!   the endpoint does not do is `Unimplemented`, by the trait's defaults.

mod kept;
mod params;
mod poll;

use crate::context::DistributedContext;
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::sql::metadata::{SqlInfoData, SqlInfoDataBuilder};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, CommandGetCatalogs, CommandGetDbSchemas,
    CommandGetSqlInfo, CommandGetTableTypes, CommandGetTables, CommandPreparedStatementQuery,
    CommandStatementQuery, CommandStatementUpdate, DoPutPreparedStatementResult, ProstMessageExt,
    SqlInfo, TicketStatementQuery,
};
use arrow_flight::{FlightDescriptor, FlightEndpoint, FlightInfo, Ticket};
use datafusion::common::ParamValues;
use futures::TryStreamExt;
use kept::{Kept, KeptResults, Polls};
pub use kept::{OnlineRunner, Rounds, MAX_RESULTS, RESULT_TTL};
use params::{bind, ipc_schema, no_statement, parameter_schema, positional};
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tonic::{Request, Response, Status};

/// Prepared statements kept at once per endpoint.
const MAX_PREPARED: usize = 1024;

/// A prepared statement: its text, its placeholders, and the values last bound to them.
struct Prepared {
    sql: String,
    /// One field per placeholder, typed as DataFusion inferred it (`Null`: any type).
    parameters: SchemaRef,
    params: Option<ParamValues>,
}

/// Where a query's rows are handed out from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Results {
    /// Kept on the driver, read through the endpoint.
    Driver,
    /// Left on the workers, read from them; the scheme of their locations (`grpc+tls`,
    /// `grpc+tcp`).
    Workers(String),
}

/// The Flight SQL service over one distributed SQL session.
pub struct FlightSqlEndpoint {
    ctx: Arc<DistributedContext>,
    /// Endpoints per result at most (the workers: a client reads that many in parallel).
    endpoints: usize,
    results_at: Results,
    results: KeptResults,
    /// Runs a query online for `PollFlightInfo` (None: polls run queries whole).
    online: Option<OnlineRunner>,
    polls: Polls,
    /// Results left on the workers, by when they were made (freed after [`RESULT_TTL`]).
    held: Mutex<Vec<(Instant, crate::result::Held)>>,
    prepared: Mutex<HashMap<String, Prepared>>,
    info: SqlInfoData,
}

type DoGetStream = <FlightSqlEndpoint as FlightService>::DoGetStream;
type HandshakeStream = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<arrow_flight::HandshakeResponse, Status>> + Send>,
>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A fresh random handle.
fn handle() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// An error of the SQL layer as a gRPC status: DataFusion's (SQL, planning) are the caller's.
fn status(e: crate::Error) -> Status {
    match e {
        crate::Error::DataFusion(e) => Status::invalid_argument(e.to_string()),
        crate::Error::Exchange(e) => Status::internal(e.to_string()),
    }
}

impl FlightSqlEndpoint {
    /// An endpoint running queries on `ctx`, handing each result out as at most `endpoints`
    /// endpoints.
    pub fn new(
        ctx: Arc<DistributedContext>,
        endpoints: usize,
        results_at: Results,
        online: Option<OnlineRunner>,
    ) -> crate::Result<Self> {
        let mut b = SqlInfoDataBuilder::new();
        b.append(SqlInfo::FlightSqlServerName, "flightshuffle");
        b.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
        b.append(SqlInfo::FlightSqlServerArrowVersion, "1.3");
        b.append(SqlInfo::FlightSqlServerReadOnly, true);
        b.append(SqlInfo::FlightSqlServerSql, true);
        b.append(SqlInfo::FlightSqlServerSubstrait, false);
        b.append(SqlInfo::FlightSqlServerTransaction, 0i32);
        b.append(SqlInfo::FlightSqlServerCancel, true);
        let info = b.build().map_err(|e| {
            crate::Error::DataFusion(datafusion::error::DataFusionError::External(Box::new(e)))
        })?;
        Ok(FlightSqlEndpoint {
            ctx,
            endpoints: endpoints.max(1),
            results_at,
            results: Default::default(),
            online,
            polls: Default::default(),
            held: Mutex::new(Vec::new()),
            prepared: Mutex::new(HashMap::new()),
            info,
        })
    }

    /// Free the results left on the workers past [`RESULT_TTL`], and the oldest past
    /// [`MAX_RESULTS`].
    async fn free_held(&self) {
        let old: Vec<crate::result::Held> = {
            let mut held = lock(&self.held);
            held.sort_by_key(|(at, _)| *at);
            let over = held.len().saturating_sub(MAX_RESULTS - 1);
            let expired = held
                .iter()
                .take_while(|(at, _)| at.elapsed() >= RESULT_TTL)
                .count();
            held.drain(..over.max(expired)).map(|(_, h)| h).collect()
        };
        for h in old {
            if let Err(e) = self.ctx.release(&h).await {
                tracing::warn!(shuffle = %h.shuffle, error = %e, "a held result was not freed");
            }
        }
    }

    /// Describe a result left on the workers: one endpoint per worker holding rows, there.
    fn on_workers(
        &self,
        scheme: &str,
        schema: &SchemaRef,
        held: crate::result::Held,
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo, Status> {
        let mut info = FlightInfo::new()
            .try_with_schema(schema)
            .map_err(|e| Status::internal(e.to_string()))?
            .with_descriptor(descriptor)
            .with_ordered(held.holders.len() <= 1)
            .with_total_records(held.rows as i64);
        let expires = (std::time::SystemTime::now() + RESULT_TTL)
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let expires = prost_types::Timestamp {
            seconds: expires.as_secs() as i64,
            nanos: expires.subsec_nanos() as i32,
        };
        for (_, addr, _) in &held.holders {
            let read = flightshuffle::proto::Ticket {
                kind: Some(flightshuffle::proto::ticket::Kind::Partition(
                    flightshuffle::proto::PartitionTicket {
                        shuffle_id: held.shuffle.0,
                        partition: 0,
                        wait_sealed: true,
                        timeout_ms: 0,
                        slice: 0,
                        slices: 1,
                    },
                )),
            };
            info = info.with_endpoint(
                FlightEndpoint::new()
                    .with_ticket(Ticket::new(read.encode_to_vec()))
                    .with_location(format!("{scheme}://{addr}"))
                    .with_expiration_time(expires),
            );
        }
        lock(&self.held).push((Instant::now(), held));
        Ok(info)
    }

    /// Run `sql` (with `params` bound), keep its rows and describe them as endpoints.
    async fn run(
        &self,
        sql: &str,
        params: Option<ParamValues>,
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo, Status> {
        let result = match &self.results_at {
            Results::Driver => self.ctx.sql_params(sql, params).await.map_err(status)?,
            Results::Workers(scheme) => {
                self.free_held().await;
                let sql_held = self.ctx.sql_held_with(sql, params);
                let mut result = sql_held.await.map_err(status)?;
                match result.held.take() {
                    Some(h) if !h.holders.is_empty() => {
                        return self.on_workers(scheme, &result.schema, h, descriptor);
                    }
                    // No rows anywhere: an empty answer from here.
                    Some(h) => self.ctx.release(&h).await.map_err(status)?,
                    None => {}
                }
                result
            }
        };
        let rows: i64 = result.batches.iter().map(|b| b.num_rows() as i64).sum();
        let batches: Vec<RecordBatch> = result
            .batches
            .into_iter()
            .filter(|b| b.num_rows() > 0)
            .collect();
        let n = self.endpoints.min(batches.len()).max(1);
        let per = batches.len().div_ceil(n).max(1);
        let mut chunks: Vec<Option<Vec<RecordBatch>>> =
            batches.chunks(per).map(|c| Some(c.to_vec())).collect();
        if chunks.is_empty() {
            chunks.push(Some(vec![]));
        }
        let id = handle();
        let mut info = FlightInfo::new()
            .try_with_schema(&result.schema)
            .map_err(|e| Status::internal(e.to_string()))?
            .with_descriptor(descriptor)
            .with_ordered(true)
            .with_total_records(rows);
        for i in 0..chunks.len() {
            let ticket = TicketStatementQuery {
                statement_handle: format!("{id}/{i}").into_bytes().into(),
            };
            info = info.with_endpoint(
                FlightEndpoint::new().with_ticket(Ticket::new(ticket.as_any().encode_to_vec())),
            );
        }
        kept::keep(
            &self.results,
            id,
            Kept {
                at: Instant::now(),
                chunks,
                schema: result.schema,
            },
        );
        Ok(info)
    }

    /// Free what `info`'s endpoints hand out (see the module doc); NotFound when nothing of
    /// it is kept any more (read whole, expired or cancelled before).
    async fn cancel(&self, info: &FlightInfo) -> Result<arrow_flight::CancelStatus, Status> {
        let mut found = false;
        for endpoint in &info.endpoint {
            let Some(ticket) = &endpoint.ticket else {
                continue;
            };
            let any = arrow_flight::sql::Any::decode(ticket.ticket.clone());
            if let Ok(Some(t)) = any.map(|a| a.unpack::<TicketStatementQuery>().ok().flatten()) {
                let handle = String::from_utf8_lossy(&t.statement_handle).to_string();
                let id = handle.split_once('/').map_or(handle.as_str(), |(id, _)| id);
                found |= lock(&self.results).remove(id).is_some();
                continue;
            }
            let read = flightshuffle::proto::Ticket::decode(ticket.ticket.clone());
            if let Ok(flightshuffle::proto::Ticket {
                kind: Some(flightshuffle::proto::ticket::Kind::Partition(p)),
            }) = read
            {
                let held = {
                    let mut held = lock(&self.held);
                    let at = held.iter().position(|(_, h)| h.shuffle.0 == p.shuffle_id);
                    at.map(|i| held.remove(i).1)
                };
                if let Some(h) = held {
                    found = true;
                    self.ctx.release(&h).await.map_err(status)?;
                }
            }
        }
        match found {
            true => Ok(arrow_flight::CancelStatus::Cancelled),
            false => Err(Status::not_found(
                "no such result: read whole already, expired or cancelled",
            )),
        }
    }

    /// One endpoint's rows as a Flight stream.
    fn stream(schema: SchemaRef, batches: Vec<RecordBatch>) -> DoGetStream {
        let s = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(futures::stream::iter(batches.into_iter().map(Ok)))
            .map_err(Status::from);
        Box::pin(s)
    }

    /// A metadata batch as a one-endpoint answer's rows.
    fn one<E: std::fmt::Display>(
        batch: Result<RecordBatch, E>,
    ) -> Result<Response<DoGetStream>, Status> {
        let batch = batch.map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(Self::stream(batch.schema(), vec![batch])))
    }

    /// A FlightInfo whose one endpoint's ticket is the command itself.
    fn describe(
        command: impl ProstMessageExt,
        schema: &arrow::datatypes::Schema,
        descriptor: FlightDescriptor,
    ) -> Result<Response<FlightInfo>, Status> {
        let ticket = Ticket::new(command.as_any().encode_to_vec());
        let info = FlightInfo::new()
            .try_with_schema(schema)
            .map_err(|e| Status::internal(e.to_string()))?
            .with_endpoint(FlightEndpoint::new().with_ticket(ticket))
            .with_descriptor(descriptor);
        Ok(Response::new(info))
    }

    /// Every (catalog, schema, table) of the session.
    fn tables(&self) -> Vec<(String, String, String)> {
        let session = self.ctx.session();
        let mut out = Vec::new();
        for c in session.catalog_names() {
            let Some(catalog) = session.catalog(&c) else {
                continue;
            };
            for s in catalog.schema_names() {
                let Some(schema) = catalog.schema(&s) else {
                    continue;
                };
                for t in schema.table_names() {
                    out.push((c.clone(), s.clone(), t));
                }
            }
        }
        out.sort();
        out
    }
}

/// The Flight action that cancels a FlightInfo (Flight's own `CancelFlightInfo`).
const CANCEL_FLIGHT_INFO: &str = "CancelFlightInfo";

#[tonic::async_trait]
impl FlightSqlService for FlightSqlEndpoint {
    type FlightService = FlightSqlEndpoint;

    async fn do_handshake(
        &self,
        request: Request<tonic::Streaming<arrow_flight::HandshakeRequest>>,
    ) -> Result<Response<HandshakeStream>, Status> {
        // The token was checked on the way in (`TokenCheck`): the answer hands the same bearer
        // back, the one a client that authenticates by handshake (the JDBC driver) sends from
        // then on.
        let bearer = request.metadata().get("authorization").cloned();
        let reply = arrow_flight::HandshakeResponse {
            protocol_version: 0,
            payload: Default::default(),
        };
        let stream: HandshakeStream = Box::pin(futures::stream::once(async { Ok(reply) }));
        let mut response = Response::new(stream);
        if let Some(bearer) = bearer {
            response.metadata_mut().insert("authorization", bearer);
        }
        Ok(response)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let info = self.run(&query.query, None, request.into_inner()).await?;
        Ok(Response::new(info))
    }

    async fn get_flight_info_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let h = String::from_utf8_lossy(&query.prepared_statement_handle).to_string();
        let (sql, params) = {
            let prepared = lock(&self.prepared);
            let p = prepared.get(&h).ok_or_else(|| no_statement(&h))?;
            if !p.parameters.fields().is_empty() && p.params.is_none() {
                return Err(Status::invalid_argument(format!(
                    "the statement has {} parameter(s): bind their values (DoPut) first",
                    p.parameters.fields().len()
                )));
            }
            (p.sql.clone(), p.params.clone())
        };
        let info = self.run(&sql, params, request.into_inner()).await?;
        Ok(Response::new(info))
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        _request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let t = String::from_utf8_lossy(&ticket.statement_handle).to_string();
        let bad = || Status::not_found(format!("no result {t:?}: read already, or expired"));
        let (id, i) = t.split_once('/').ok_or_else(bad)?;
        let i: usize = i.parse().map_err(|_| bad())?;
        let mut kept = lock(&self.results);
        let k = kept.get_mut(id).ok_or_else(bad)?;
        let batches = k.chunks.get_mut(i).and_then(Option::take).ok_or_else(bad)?;
        let schema = k.schema.clone();
        if k.chunks.iter().all(Option::is_none) {
            kept.remove(id);
        }
        Ok(Response::new(Self::stream(schema, batches)))
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        _request: Request<arrow_flight::Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        // Planned, not run: a DDL statement runs when it is executed, not here.
        let sql = positional(&query.query)?;
        let state = self.ctx.session().state();
        let plan = state
            .create_logical_plan(&sql)
            .await
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let schema = plan.schema().as_arrow().clone();
        let parameters = parameter_schema(&plan)?;
        let h = handle();
        let mut prepared = lock(&self.prepared);
        if prepared.len() >= MAX_PREPARED {
            return Err(Status::resource_exhausted(format!(
                "{MAX_PREPARED} prepared statements are open: close some"
            )));
        }
        prepared.insert(
            h.clone(),
            Prepared {
                sql,
                parameters: Arc::new(parameters.clone()),
                params: None,
            },
        );
        let parameter_schema = match parameters.fields().is_empty() {
            true => Default::default(),
            false => ipc_schema(&parameters)?,
        };
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: h.into_bytes().into(),
            dataset_schema: ipc_schema(&schema)?,
            parameter_schema,
        })
    }

    async fn do_action_close_prepared_statement(
        &self,
        query: ActionClosePreparedStatementRequest,
        _request: Request<arrow_flight::Action>,
    ) -> Result<(), Status> {
        let h = String::from_utf8_lossy(&query.prepared_statement_handle).to_string();
        lock(&self.prepared).remove(&h);
        Ok(())
    }

    async fn do_put_prepared_statement_query(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<DoPutPreparedStatementResult, Status> {
        let h = String::from_utf8_lossy(&query.prepared_statement_handle).to_string();
        let wanted = lock(&self.prepared)
            .get(&h)
            .map(|p| p.parameters.clone())
            .ok_or_else(|| no_statement(&h))?;
        let data = request
            .into_inner()
            .map_err(|e| arrow_flight::error::FlightError::Tonic(Box::new(e)));
        let batches: Vec<RecordBatch> =
            arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(data)
                .try_collect()
                .await
                .map_err(|e| Status::invalid_argument(format!("unreadable parameters: {e}")))?;
        let params = bind(&batches, &wanted)?;
        let mut prepared = lock(&self.prepared);
        let p = prepared.get_mut(&h).ok_or_else(|| no_statement(&h))?;
        p.params = Some(params);
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(query.prepared_statement_handle),
        })
    }

    async fn do_action_fallback(
        &self,
        request: Request<arrow_flight::Action>,
    ) -> Result<Response<<Self as FlightService>::DoActionStream>, Status> {
        let action = request.into_inner();
        if action.r#type != CANCEL_FLIGHT_INFO {
            return Err(Status::unimplemented(format!(
                "unknown action {:?}",
                action.r#type
            )));
        }
        let cancel = arrow_flight::CancelFlightInfoRequest::decode(action.body)
            .map_err(|e| Status::invalid_argument(format!("bad CancelFlightInfo: {e}")))?;
        let info = cancel
            .info
            .ok_or_else(|| Status::invalid_argument("CancelFlightInfo names no FlightInfo"))?;
        let status = self.cancel(&info).await?;
        let reply = arrow_flight::CancelFlightInfoResult {
            status: status as i32,
        };
        let body = arrow_flight::Result {
            body: reply.encode_to_vec().into(),
        };
        Ok(Response::new(Box::pin(futures::stream::once(async {
            Ok(body)
        }))))
    }

    async fn do_put_statement_update(
        &self,
        query: CommandStatementUpdate,
        _request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        // `SET flightshuffle.*` and DDL: no rows are counted.
        self.ctx.sql(&query.query).await.map_err(status)?;
        Ok(-1)
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder(&self.info).schema();
        Self::describe(query, &schema, request.into_inner())
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        _request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        Self::one(query.into_builder(&self.info).build())
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        Self::describe(query, &schema, request.into_inner())
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        _request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let mut b = query.into_builder();
        for c in self.ctx.session().catalog_names() {
            b.append(c);
        }
        Self::one(b.build())
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        Self::describe(query, &schema, request.into_inner())
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        _request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let session = self.ctx.session();
        let mut b = query.into_builder();
        for c in session.catalog_names() {
            if let Some(catalog) = session.catalog(&c) {
                for s in catalog.schema_names() {
                    b.append(&c, s);
                }
            }
        }
        Self::one(b.build())
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        Self::describe(query, &schema, request.into_inner())
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        _request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let session = self.ctx.session();
        let mut b = query.into_builder();
        for (c, s, t) in self.tables() {
            let Some(schema) = session.catalog(&c).and_then(|cat| cat.schema(&s)) else {
                continue;
            };
            let found = schema
                .table(&t)
                .await
                .map_err(|e| Status::internal(e.to_string()))?;
            let Some(provider) = found else { continue };
            let kind = match provider.table_type() {
                datafusion::datasource::TableType::View => "VIEW",
                _ => "TABLE",
            };
            b.append(&c, &s, &t, kind, provider.schema().as_ref())
                .map_err(|e| Status::internal(e.to_string()))?;
        }
        Self::one(b.build())
    }

    async fn get_flight_info_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        Self::describe(query, &schema, request.into_inner())
    }

    async fn do_get_table_types(
        &self,
        query: CommandGetTableTypes,
        _request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let mut b = query.into_builder();
        b.append("TABLE");
        b.append("VIEW");
        Self::one(b.build())
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}

/// Checks every call's `authorization: Bearer <token>` in constant time.
#[derive(Clone)]
pub struct TokenCheck {
    expected: Arc<str>,
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        use subtle::ConstantTimeEq;
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        match bool::from(got.as_bytes().ct_eq(self.expected.as_bytes())) {
            true => Ok(req),
            false => Err(Status::unauthenticated(
                "a Flight SQL call needs the header authorization: Bearer <the cluster's token>",
            )),
        }
    }
}

/// A running Flight SQL endpoint: its address, stopped when dropped.
pub struct FlightSqlServer {
    /// The address it listens on.
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for FlightSqlServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Serve Flight SQL over `ctx` on `listener` (on the current runtime) for clients with
/// `token`, with `tls` when given. Each result is handed out from `results_at`, as at most
/// `endpoints` endpoints from the driver; `online` runs polled queries online.
pub fn serve(
    ctx: Arc<DistributedContext>,
    listener: std::net::TcpListener,
    token: &str,
    tls: Option<tonic::transport::ServerTlsConfig>,
    endpoints: usize,
    results_at: Results,
    online: Option<OnlineRunner>,
) -> crate::Result<FlightSqlServer> {
    let io = |e: std::io::Error| {
        crate::Error::Exchange(flightshuffle::Error::Cluster(format!(
            "cannot serve Flight SQL: {e}"
        )))
    };
    listener.set_nonblocking(true).map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(io)?;
    let service = FlightServiceServer::with_interceptor(
        FlightSqlEndpoint::new(ctx, endpoints, results_at, online)?.with_poll(),
        TokenCheck {
            expected: format!("Bearer {token}").into(),
        },
    );
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| io(std::io::Error::other(e)))?;
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let server = builder
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stopped.await;
        });
    tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::warn!(error = %e, "the Flight SQL endpoint stopped");
        }
    });
    Ok(FlightSqlServer {
        addr,
        stop: Some(stop),
    })
}
