//! Prepared statements' parameters over Flight SQL: the parameter schema of a statement's
//! placeholders (`$1`, `$2`, ...), and the values a client binds with `DoPut` (one row).

use arrow::array::{Array, RecordBatch};
use arrow::datatypes::{DataType, Schema};
use datafusion::common::{ParamValues, ScalarValue};
use tonic::Status;

pub(super) fn no_statement(h: &str) -> Status {
    Status::not_found(format!(
        "no prepared statement {h:?} (closed, or never made)"
    ))
}

/// A schema as the IPC message Flight SQL carries.
pub(super) fn ipc_schema(schema: &arrow::datatypes::Schema) -> Result<prost::bytes::Bytes, Status> {
    let options = arrow::ipc::writer::IpcWriteOptions::default();
    arrow_flight::IpcMessage::try_from(arrow_flight::SchemaAsIpc::new(schema, &options))
        .map(|m| m.0)
        .map_err(|e| Status::internal(e.to_string()))
}

/// The placeholders of `plan` (`$1`, `$2`, ...) as a schema of one field each, in order; a
/// type DataFusion cannot infer is `Null` (any value binds). Named placeholders are refused.
pub(super) fn parameter_schema(
    plan: &datafusion::logical_expr::LogicalPlan,
) -> Result<arrow::datatypes::Schema, Status> {
    let types = plan
        .get_parameter_types()
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let mut numbered = Vec::with_capacity(types.len());
    for (name, ty) in types {
        let n: usize = name
            .strip_prefix('$')
            .and_then(|n| n.parse().ok())
            .filter(|&n| n >= 1)
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "placeholder {name}: only positional ones ($1, $2, ...) are supported"
                ))
            })?;
        numbered.push((n, name, ty.unwrap_or(arrow::datatypes::DataType::Null)));
    }
    numbered.sort_by_key(|(n, _, _)| *n);
    if let Some(gap) = numbered
        .iter()
        .enumerate()
        .find(|(i, (n, _, _))| *n != i + 1)
    {
        return Err(Status::invalid_argument(format!(
            "placeholders must be numbered $1 to $N without gaps; ${} is missing",
            gap.0 + 1
        )));
    }
    Ok(arrow::datatypes::Schema::new(
        numbered
            .into_iter()
            .map(|(_, name, ty)| arrow::datatypes::Field::new(name, ty, true))
            .collect::<Vec<_>>(),
    ))
}

const STRICT: arrow::compute::CastOptions<'static> = arrow::compute::CastOptions {
    safe: false,
    format_options: arrow::util::display::FormatOptions::new(),
};

/// The values of one execution: the single row of `batches`, one column per placeholder of
/// `wanted`, each cast to its placeholder's type where DataFusion inferred one (a client's
/// 64-bit integer binds to a 32-bit column, a string to a date).
pub(super) fn bind(batches: &[RecordBatch], wanted: &Schema) -> Result<ParamValues, Status> {
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Err(Status::invalid_argument(
            "no parameter values: send one row, a column per placeholder",
        ));
    };
    if rows != 1 {
        return Err(Status::invalid_argument(format!(
            "{rows} rows of parameters: a query takes one row per execution"
        )));
    }
    if batch.num_columns() != wanted.fields().len() {
        return Err(Status::invalid_argument(format!(
            "{} parameter value(s) for {} placeholder(s)",
            batch.num_columns(),
            wanted.fields().len()
        )));
    }
    let mut values = Vec::with_capacity(batch.num_columns());
    for (column, field) in batch.columns().iter().zip(wanted.fields()) {
        let row = column.slice(batch.num_rows() - 1, 1);
        let typed = match field.data_type() {
            DataType::Null => row,
            t if t == row.data_type() => row,
            // Not `safe`: a value that does not convert is an error, not a null.
            t => arrow::compute::cast_with_options(&row, t, &STRICT).map_err(|e| {
                Status::invalid_argument(format!(
                    "parameter {} takes {t}, and {} does not convert: {e}",
                    field.name(),
                    row.data_type()
                ))
            })?,
        };
        let value = ScalarValue::try_from_array(&typed, 0).map_err(|e| {
            Status::invalid_argument(format!("unusable value of {}: {e}", field.name()))
        })?;
        values.push(value);
    }
    Ok(ParamValues::from(values))
}
