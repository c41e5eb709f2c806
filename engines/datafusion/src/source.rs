//! `StageSource`: how a worker runs one partition of a stage plan as a map task's input.

use crate::codec::ExchangeCodec;
use crate::ExchangeContext;
use arrow::datatypes::SchemaRef;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_proto::bytes::physical_plan_from_bytes_with_extension_codec;
use exchange::task::{BatchSource, BatchStream};
use exchange::worker::TOKEN_ENV;
use exchange::Error;
use futures::TryStreamExt;
use prost::Message;
use std::sync::Arc;
use std::time::Duration;

/// The payload of a stage map task.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StageTask {
    /// The stage plan (rooted at its ShuffleWriterExec), `datafusion-proto` bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub plan: Vec<u8>,
    #[prost(uint32, tag = "2")]
    pub partition: u32,
    /// Every worker's address, for the stage's shuffle readers.
    #[prost(string, repeated, tag = "3")]
    pub workers: Vec<String>,
    #[prost(uint64, tag = "4")]
    pub timeout_secs: u64,
    #[prost(uint32, tag = "5")]
    pub batch_size: u32,
}

pub struct StageSource;

fn task_err(e: impl std::fmt::Display) -> Error {
    Error::Task(e.to_string())
}

impl BatchSource for StageSource {
    fn open(&self, payload: &[u8], _schema: SchemaRef) -> exchange::Result<BatchStream> {
        let task = StageTask::decode(payload)
            .map_err(|e| Error::invalid(format!("malformed stage task: {e}")))?;
        let token = std::env::var(TOKEN_ENV).unwrap_or_default();
        let ectx = ExchangeContext::new(
            task.workers.clone(),
            &token,
            Duration::from_secs(task.timeout_secs.max(1)),
        )?;
        let mut config =
            crate::distributed_options(SessionConfig::new()).with_extension(Arc::new(ectx));
        if task.batch_size > 0 {
            config = config.with_batch_size(task.batch_size as usize);
        }
        let ctx = SessionContext::new_with_config(config);
        let task_ctx = ctx.task_ctx();
        let plan =
            physical_plan_from_bytes_with_extension_codec(&task.plan, &task_ctx, &ExchangeCodec)
                .map_err(|e| Error::invalid(format!("cannot decode stage plan: {e}")))?;
        let stream = plan
            .execute(task.partition as usize, task_ctx)
            .map_err(task_err)?;
        Ok(Box::pin(stream.map_err(task_err)))
    }
}
