//! `datafusion-proto` extension codec for the exchange's plan nodes, so stage plans containing
//! shuffle writers and readers can be sent to workers.

use crate::key_filter::KeyFilterExec;
use crate::reader::{ReadMode, ShuffleReaderExec};
use crate::split::{FactSplit, SplitScanExec};
use crate::split_totals::{SplitTotalsExec, Term};
use crate::writer::{ShuffleWriterExec, WriterKind};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use flightshuffle::block::Slice;
use flightshuffle::block::{decode_schema, encode_schema};
use flightshuffle::strategy::Strategy;
use flightshuffle::ShuffleId;
use prost::Message;
use std::sync::Arc;

#[derive(Clone, PartialEq, prost::Message)]
struct ReaderNode {
    #[prost(uint32, tag = "1")]
    stage: u32,
    #[prost(uint64, tag = "2")]
    shuffle: u64,
    #[prost(uint32, tag = "3")]
    mode: u32,
    #[prost(bytes = "vec", tag = "4")]
    schema_ipc: Vec<u8>,
    #[prost(uint32, tag = "5")]
    partitions: u32,
    /// A skew layout as (partition, slice index, slice count) triples, flattened.
    #[prost(uint32, repeated, tag = "6")]
    layout: Vec<u32>,
    /// The key columns its partitions are hashed on (names; their indices in `hash_indices`).
    #[prost(string, repeated, tag = "7")]
    hash_names: Vec<String>,
    #[prost(uint32, repeated, tag = "8")]
    hash_indices: Vec<u32>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WriterNode {
    #[prost(uint32, tag = "1")]
    stage: u32,
    #[prost(uint64, tag = "2")]
    shuffle: u64,
    #[prost(uint32, tag = "3")]
    kind: u32,
    #[prost(uint32, tag = "4")]
    partitions: u32,
    #[prost(string, repeated, tag = "5")]
    keys: Vec<String>,
    #[prost(string, tag = "6")]
    strategy: String,
}

/// An online query's split scan: the Parquet scan (`datafusion-proto` bytes) and the row
/// ranges of each of its partitions.
#[derive(Clone, PartialEq, prost::Message)]
struct SplitScanNode {
    #[prost(bytes = "vec", tag = "1")]
    scan: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    parts: Vec<SplitPart>,
    /// The parts are a build side's rows each split can meet.
    #[prost(bool, tag = "3")]
    build: bool,
}

/// The row ranges one partition of a split scan reads.
#[derive(Clone, PartialEq, prost::Message)]
struct SplitPart {
    #[prost(message, repeated, tag = "1")]
    ranges: Vec<FactSplit>,
}

/// An online query's per-split totals: its terms (factor pairs, flattened) and split sizes.
#[derive(Clone, PartialEq, prost::Message)]
struct SplitTotalsNode {
    #[prost(uint32, repeated, tag = "1")]
    terms: Vec<u32>,
    #[prost(uint64, repeated, tag = "2")]
    split_rows: Vec<u64>,
}

/// A key filter (its two inputs, keys side first, travel as the node's inputs).
#[derive(Clone, PartialEq, prost::Message)]
struct KeyFilterNode {
    #[prost(uint32, repeated, tag = "1")]
    key_columns: Vec<u32>,
    #[prost(uint32, repeated, tag = "2")]
    input_columns: Vec<u32>,
    #[prost(bool, tag = "3")]
    nulls_equal: bool,
    #[prost(uint64, tag = "4")]
    max_keys: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ExtensionNode {
    #[prost(message, optional, tag = "1")]
    reader: Option<ReaderNode>,
    #[prost(message, optional, tag = "2")]
    writer: Option<WriterNode>,
    #[prost(message, optional, tag = "3")]
    split_scan: Option<SplitScanNode>,
    #[prost(message, optional, tag = "4")]
    split_totals: Option<SplitTotalsNode>,
    #[prost(message, optional, tag = "5")]
    key_filter: Option<KeyFilterNode>,
}

/// The `datafusion-proto` extension codec for shuffle writers, shuffle readers, split scans
/// and per-split totals.
#[derive(Debug, Default)]
pub struct ExchangeCodec;

fn bad(what: &str) -> DataFusionError {
    DataFusionError::Plan(format!("malformed flightshuffle plan node: {what}"))
}

impl PhysicalExtensionCodec for ExchangeCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node = ExtensionNode::decode(buf).map_err(|e| bad(&e.to_string()))?;
        if let Some(s) = node.split_scan {
            let scan = physical_plan_from_bytes_with_extension_codec(&s.scan, ctx, self)?;
            let scan = scan
                .downcast_ref::<DataSourceExec>()
                .ok_or_else(|| bad("a split scan wraps no data source"))?;
            let parts = s.parts.into_iter().map(|p| p.ranges).collect();
            let split = SplitScanExec::try_grouped(scan, parts, s.build)
                .map_err(|e| bad(&e.to_string()))?;
            return Ok(Arc::new(split));
        }
        if let Some(k) = node.key_filter {
            let [keys, input] = inputs else {
                return Err(bad("a key filter without its two inputs"));
            };
            let cols = |v: Vec<u32>| v.into_iter().map(|c| c as usize).collect::<Vec<_>>();
            let max_keys = usize::try_from(k.max_keys).unwrap_or(usize::MAX);
            let filter = KeyFilterExec::try_new(
                keys.clone(),
                input.clone(),
                cols(k.key_columns),
                cols(k.input_columns),
                k.nulls_equal,
                max_keys,
            )
            .map_err(|e| bad(&e.to_string()))?;
            return Ok(Arc::new(filter));
        }
        if let Some(t) = node.split_totals {
            let input = inputs
                .first()
                .cloned()
                .ok_or_else(|| bad("per-split totals without input"))?;
            if t.terms.len() % 2 != 0 {
                return Err(bad("a term with one factor"));
            }
            let terms = t.terms.chunks(2).map(|p| Term(p[0], p[1])).collect();
            return Ok(Arc::new(SplitTotalsExec::try_new(
                input,
                terms,
                t.split_rows,
            )?));
        }
        if let Some(r) = node.reader {
            let mode = match r.mode {
                0 => ReadMode::Partition,
                1 => ReadMode::MapOutput,
                _ => return Err(bad("unknown reader mode")),
            };
            let schema = decode_schema(&r.schema_ipc).map_err(|e| bad(&e.to_string()))?;
            let reader = ShuffleReaderExec::new(
                r.stage,
                ShuffleId(r.shuffle),
                mode,
                schema,
                r.partitions as usize,
            );
            if r.layout.is_empty() {
                if r.hash_names.len() != r.hash_indices.len() {
                    return Err(bad("hash key names and indices do not match"));
                }
                let keys = r
                    .hash_names
                    .into_iter()
                    .zip(r.hash_indices.iter().map(|&i| i as usize))
                    .collect();
                return Ok(Arc::new(reader.with_hash_keys(keys)));
            }
            if r.layout.len() % 3 != 0 || r.layout.len() / 3 != r.partitions as usize {
                return Err(bad("skew layout does not match the partition count"));
            }
            let layout = r
                .layout
                .chunks(3)
                .map(|t| {
                    Ok((
                        t[0],
                        Slice::new(t[1], t[2]).map_err(|e| bad(&e.to_string()))?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Arc::new(reader.with_layout(Arc::new(layout))?));
        }
        if let Some(w) = node.writer {
            let input = inputs
                .first()
                .cloned()
                .ok_or_else(|| bad("writer without input"))?;
            let kind = WriterKind::from_u32(w.kind).ok_or_else(|| bad("unknown writer kind"))?;
            let strategy = if w.strategy.is_empty() {
                Strategy::Pull
            } else {
                w.strategy
                    .parse()
                    .map_err(|e: flightshuffle::Error| bad(&e.to_string()))?
            };
            return Ok(Arc::new(
                ShuffleWriterExec::new(
                    input,
                    w.stage,
                    ShuffleId(w.shuffle),
                    kind,
                    w.partitions,
                    w.keys,
                )
                .with_strategy(strategy),
            ));
        }
        Err(bad("empty extension node"))
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        let msg = if let Some(r) = node.downcast_ref::<ShuffleReaderExec>() {
            ExtensionNode {
                reader: Some(ReaderNode {
                    stage: r.stage,
                    shuffle: r.shuffle.0,
                    mode: r.mode as u32,
                    schema_ipc: encode_schema(&r.schema())
                        .map_err(|e| DataFusionError::External(Box::new(e)))?
                        .to_vec(),
                    partitions: r.partitions() as u32,
                    layout: r
                        .layout
                        .iter()
                        .flat_map(|l| l.iter())
                        .flat_map(|(p, s)| [*p, s.index, s.count])
                        .collect(),
                    hash_names: r.hash_keys.iter().flatten().map(|k| k.0.clone()).collect(),
                    hash_indices: r.hash_keys.iter().flatten().map(|k| k.1 as u32).collect(),
                }),
                ..Default::default()
            }
        } else if let Some(w) = node.downcast_ref::<ShuffleWriterExec>() {
            ExtensionNode {
                writer: Some(WriterNode {
                    stage: w.stage,
                    shuffle: w.shuffle.0,
                    kind: w.kind as u32,
                    partitions: w.partitions,
                    keys: w.keys.clone(),
                    strategy: w.strategy.to_string(),
                }),
                ..Default::default()
            }
        } else if let Some(s) = node.downcast_ref::<SplitScanExec>() {
            ExtensionNode {
                split_scan: Some(SplitScanNode {
                    scan: physical_plan_to_bytes_with_extension_codec(s.scan(), self)?.to_vec(),
                    parts: s
                        .parts
                        .iter()
                        .map(|ranges| SplitPart {
                            ranges: ranges.clone(),
                        })
                        .collect(),
                    build: s.build,
                }),
                ..Default::default()
            }
        } else if let Some(k) = node.downcast_ref::<KeyFilterExec>() {
            let cols = |v: &[usize]| v.iter().map(|c| *c as u32).collect::<Vec<_>>();
            ExtensionNode {
                key_filter: Some(KeyFilterNode {
                    key_columns: cols(k.key_columns()),
                    input_columns: cols(k.input_columns()),
                    nulls_equal: k.nulls_equal(),
                    max_keys: k.max_keys() as u64,
                }),
                ..Default::default()
            }
        } else if let Some(t) = node.downcast_ref::<SplitTotalsExec>() {
            ExtensionNode {
                split_totals: Some(SplitTotalsNode {
                    terms: t.terms.iter().flat_map(|t| [t.0, t.1]).collect(),
                    split_rows: t.split_rows.as_ref().clone(),
                }),
                ..Default::default()
            }
        } else {
            return Err(DataFusionError::NotImplemented(format!(
                "cannot send plan node {} to workers",
                node.name()
            )));
        };
        msg.encode(buf)
            .map_err(|e| DataFusionError::Internal(e.to_string()))
    }
}
